"""`rlvr` processes forked by one interpreter that already imported what `rlvr run` imports.

A fresh `rlvr run` pays ~7 CPU-seconds of imports (torch, transformers, Prefect, the stages) before its first line
of work, which was most of what the process-heavy tests cost on 2 cores (issue 52). A ForkServer pays them once:
it imports, freezes the collector's view of those objects as `rlvr run` does, and forks a child per command. A child
is a process of its own (its pid, signals, exit status, stdout and stderr files) that runs `rlvr ARGS` as
`python -c "...; main()"` would: it leaves the fork loop and ends the script, so a SystemExit or an uncaught
exception ends it as it ends any interpreter.

What a child cannot change is what the imports already read: the environment a command gets must equal the
server's in the keys Prefect reads at import (`PREFECT_*`), which `start` checks. Tests of what a fresh interpreter
does (start-up cost, `rlvr`'s own process tree, a main guard) start real interpreters instead.

The server reports "forked PID" and "exited PID STATUS" on its stdout; `ForkServer` turns them into `Forked`
handles with what the tests use of subprocess.Popen.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.cli_helpers import REPO

# argv[1]: "module:function" called in the server before the imports ("" for none); argv[2]: "module:function"
# called in each child with its spec before `rlvr` runs ("" for none); then the spec's own "hook", if it names one.
SERVER = """
import importlib, os, sys


def call(target, *args):
    if target:
        module, _, name = target.partition(":")
        getattr(importlib.import_module(module), name)(*args)


call(sys.argv[1])
from rlvr.flows.cli import main
for module in ("rlvr.flows.config", "rlvr.flows.runs", "rlvr.trainer.devices", "rlvr.trainer.policy", "rich.progress"):
    importlib.import_module(module)
from rlvr.startup_objects import freeze_after_run_imports
freeze_after_run_imports()  # as `rlvr run` does: the children's collections skip what the imports made


from rlvr.fork_requests import serve_forks
spec = serve_forks(1)
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
for fd, path in ((1, spec["stdout"]), (2, spec["stderr"])):
    if fd == 2 and path == spec["stdout"]:
        os.dup2(1, 2)  # one file for both, as stderr=subprocess.STDOUT
    else:
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
os.chdir(spec["cwd"])
if spec["env"] is not None:
    os.environ.clear()
    os.environ.update(spec["env"])
call(sys.argv[2], spec)
call(spec.get("hook", ""), spec)
sys.argv = ["-c", *spec["args"]]
main()
"""


class ForkServer:
    """Starts `rlvr` processes forked from one warm interpreter and learns how they ended."""

    def __init__(self, env: dict[str, str], folder: Path, *, prepare: str = "", child: str = "") -> None:
        self.env, self.folder = env, folder
        self.log = folder / "server.err"
        self._names = itertools.count()
        with self.log.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", SERVER, prepare, child],
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        self.forked: list[int] = []  # forked, not yet handed to the `start` that asked
        self.started: list[int] = []
        self.exits: dict[int, int] = {}
        self.gone = False
        self.changed = threading.Condition()
        threading.Thread(target=self._hear, daemon=True).start()

    def _hear(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, pid, *status = line.decode().split()
            with self.changed:
                if kind == "forked":
                    self.forked.append(int(pid))
                else:
                    self.exits[int(pid)] = int(status[0])
                self.changed.notify_all()
        with self.changed:
            self.gone = True  # no more children, no more exits
            self.changed.notify_all()

    def start(
        self,
        args: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | Path = REPO,
        stdout: Path | None = None,
        stderr: Path | None = None,
        **extra: Any,
    ) -> Forked:
        """A new process running `rlvr ARGS` in `cwd` with `env` (the server's when None). Its stdout and stderr go
        to files: new ones in the server's folder unless named, one file for both when the two are the same.
        `extra` goes to the child hooks in its spec; `hook="module:function"` there is called in this child alone."""
        if env is not None:
            differ = sorted(k for k in {*env, *self.env} if k.startswith("PREFECT_") and env.get(k) != self.env.get(k))
            assert not differ, f"the fork server's imports read {differ} already; start this command as a process"
        name = next(self._names)
        stdout = stdout or self.folder / f"{name}.out"
        stderr = stderr or self.folder / f"{name}.err"
        for path in (stdout, stderr):
            path.touch()  # there from now on, as a Popen's redirected files are, though the child opens them later
        spec = {"args": args, "env": env, "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr), **extra}
        assert self.proc.stdin is not None
        with self.changed:
            self.proc.stdin.write(json.dumps(spec).encode() + b"\n")
            self.proc.stdin.flush()
            self.changed.wait_for(lambda: self.forked or self.gone, timeout=300)  # the first waits for the imports
            assert self.forked, f"no process forked; the server's stderr: {self.log.read_text()}"
            self.started.append(self.forked.pop(0))
            return Forked(self, self.started[-1], stdout, stderr)

    def run(
        self, args: list[str], *, env: dict[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        """`rlvr ARGS` to its end, as tests.cli_helpers.rlvr runs it: its status, stdout and stderr."""
        child = self.start(args, env=env)
        try:
            status = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            raise
        return subprocess.CompletedProcess(args, status, child.stdout_text(), child.stderr_text())

    def close(self) -> None:
        """Kill the children still running (a failed test leaves none behind), then end the server."""
        with self.changed:
            running = [pid for pid in self.started if pid not in self.exits]
        for pid in running:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class Forked:
    """One process of a ForkServer, with what the tests use of subprocess.Popen."""

    def __init__(self, server: ForkServer, pid: int, stdout: Path, stderr: Path) -> None:
        self.server, self.pid, self.stdout, self.stderr = server, pid, stdout, stderr

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        with self.server.changed:
            return self.server.exits.get(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        server = self.server
        with server.changed:
            if not server.changed.wait_for(lambda: self.pid in server.exits or server.gone, timeout=timeout):
                raise subprocess.TimeoutExpired(f"rlvr process {self.pid}", timeout or 0)
            assert self.pid in server.exits, f"the fork server ended first; its stderr: {server.log.read_text()}"
            return server.exits[self.pid]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def stdout_text(self) -> str:
        return self.stdout.read_text(errors="replace")

    def stderr_text(self) -> str:
        return self.stderr.read_text(errors="replace")


def fork_server(env: dict[str, str], folder: Path, **hooks: str) -> Iterator[ForkServer]:
    """A ForkServer for a fixture's lifetime (`yield from fork_server(...)`), closed after."""
    server = ForkServer(env, folder, **hooks)
    try:
        yield server
    finally:
        server.close()
