"""Rank processes forked from one warm interpreter (the zygote) instead of started as fresh ones.

A fresh rank process pays its imports (torch, transformers, the trainer: about 5 CPU-seconds) before it can join
the group. The run's process starts one zygote the first time it needs ranks: `python -m
rlvr.trainer.ranks.zygote_main`, which imports what a rank imports, then forks a rank for each request and reports
the ranks' exits. Every later rank (of the same group, or of a group started again at another shape or after a
lost one) is a fork that starts at once. `RankProcess` is the handle rank 0 keeps, with what `RankGroup` uses of
subprocess.Popen.

A rank forked here is the zygote's child, not rank 0's: it still watches rank 0 itself (launch.py `main`), and
it gets the environment rank 0 has when it asks for it. The zygote has no thread of its own (a fork copies only
the forking one), and exits when its request pipe closes or rank 0 is no longer its parent (checked every 0.1 s;
not PR_SET_PDEATHSIG, which fires when the thread that started it ends, and a stage's thread may). A rank's command
line is the zygote's; its name (`ps -o comm`, /proc/PID/comm) is `rlvr-rank-N`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from rlvr.child_guard import is_running, start_time

START_TIMEOUT_S = 120.0  # the zygote's imports, on a busy machine


class RankProcess:
    """A rank forked by the zygote: its pid, and its exit status once the zygote reports it (as Popen's
    returncode: negative for a signal)."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid, self._zygote = pid, zygote
        self.started = start_time(pid)
        self.returncode: int | None = None
        self.ended = threading.Event()

    def poll(self) -> int | None:
        if self.returncode is None and self._zygote.gone and not is_running(self.pid, self.started):
            self._exited(-signal.SIGKILL)  # the zygote died first: its status is lost, the rank is gone
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ended.wait(0.1) and self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _exited(self, code: int) -> None:
        self.returncode = code
        self.ended.set()


class Zygote:
    """Rank 0's side of the zygote: starts it, asks it for ranks, and reads the exits it reports."""

    def __init__(self) -> None:
        replies_r, replies_w = os.pipe()
        command = [sys.executable, "-m", "rlvr.trainer.ranks.zygote_main", str(replies_w), str(os.getpid())]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, pass_fds=(replies_w,))
        os.close(replies_w)
        self._replies = os.fdopen(replies_r, "r")
        self._lock = threading.Lock()  # one request at a time: the next "forked" line answers it
        self._forked: list[int] = []
        self._forked_ready = threading.Condition()
        self._children: dict[int, RankProcess] = {}
        self._early: dict[int, int] = {}  # exits read before their handle was made
        self.gone = False
        threading.Thread(target=self._read, name="rlvr-rank-zygote", daemon=True).start()

    def start(self, argv: Sequence[str]) -> RankProcess:
        """A rank running launch.py's `main(argv)`, in this process's current environment."""
        request = json.dumps({"argv": list(argv), "env": dict(os.environ)}) + "\n"
        with self._lock:
            assert self.process.stdin is not None
            self.process.stdin.write(request.encode())
            self.process.stdin.flush()
            with self._forked_ready:
                if not self._forked_ready.wait_for(lambda: self._forked or self.gone, timeout=START_TIMEOUT_S):
                    raise RuntimeError(
                        f"the rank zygote (pid {self.process.pid}) forked no rank within {START_TIMEOUT_S:g} s"
                    )
                if not self._forked:
                    raise RuntimeError(f"the rank zygote (pid {self.process.pid}) exited ({self.process.poll()})")
                pid = self._forked.pop(0)
                child = self._children[pid] = RankProcess(pid, self)
                if pid in self._early:
                    child._exited(self._early.pop(pid))
        return child

    def _read(self) -> None:
        for line in self._replies:
            kind, pid, *rest = line.split()
            with self._forked_ready:
                if kind == "forked":
                    self._forked.append(int(pid))
                    self._forked_ready.notify_all()
                elif int(pid) in self._children:
                    self._children[int(pid)]._exited(int(rest[0]))
                else:
                    self._early[int(pid)] = int(rest[0])
        with self._forked_ready:
            self.gone = True
            self._forked_ready.notify_all()

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait()


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def start_rank(argv: Sequence[str]) -> RankProcess:
    """A rank process for `argv` (launch.py `main`'s arguments), forked by this process's zygote, which is started
    on first use and again if it died."""
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.gone or _zygote.process.poll() is not None:
            _zygote = Zygote()
        zygote = _zygote
    return zygote.start(argv)
