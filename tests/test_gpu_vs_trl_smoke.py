"""benchmarks/gpu_vs_trl.py in its CPU smoke mode: a whole `rlvr run` of the tiny model, TRL left out; the figures
it prints exist and are positive (the GPU run itself needs a lent machine: see the script's docstring)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_helpers import cli_env

pytestmark = pytest.mark.slow  # a real `rlvr run` in a subprocess: ~35-45 s on a 2-core machine

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ("completions/s", "step s", "rollout tokens/s", "training tokens/s", "outside the model share")


def ours(output: str, label: str) -> float:
    """The `rlvr run` column of the table row `label` ("12.5%" read as 12.5)."""
    match = re.search(rf"^{re.escape(label)}\s+([0-9.]+)%?\s", output, re.MULTILINE)
    assert match, f"no row {label!r} in:\n{output}"
    return float(match.group(1))


def test_smoke_mode_prints_positive_figures(prefect_api):
    """On the session's Prefect server: the script's `rlvr run` takes the environment, and without PREFECT_API_URL
    it would start a temporary server of its own (13 CPU-seconds)."""
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_vs_trl.py", "--model", "tiny", "--device", "cpu", "--no-trl"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=cli_env(PREFECT_API_URL=prefect_api),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    output = done.stdout
    for label in FIGURES:
        assert ours(output, label) > 0, label
    assert re.search(r"^peak GPU memory GiB\s+n/a\s", output, re.MULTILINE)  # the CPU keeps no such count
    assert "TRL skipped: --no-trl" in output
    trained = re.search(r"groups trained (\d+)%", output)  # the reward varies within groups, so they train
    assert trained and int(trained[1]) > 0
    assert re.search(r"^rlvr run completions/s = [0-9.]+", output, re.MULTILINE)
