"""The project installs as rlvr.* only: no top-level flows, tasks, storage, verifiers, trainer or curricula,
so PyPI's `verifiers` (prime-rl's) installs beside it and both import."""

from __future__ import annotations

import site
import subprocess
import sys
import venv

import pytest

OUR_PACKAGES = ("flows", "tasks", "storage", "verifiers", "trainer", "curricula")


def test_nothing_generic_is_installed_at_the_top_level(tmp_path):
    script = (
        "import importlib.util, rlvr.flows.cli, rlvr.verifiers.registry\n"
        f"print([name for name in {OUR_PACKAGES!r} if importlib.util.find_spec(name) is not None])"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.slow
def test_pypi_verifiers_installs_beside_ours_and_both_import(tmp_path):
    """A fresh environment that sees this project's installed packages (as if they were its own) gets
    PyPI's `verifiers` with pip; then `verifiers` is theirs and `rlvr.verifiers` is ours."""
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)  # this interpreter's pip installs into it (`--python`): no ensurepip
    python = env_dir / "bin" / "python"
    env_site = subprocess.run(
        [python, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    ours = site.getsitepackages()[0]
    with open(f"{env_site}/rlvr_project.pth", "w") as pth:
        pth.write(f"import site; site.addsitedir({ours!r})\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "verifiers"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    script = (
        "import verifiers, verifiers.v1\n"
        "from rlvr.verifiers.registry import get_verifier, registered\n"
        "print(verifiers.__file__)\n"
        "print(sorted(registered()))\n"
        "print(get_verifier('math').score('the answer is $\\\\frac{1}{2}$', '0.5').status)\n"
    )
    result = subprocess.run([python, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    theirs_file, registry, status = result.stdout.strip().splitlines()
    assert theirs_file.startswith(env_site)  # PyPI's package, not ours
    assert "math" in registry and "arithmetic" in registry
    assert status == "ok"
