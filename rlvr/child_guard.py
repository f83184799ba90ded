"""Child processes die with the run, even when the run is killed with SIGKILL.

Two tools, both polling every `POLL_S` seconds rather than relying on PR_SET_PDEATHSIG in the run's
process: that signal fires when the *thread* that forked the child exits, and Prefect starts its server
from whichever worker thread first needs it.

- The guard: `python -I -S child_guard.py PARENT_PID -- COMMAND...` starts COMMAND, forwards SIGTERM, SIGINT
  and SIGHUP to it, and exits with its exit status (Prefect reads exit code 3 as "port taken"). When its
  parent changes (PARENT_PID died, the guard was re-parented) it stops COMMAND: SIGTERM, then SIGKILL after
  `STOP_GRACE_S`. COMMAND runs in a process group of its own, with PR_SET_PDEATHSIG (safe here: the guard
  has a single thread), so it dies with the guard too. The guard uses the standard library only and runs
  by file path in isolated mode, so it starts whatever the environment's PYTHONPATH (one more process:
  about 45 ms to start, 12 MB resident).
  `guard_prefect_server` puts it in front of the temporary API server Prefect starts when no
  PREFECT_API_URL is set, in a process group of its own: a signal to the run's whole group (a terminal's
  Ctrl-C; `timeout`, a batch scheduler or a container stopping the job) then reaches the run alone, which
  still has its server while it records the failure, and the server stops when the run has exited (Prefect's
  own `stop`, or the guard seeing its parent gone). In the run's group the server died at the same moment,
  and the run spent minutes retrying to tell it that the flow had crashed, holding its memory (a GPU's too).
- `exit_when_gone`: a daemon thread that ends the calling process (`os._exit`) once a given process is
  gone; the verifier pool's workers watch the run's process with it.

A watched process is named by its pid and its start time (from /proc/PID/stat), so a pid that the kernel
reuses for a new process does not pass for the old one; a zombie counts as gone.
"""

from __future__ import annotations

import importlib.machinery
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often a guard or a watcher looks at the process it watches
STOP_GRACE_S = 3.0  # between SIGTERM and SIGKILL when the guard stops its command
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
EXIT_PARENT_GONE = 1  # exit code of a guard or watched process whose parent died
PREFECT_SERVER_MODULE = "prefect.server.api.server"
_PR_SET_PDEATHSIG = 1


# ---------------------------------------------------------------------------------------------
# Naming a process


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), or None when it is gone, a zombie, or /proc is absent."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # the command name, in parentheses, may hold spaces
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def is_running(pid: int, started: int | None) -> bool:
    """Whether the process that had `pid` and `started` (from `start_time`) still runs. With no start time
    (no /proc) only the pid's existence is checked."""
    if started is not None:
        return start_time(pid) == started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_when_gone(pid: int, started: int | None, before_exit: Callable[[], None] | None = None) -> threading.Thread:
    """Start a daemon thread that calls `before_exit`, then `os._exit`, once the process (`pid`, `started`)
    is gone. For a process whose work may block for long (a verifier call) and that must not outlive it."""

    def watch() -> None:
        while is_running(pid, started):
            time.sleep(POLL_S)
        try:
            if before_exit is not None:
                before_exit()
        finally:
            os._exit(EXIT_PARENT_GONE)

    thread = threading.Thread(target=watch, name=f"exit-when-{pid}-gone", daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------------------------------------
# The guard


def guarded_command(command: Sequence[str], parent_pid: int | None = None) -> list[str]:
    """`command` started through the guard, which stops it when `parent_pid` (default: this process) dies."""
    guard = os.path.abspath(__file__)
    return [sys.executable, "-I", "-S", guard, str(parent_pid or os.getpid()), "--", *command]


def _die_with_guard(guard_pid: int) -> Callable[[], None]:
    """The command's pre-exec step: SIGKILL when the guard dies, even by SIGKILL (Prefect's stop() ends with
    one). The guard has a single thread, so the signal cannot fire while the guard lives."""

    def apply() -> None:
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != guard_pid:  # the guard died before prctl took effect
            os._exit(EXIT_PARENT_GONE)

    return apply


def _forward_signals(child: list[subprocess.Popen[bytes]], pending: list[int]) -> None:
    """Forward FORWARDED_SIGNALS to the child; one that arrives before the child exists waits in `pending`."""

    def forward(signum: int, _frame: Any) -> None:
        if child:
            child[0].send_signal(signum)  # does nothing once the child is reaped: no stray signal to a reused pid
        else:
            pending.append(signum)

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)


def _exit_notice(pid: int) -> int | None:
    """A pidfd for `pid` (readable once it exits), or None where the system has none (Linux < 5.3)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _wait_up_to(child: subprocess.Popen[bytes], seconds: float, exited: int | None) -> int | None:
    """The child's exit status, or None after `seconds`. Sleeps on the pidfd: Popen.wait(timeout) would
    wake every 50 ms, for hours."""
    if exited is None:
        try:
            return child.wait(seconds)
        except subprocess.TimeoutExpired:
            return None
    select.select([exited], [], [], seconds)
    return child.poll()


def _stop(child: subprocess.Popen[bytes]) -> int:
    child.terminate()
    try:
        return child.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()


def _exit_like(returncode: int) -> None:
    """Exit as the child did: with its exit code, or killed by the same signal when that is SIGKILL or one
    of FORWARDED_SIGNALS (others, which may dump core, become exit code 128 + the signal, as in a shell)."""
    if -returncode in FORWARDED_SIGNALS:
        signal.signal(-returncode, signal.SIG_DFL)
    if -returncode in (*FORWARDED_SIGNALS, signal.SIGKILL):
        os.kill(os.getpid(), -returncode)
    sys.exit(returncode if returncode >= 0 else 128 - returncode)


def run_guarded(parent_pid: int, command: Sequence[str]) -> int:
    """Run `command` until it exits (its exit status) or `parent_pid` is no longer our parent (stop it;
    EXIT_PARENT_GONE)."""
    child: list[subprocess.Popen[bytes]] = []
    pending: list[int] = []
    _forward_signals(child, pending)
    if os.getppid() != parent_pid:
        return EXIT_PARENT_GONE
    child.append(subprocess.Popen(list(command), preexec_fn=_die_with_guard(os.getpid()), process_group=0))
    for signum in pending:
        child[0].send_signal(signum)
    exited = _exit_notice(child[0].pid)
    while (returncode := _wait_up_to(child[0], POLL_S, exited)) is None:
        if os.getppid() != parent_pid:
            _stop(child[0])
            return EXIT_PARENT_GONE
    return returncode


def main(argv: Sequence[str]) -> None:
    """`child_guard.py PARENT_PID -- COMMAND...`"""
    if len(argv) < 3 or not argv[0].isdigit() or argv[1] != "--":
        sys.exit("usage: child_guard.py PARENT_PID -- COMMAND...")
    _exit_like(run_guarded(int(argv[0]), argv[2:]))


# ---------------------------------------------------------------------------------------------
# Prefect's temporary server


class _GuardingSubprocess:
    """Stands in for `subprocess` in Prefect's server module: while `_run_uvicorn_command` runs in this
    thread, Popen starts its command through the guard. Everything else is the real module's."""

    def __init__(self) -> None:
        self.active = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    def Popen(self, args: Sequence[str], *rest: Any, **kwargs: Any) -> subprocess.Popen[Any]:
        if getattr(self.active, "on", False):
            args = guarded_command(args)
            kwargs["process_group"] = 0  # out of the run's group: the module docstring says why
        return subprocess.Popen(args, *rest, **kwargs)


def _guard_server_class(module: ModuleType) -> None:
    """Wrap SubprocessASGIServer._run_uvicorn_command so the server it starts runs under the guard."""
    server_class = getattr(module, "SubprocessASGIServer", None)
    original = getattr(server_class, "_run_uvicorn_command", None)
    if server_class is None or original is None:
        log.warning("Prefect's temporary server is not guarded: %s has changed", PREFECT_SERVER_MODULE)
        return
    if getattr(original, "_rlvr_guarded", False):
        return
    stand_in = _GuardingSubprocess()
    setattr(module, "subprocess", stand_in)  # noqa: B010 (a module attribute, set on purpose)

    def run_uvicorn_command(self: Any) -> Any:
        stand_in.active.on = True
        try:
            process = original(self)
        finally:
            stand_in.active.on = False
        if os.path.abspath(__file__) not in getattr(process, "args", ()):
            log.warning("Prefect's temporary server is not guarded: it was not started through subprocess.Popen")
        return process

    setattr(run_uvicorn_command, "_rlvr_guarded", True)  # noqa: B010
    server_class._run_uvicorn_command = run_uvicorn_command


class _GuardOnImport:
    """A sys.meta_path finder that guards Prefect's server class right after its module is imported, so that
    a command that never starts the server does not pay for importing it (seconds)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != PREFECT_SERVER_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_then_guard(module: ModuleType) -> None:
            execute(module)
            _guard_server_class(module)

        loader.exec_module = exec_then_guard
        return spec


def guard_prefect_server() -> None:
    """Make the temporary API server Prefect starts (no PREFECT_API_URL) die with this process. Idempotent;
    imports nothing of Prefect."""
    module = sys.modules.get(PREFECT_SERVER_MODULE)
    if module is not None:
        _guard_server_class(module)
    elif not any(isinstance(finder, _GuardOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _GuardOnImport())


if __name__ == "__main__":
    main(sys.argv[1:])
