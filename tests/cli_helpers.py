"""Run the `rlvr` command line in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parent.parent

# A whole run at its smallest: 2 RL steps of 4 prompts x 4 samples, a short warm start and difficulty estimate, one
# evaluation and one checkpoint at the end (the `--set` overrides of the tests that need a real run, not its figures).
SMALL_RUN = [
    "train.steps=2",
    "select.batch_size=4",
    "allocate.n=4",
    "warmstart.steps=20",
    "difficulty.k=2",
    "evaluate.every=2",
    "checkpoint.every=2",
]
T = TypeVar("T")


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


def wait_for(
    predicate: Callable[[], T], timeout: float, what: str, *, log: Path | None = None, every: float = 0.5
) -> T:
    """Call `predicate` every `every` seconds until it returns something truthy, and return that; after
    `timeout` seconds an AssertionError naming `what` (with the end of `log`, the waited-on command's output).
    A predicate fails at once by raising, e.g. when the process it watches has ended."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            tail = f"; its log ends:\n{log.read_text(errors='replace')[-3000:]}" if log is not None else ""
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{tail}")
        time.sleep(every)
    return value


def committed(store: Path, kind: str = "") -> int:
    """Manifests (of `kind`, when given) in a local store's manifests folder, counted by a listing (cheaper than
    opening the store, which a kill test polls every few ms); a manifest still being written is a
    `.json.tmp-...` file until it is renamed, and does not count."""
    try:
        names = os.listdir(store / "manifests")
    except FileNotFoundError:
        return 0
    return sum(1 for name in names if name.startswith(f"{kind}-" if kind else "") and name.endswith(".json"))
