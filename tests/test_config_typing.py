"""The run config is typed where it is used: mypy (with the project's settings) checks a section's fields, so
a misspelt key such as `cfg.train.grpo.kl_betta` is an error while `cfg.train.grpo.kl_beta` is a float."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDERS = ["flows", "tasks", "storage", "verifiers", "trainer", "curricula", "data"]

SNIPPET = """
from rlvr.flows.config import RunConfigBase


def beta(cfg: RunConfigBase) -> float:
    return cfg.train.grpo.kl_beta


def batch(cfg: RunConfigBase) -> str:
    return cfg.select.batch_size  # an int


def typo(cfg: RunConfigBase) -> float:
    return cfg.train.grpo.kl_betta
"""


def typecheck_links() -> None:
    """build/typecheck/rlvr as `make lint` links it (setuptools' package-dir is invisible to mypy), when a test
    run comes without `make lint` before it."""
    package = REPO / "build" / "typecheck" / "rlvr"
    if (package / "flows").exists():
        return
    package.mkdir(parents=True, exist_ok=True)
    for folder in FOLDERS:
        (package / folder).symlink_to(REPO / folder)
    for path in (REPO / "rlvr").glob("*.py"):
        (package / path.name).symlink_to(path)


def test_mypy_catches_a_misspelt_config_field(tmp_path):
    """Run from the repository with its mypy settings (and the cache `make lint` just filled)."""
    typecheck_links()
    snippet = tmp_path / "snippet.py"
    snippet.write_text(SNIPPET)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "pyproject.toml", str(snippet)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = [line for line in done.stdout.splitlines() if "snippet.py" in line]
    assert len(errors) == 2, done.stdout + done.stderr
    assert 'Incompatible return value type (got "int", expected "str")' in errors[0]
    assert '"GRPOConfig" has no attribute "kl_betta"' in errors[1]
