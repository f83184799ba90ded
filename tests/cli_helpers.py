"""Run the `rlvr` command line in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def rlvr_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlvr.flows.cli", *args]


def rlvr(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        rlvr_command(*args), capture_output=True, text=True, cwd=REPO, env=env or cli_env(), timeout=timeout
    )
