"""Fork a child per request: the loop of a warm interpreter that imported once what its children need (the rank
zygote, trainer/ranks/zygote.py; the tests' fork server, tests/fork_server.py).

Requests are JSON lines on stdin; each forks a child, in which `serve_forks` returns the request. The parent writes
"forked PID" for each child and "exited PID STATUS" (Popen's returncode: negative for a signal) as each ends, one
line each, to `replies`. It exits when stdin closes, or when `parent` is given and is no longer its parent.
"""

from __future__ import annotations

import json
import os
import select
from typing import Any


def serve_forks(replies: int, parent: int | None = None) -> dict[str, Any]:
    """Serve until the process exits; return the request in each child."""
    pending = b""
    while True:
        ready = select.select([0], [], [], 0.1)[0]
        if parent is not None and os.getppid() != parent:
            os._exit(0)
        _report_exits(replies)
        if not ready:
            continue
        data = os.read(0, 1 << 20)
        if not data:
            os._exit(0)
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                return json.loads(line)
            os.write(replies, f"forked {pid}\n".encode())


def _report_exits(replies: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        os.write(replies, f"exited {pid} {os.waitstatus_to_exitcode(status)}\n".encode())
