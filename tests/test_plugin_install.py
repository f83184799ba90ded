"""A third-party verifier, packaged and pip-installed into this venv, works everywhere by entry point."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.cli_helpers import rlvr

pytestmark = pytest.mark.serial  # pip-installs a package into the venv every other test imports from

PACKAGE = "rlvr-shout-verifier"

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "rlvr-shout-verifier"
version = "0.1.0"

[project.entry-points."rlvr.verifiers"]
shout = "rlvr_shout:ShoutVerifier"
"""

MODULE = '''
from rlvr.verifiers.base import Score, Verifier


class ShoutVerifier(Verifier):
    """Correct when the response is the reference in capital letters."""

    name = "shout"
    domain = "shouting"
    version = "1"

    def score(self, response, reference):
        if not isinstance(response, str) or not response.strip():
            return Score(0.0, "unparseable", reason="nothing said")
        ok = response.strip() == str(reference).upper()
        return Score(1.0 if ok else 0.0, "ok" if ok else "wrong", extracted=response.strip())
'''


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory):
    source = tmp_path_factory.mktemp("plugin")
    (source / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (source / "rlvr_shout.py").write_text(textwrap.dedent(MODULE))
    result = pip("install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet", str(source))
    assert result.returncode == 0, result.stderr
    yield
    pip("uninstall", "--yes", "--quiet", PACKAGE)


def test_cli_lists_and_uses_the_installed_plugin(installed_plugin, tmp_path):
    listing = rlvr("verifiers")
    assert listing.returncode == 0, listing.stderr
    assert "shout" in listing.stdout and "shouting" in listing.stdout
    lines = tmp_path / "in.jsonl"
    lines.write_text(
        "\n".join(
            json.dumps(x)
            for x in [
                {"response": "HELLO", "reference": "hello"},
                {"response": "hello", "reference": "hello"},
                {"response": "", "reference": "x"},
            ]
        )
        + "\n"
    )
    result = rlvr("verify", "--verifier", "shout", "--input", str(lines))
    assert result.returncode == 0, result.stderr
    statuses = [json.loads(line)["status"] for line in result.stdout.splitlines()]
    assert statuses == ["ok", "wrong", "unparseable"]


def test_pool_and_cache_label_with_the_plugin(installed_plugin, tmp_path):
    import importlib.metadata

    from rlvr.storage.store import Store
    from rlvr.verifiers.cache import VerifierConfig, score_cached

    importlib.invalidate_caches()
    assert any(ep.name == "shout" for ep in importlib.metadata.entry_points(group="rlvr.verifiers"))
    store = Store.open(str(tmp_path / "store"), create=True)
    scores, hits, entries = score_cached(
        store, VerifierConfig(verifier="shout", workers=1), [("ABC", "abc"), ("abc", "abc"), ("ABC", "abc")]
    )
    assert [s.status for s in scores] == ["ok", "wrong", "ok"]
    assert hits == [False, False, False] and len(entries) == 2
    again, hits, _ = score_cached(store, VerifierConfig(verifier="shout", workers=1), [("ABC", "abc")])
    assert again[0].status == "ok" and hits == [True]
