"""Run the `rlvr` command line in a subprocess, as a user would."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from tests.fork_server import ForkServer

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


def rlvr(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300, forks: ForkServer | None = None
) -> subprocess.CompletedProcess:
    """`rlvr ARGS` to its end: a new interpreter, or a process forked by `forks` (tests/fork_server.py) in that
    server's environment (or `env`)."""
    if forks is not None:
        return forks.run(list(args), env=env, timeout=timeout)
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


class FolderChanges:
    """Wakes a waiting test when an entry is made, renamed or removed in a folder it watches (Linux inotify).

    The kill tests must act at a precise moment of a run (a manifest renamed in, a shard written); polled every
    2 ms, their conditions cost the pytest process 5-10% of a core for the minutes a run takes, in a suite that
    is CPU-bound. Here a condition is checked when a watched folder changes, and every `every` seconds besides
    (for a folder made before it was watched, or where inotify is missing). Use as a context manager."""

    # IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE: entries appear (a rename commits a manifest) or go
    CHANGES = 0x40 | 0x80 | 0x100 | 0x200

    def __init__(self) -> None:
        self._fd = -1
        self._watched: set[str] = set()
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            self._add = libc.inotify_add_watch
            self._fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError):  # no inotify here: waits fall back to the timeout
            pass

    def watch(self, folders: Iterable[Path]) -> None:
        """Watch these folders too (those that exist; a folder already watched is skipped)."""
        if self._fd < 0:
            return
        for folder in folders:
            name = str(folder)
            if name not in self._watched and self._add(self._fd, os.fsencode(name), self.CHANGES) >= 0:
                self._watched.add(name)

    def wait(self, every: float) -> None:
        """Return once a watched folder changed (perhaps since the last wait), or after `every` seconds."""
        if self._fd < 0:
            time.sleep(every)
            return
        if select.select([self._fd], [], [], every)[0]:
            try:
                while os.read(self._fd, 1 << 16):  # drain: the condition is checked once for all of them
                    pass
            except BlockingIOError:
                pass

    def __enter__(self) -> FolderChanges:
        return self

    def __exit__(self, *_: object) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def store_folders(store: Path, *kinds: str) -> list[Path]:
    """The folders whose entries change as a local store is made and written: its parent (the store appears), the
    store, its manifests (a commit renames one in), its artifacts, and the artifact folders of `kinds`."""
    return [store.parent, store, store / "manifests", store / "artifacts", *(store / "artifacts" / k for k in kinds)]


def committed(store: Path, kind: str = "") -> int:
    """Manifests (of `kind`, when given) in a local store's manifests folder, counted by a listing (cheaper than
    opening the store, which a kill test polls every few ms); a manifest still being written is a
    `.json.tmp-...` file until it is renamed, and does not count."""
    try:
        names = os.listdir(store / "manifests")
    except FileNotFoundError:
        return 0
    return sum(1 for name in names if name.startswith(f"{kind}-" if kind else "") and name.endswith(".json"))


def rank_processes(mark: str, parent: int | None = None) -> list[int]:
    """Pids of live data-parallel ranks (trainer/ranks/launch.py names each `rlvr-rank-N`) started by runs whose
    environment holds `mark`; with `parent`, only those of the run with that pid (a rank is the child of the run's
    rank zygote, trainer/ranks/zygote.py, itself the run's child)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            name = (entry / "comm").read_text().strip()
            environment = (entry / "environ").read_bytes()
            state, ppid = (entry / "stat").read_text().split(") ")[-1].split()[:2]
        except OSError:
            continue
        if not name.startswith("rlvr-rank-") or mark.encode() not in environment or state == "Z":
            continue
        if parent is None or _parent_of(int(ppid)) == parent:
            found.append(int(entry.name))
    return found


def _parent_of(pid: int) -> int | None:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().split(") ")[-1].split()[1])
    except OSError:
        return None
