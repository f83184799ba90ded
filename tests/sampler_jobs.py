"""The job server test_sampler_process.py's worker processes run. Its own module, importing nothing heavy: a
spawned worker imports the module that defines its server, and the test module imports torch, transformers and
Prefect (about 6 CPU-seconds a worker)."""

from __future__ import annotations

import os
import signal

from rlvr.errors import UserError


class Doubler:
    """A server for the worker: doubles numbers; "fail" raises, "user" raises a UserError, "exit" exits, "kill"
    is SIGKILLed."""

    def __init__(self, offset: int) -> None:
        self.offset = offset

    def __call__(self, job: object) -> object:
        if job == "fail":
            raise ValueError("no such number")
        if job == "user":
            raise UserError("a one-line reason")
        if job == "exit":
            os._exit(7)
        if job == "kill":  # what the out-of-memory killer does
            os.kill(os.getpid(), signal.SIGKILL)
        if job == "pid":
            return os.getpid()
        assert isinstance(job, int)
        return 2 * job + self.offset
