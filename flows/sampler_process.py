"""A worker process for flow.sampler=process: jobs go in through a pipe in order, results come back in order.

The sampling half of flow.async_level runs here so that it has an interpreter of its own: on a thread beside
the trainer the two sides mostly took turns on Python's interpreter lock (docs/training.md). The process is
started with `spawn` (a forked copy of a process that holds torch's thread pools and a Prefect server client
is not safe), once per run, and it dies with the run: it watches the run's process and exits within a
second of its death, even by SIGKILL and even mid-job (rlvr/child_guard.py's `exit_when_gone`, as the
verifier pool's workers do), so a killed run does not leave a sampler writing for long to the store that
`rlvr resume` opens; what it had not committed is redone by the resumed run. It is not a daemon process,
since it starts processes of its own (the verifier pool), so the run stops it (`close`); Ctrl-C is the
run's to handle.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from rlvr.child_guard import exit_when_gone, start_time
from rlvr.errors import UserError
from rlvr.spawn_main import without_main
from rlvr.startup_objects import freeze_startup_objects

Serve = Callable[[Any], Any]  # one job in, its result out


class SamplerDied(RuntimeError):
    """The worker process ended without answering (killed, or out of memory)."""


def _serve_loop(
    jobs: Connection, owner: tuple[int, int | None], make_server: Callable[..., Serve], args: tuple[Any, ...]
) -> None:
    """The worker's body: build the server once, then answer each job until the pipe says stop (then the
    server's `close`, when it has one) or closes."""
    exit_when_gone(*owner)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve = make_server(*args)
    freeze_startup_objects()  # a process of its own, its imports done: out of every later collection
    while True:
        try:
            job = jobs.recv()
        except EOFError:
            return
        if job is None:
            close = getattr(serve, "close", None)
            if close is not None:
                close()
            return
        try:
            jobs.send(("ok", serve(job)))
        except UserError as error:
            jobs.send(("user_error", str(error)))
        except Exception:  # the whole traceback goes to the run's process, which raises it
            jobs.send(("error", traceback.format_exc()))


class WorkerProcess:
    """A process that runs `make_server(*args)` once and then serves jobs: `submit` queues one, `result`
    waits for the oldest unanswered one. Several may be queued; they are served one at a time, in order."""

    def __init__(self, make_server: Callable[..., Serve], args: tuple[Any, ...], name: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._jobs, theirs = context.Pipe()
        owner = (os.getpid(), start_time(os.getpid()))
        self._process = context.Process(target=_serve_loop, args=(theirs, owner, make_server, args), name=name)
        with without_main():  # its work is all in the package: a script without a main guard is not run again
            self._process.start()
        theirs.close()
        self.pending = 0

    def submit(self, job: Any) -> None:
        try:
            self._jobs.send(job)
        except OSError:  # a broken pipe or a connection reset: the process is gone
            raise self._died() from None
        self.pending += 1

    def result(self) -> Any:
        """The oldest queued job's result; its exception again when it raised (a UserError as one line)."""
        while not self._jobs.poll(0.5):
            if not self._process.is_alive():
                raise self._died()
        try:
            kind, payload = self._jobs.recv()
        except (EOFError, OSError):  # its end of the pipe closed or was reset: it is exiting or gone
            raise self._died() from None
        self.pending -= 1
        if kind == "user_error":
            raise UserError(payload)
        if kind == "error":
            raise RuntimeError(f"the sampler process failed:\n{payload}")
        return payload

    def _died(self) -> SamplerDied:
        self._process.join(timeout=5)
        code = self._process.exitcode
        if code is None or code >= 0:
            return SamplerDied(f"the sampler process ended (exit code {code}) mid-job")
        name = signal.Signals(-code).name
        why = ""
        if name == "SIGKILL":
            why = " (the kernel's out-of-memory killer sends it; the sampler holds a model of its own)"
        return SamplerDied(f"the sampler process was killed by {name}{why} mid-job; `rlvr resume` goes on")

    def close(self) -> None:
        """Stop the worker: after its current job when it is healthy, at once when it does not stop."""
        try:
            self._jobs.send(None)
        except (BrokenPipeError, OSError):
            pass
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._jobs.close()
