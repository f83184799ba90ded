"""Runs one untrusted Python program and owns its isolation: `run_program` and `ProgramResult`.

Every run gets a fresh temporary working directory (the program is `solution.py` there, `HOME` points
at it), a new session and process group, a minimal environment (PATH, LANG, HOME: nothing of ours is
inherited), stdin from a file holding the given text, and the interpreter in isolated mode
(`python3 -I -S`). The interpreter is the system one (/usr/bin/python3) when it exists: it lives
under /usr, so it is readable by an unprivileged uid and bound into bubblewrap with the rest of /usr;
a venv or pyenv interpreter under /root would be neither.

Layers, from always-on to best-effort:

1. rlimits, ALWAYS applied before the program (and bubblewrap) start: RLIMIT_CPU (timeout + 1 s),
   RLIMIT_AS (memory_mb), RLIMIT_FSIZE (16 MB), RLIMIT_NPROC, RLIMIT_NOFILE, RLIMIT_CORE (0), plus
   PR_SET_PDEATHSIG so the direct child dies with the process that started it. util-linux's prlimit
   and setpriv set them (and switch the uid, below) when present; otherwise a preexec_fn does,
   which costs a full fork of the calling process instead of a vfork.
2. When we run as root, the program runs as its own unprivileged uid (one of `UID_SLOTS` uids from
   `UID_BASE`, held by a file lock for the length of the run, so concurrent runs in other workers
   never share one; successive runs take successive uids). A uid of its own rather than `nobody`:
   RLIMIT_NPROC counts per uid, and the kernel never enforces it for root, so only this makes the
   process cap real and scoped to this one run. It also means the program cannot write to
   root-owned paths (the repository, the store), cannot read other processes' /proc/PID/environ,
   and cannot signal them.
   After the run every process still owned by that uid is killed (`kill(-1)` from a helper running
   as that uid), whatever session or process group it moved itself into. A run that was itself killed
   mid-way (the pool SIGKILLs a worker past its deadline) may leave processes under its uid; the next
   run in any worker kills them before it starts. A worker whose run died kills them before it exits
   (`kill_running_programs`).
   When we are not root there is no uid to switch to: RLIMIT_NPROC is then our own uid's current
   task count plus `MAX_PROCESSES` (the kernel counts per uid), and cleanup relies on the process
   group kill and, under bubblewrap, on the PID namespace.
3. bubblewrap, when `bwrap` exists and a probe run succeeds (user namespaces can be unavailable
   inside containers): `--unshare-all` (network, PID, IPC, UTS, user, cgroup namespaces: no network
   at all, not even the host's loopback), `--die-with-parent`, a new root holding only read-only
   binds of /usr and the /bin, /lib* links or dirs, a fresh /proc and /dev, a private tmpfs /tmp, and
   the working directory bound read-write at its own path as the cwd.

The wall-clock timeout kills the whole process group with SIGKILL (under bubblewrap that takes the
PID namespace with it). Output is read incrementally; past `max_output_bytes` on stdout or stderr the
run is killed and the result marked `output_truncated`.

What is guaranteed where (tests/test_code_verifier.py checks each):
- everywhere: CPU, address-space, file-size and open-file limits; wall-clock timeout; output cap; no
  inherited environment variables; a private working directory, deleted afterwards.
- as root (the project's containers): also a per-run uid, so a real process cap, no process left behind, no writes to
  root-owned directories, no reading other processes' environment.
- with bubblewrap: also no network (a fresh network namespace), writes outside the working directory
  land in a private tmpfs that vanishes, the host's processes are invisible (PID namespace).
- without bubblewrap (a warning says so once per process): the program can still open network
  connections, and write where its uid may (world-writable dirs such as /tmp); not as root it can
  also read its parent's environment through /proc.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import itertools
import logging
import math
import os
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger(__name__)

Isolation = Literal["bubblewrap", "rlimits"]

FILE_SIZE_LIMIT_BYTES = 16 * 1024 * 1024
MAX_PROCESSES = 32  # processes and threads the program may have at once (RLIMIT_NPROC)
MAX_OPEN_FILES = 64
UID_BASE = 1_500_000_000  # far above any login or subordinate uid range
UID_SLOTS = 1024
KILL_WAIT_S = 5.0  # how long to wait for a SIGKILLed child to be reaped
SWEEP_ROUNDS = 50  # kill(-1) rounds before giving up on a uid's processes (10 ms apart)
PROBE_TIMEOUT_S = 10.0
READ_CHUNK = 65536
POLL_S = 0.1  # how often the read loop checks whether the program exited while a pipe stays open
PROGRAM_FILE = "solution.py"
DIR_PREFIX = "rlvr-sandbox-"  # then the pid of the process that made it, then mkdtemp's suffix
SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
INTERPRETER_CANDIDATES = ("/usr/bin/python3", "/usr/local/bin/python3")
UNAVAILABLE_WARNING = "bubblewrap unavailable: code runs with rlimits only, isolation reduced"

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
_warned_unavailable = False
_run_counter = itertools.count()
_stale_dirs_removed = False
_running: dict[int, int | None] = {}  # process group of each program running now -> its sandbox uid (None: ours)


class SandboxError(RuntimeError):
    """The sandbox itself could not run the program (not the program's fault)."""


@dataclass(frozen=True)
class ProgramResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    output_truncated: bool
    seconds: float
    isolation: Isolation


@dataclass(frozen=True)
class _Limits:
    timeout_s: float
    memory_mb: int
    max_output_bytes: int


def interpreter() -> str:
    """The Python the programs run under (see the module docstring for why the system one)."""
    for candidate in INTERPRETER_CANDIDATES:
        if os.access(candidate, os.X_OK):
            return candidate
    return os.path.realpath(sys.executable)


# ---------------------------------------------------------------------------------------------
# Processes of a uid


def _status_field(status: bytes, name: bytes) -> bytes:
    start = status.find(b"\n" + name + b":")
    if start < 0:
        return b""
    start += len(name) + 2
    end = status.find(b"\n", start)
    return status[start:end].strip()


def _proc_status(pid: str) -> tuple[int, bool, int] | None:
    """(real uid, is a zombie, threads) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as file:
            status = file.read()
    except OSError:
        return None
    uids = _status_field(status, b"Uid").split()
    if not uids:
        return None
    zombie = _status_field(status, b"State")[:1] in (b"Z", b"X")
    return int(uids[0]), zombie, int(_status_field(status, b"Threads") or b"1")


def _scan_uids(low: int, high: int) -> dict[int, list[tuple[int, bool]]]:
    """uid -> [(pid, is_zombie), ...] for processes whose real uid is in [low, high)."""
    found: dict[int, list[tuple[int, bool]]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            status = _proc_status(name)
            if status is not None and low <= status[0] < high:
                found.setdefault(status[0], []).append((int(name), status[1]))
    return found


def _processes_of_uid(uid: int) -> tuple[list[int], int]:
    """(pids of running processes, number of zombies) of `uid`. A zombie runs nothing but counts
    against RLIMIT_NPROC until its parent (often init, after an orphaning) reaps it."""
    processes = _scan_uids(uid, uid + 1).get(uid, [])
    running = [pid for pid, zombie in processes if not zombie]
    return running, len(processes) - len(running)


def _tasks_of_uid(uid: int) -> int:
    """Threads owned by `uid`: what RLIMIT_NPROC counts."""
    total = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            status = _proc_status(name)
            if status is not None and status[0] == uid:
                total += status[2]
    return total


@functools.cache
def _kill_program() -> str:
    found = shutil.which("kill")
    if found is None:
        raise RuntimeError("the sandbox needs the `kill` program (procps or util-linux) to end a uid's processes")
    return found


def _kill_uid(uid: int) -> int:
    """SIGKILL every running process of `uid`; returns how many zombies of it remain.

    A helper becomes that uid and calls kill(-1), which reaches exactly the processes that uid may
    signal, i.e. its own, in whatever process group, session or PID namespace they are. The helper is the
    `kill` program, which subprocess switches to the uid before exec, not a Python fork: a fork from one
    thread of a process with others clears their thread states in the child, and a destructor there can
    wait forever (a torch gloo process group held by another thread did, and hung a test worker)."""
    for _ in range(SWEEP_ROUNDS):
        running, zombies = _processes_of_uid(uid)
        if not running:
            return zombies
        subprocess.run([_kill_program(), "-9", "-1"], user=uid, group=uid, extra_groups=[], check=False)
        time.sleep(0.01)
    running, zombies = _processes_of_uid(uid)
    log.error("processes of sandbox uid %d survived %d kill rounds: %s", uid, SWEEP_ROUNDS, running)
    return zombies


def _lock_uid(uid: int) -> int | None:
    """Lock `uid` for one run and return the lock's fd, or None when another run holds it."""
    lock_dir = os.path.join(tempfile.gettempdir(), "rlvr-sandbox-uids")
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(lock_dir, f"{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class _UidSlot:
    """An unprivileged uid of its own for one run, held through a lock file.

    Taking one first kills the processes of sandbox uids that no run holds: leftovers of a run that
    was killed before its cleanup (a pool worker SIGKILLed past its deadline). Then it takes the next
    uid, in rotation, that has no process at all, zombies included: a zombie still counts against
    RLIMIT_NPROC until init reaps it, so a fresh uid keeps the previous run's from eating this one's cap.
    """

    def __init__(self) -> None:
        found = _scan_uids(UID_BASE, UID_BASE + UID_SLOTS)
        for uid, processes in found.items():
            if any(not zombie for _, zombie in processes):
                fd = _lock_uid(uid)
                if fd is not None:
                    _kill_uid(uid)
                    os.close(fd)
        start = os.getpid() * 31 + next(_run_counter)
        for step in range(UID_SLOTS):
            uid = UID_BASE + (start + step) % UID_SLOTS
            if uid in found:
                continue
            fd = _lock_uid(uid)
            if fd is not None:
                self.uid = uid
                self._fd = fd
                return
        raise SandboxError(f"all {UID_SLOTS} sandbox uids are in use or still have processes")

    def release(self) -> None:
        _kill_uid(self.uid)
        os.close(self._fd)


# ---------------------------------------------------------------------------------------------
# The child's limits and the command line


def _rlimits(limits: _Limits, uid: int | None) -> list[tuple[str, int, int]]:
    """(prlimit option, resource, value) for each limit the program runs under."""
    if uid is None:  # our own uid: its existing tasks count against the cap too
        processes = _tasks_of_uid(os.getuid()) + MAX_PROCESSES
    else:
        processes = MAX_PROCESSES
    return [
        ("--cpu", resource.RLIMIT_CPU, math.ceil(limits.timeout_s) + 1),
        ("--as", resource.RLIMIT_AS, limits.memory_mb * 1024 * 1024),
        ("--fsize", resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT_BYTES),
        ("--nproc", resource.RLIMIT_NPROC, processes),
        ("--nofile", resource.RLIMIT_NOFILE, MAX_OPEN_FILES),
        ("--core", resource.RLIMIT_CORE, 0),
    ]


@functools.lru_cache(maxsize=1)
def _util_linux_launcher() -> tuple[str, str] | None:
    """Paths of util-linux's prlimit and setpriv (one new enough for --pdeathsig), or None.

    With them the child needs no Python code between fork and exec, so subprocess can vfork: a full
    fork of a large worker (sympy loaded) costs about 10 ms of CPU per run, more than the program."""
    prlimit, setpriv = shutil.which("prlimit"), shutil.which("setpriv")
    if prlimit is None or setpriv is None:
        return None
    try:
        usage = subprocess.run([setpriv, "--help"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return (prlimit, setpriv) if "--pdeathsig" in usage else None


def _launcher_argv(launcher: tuple[str, str], rlimits: list[tuple[str, int, int]], uid: int | None) -> list[str]:
    """prlimit sets the limits, setpriv drops to `uid` (real, effective and saved; no groups, no
    capabilities left) and sets the parent-death signal, then execs the rest of the command line."""
    prlimit, setpriv = launcher
    argv = [prlimit] + [f"{option}={value}" for option, _, value in rlimits] + ["--", setpriv]
    if uid is not None:
        argv += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    return argv + ["--pdeathsig=KILL", "--"]


def _child_setup(rlimits: list[tuple[str, int, int]]) -> Callable[[], None]:
    """The same limits without util-linux: runs in the child after fork, after subprocess switched
    the uid, before exec."""

    def apply() -> None:
        for _, which, value in rlimits:
            resource.setrlimit(which, (value, value))
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return apply


def _bwrap_argv(python: str, work_dir: str) -> list[str]:
    argv = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr"]
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    argv += ["--ro-bind-try", "/etc/alternatives", "/etc/alternatives"]
    if not python.startswith("/usr/"):
        prefix = os.path.dirname(os.path.dirname(python))
        argv += ["--ro-bind", prefix, prefix]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    argv += ["--bind", work_dir, work_dir, "--chdir", work_dir, "--"]
    return argv


# ---------------------------------------------------------------------------------------------
# Running


def _has_exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it: while it is unreaped its pid cannot be
    reused, so the process-group kill that follows cannot hit a stranger."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _read_output(process: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout and stderr until both close, the program exits, the deadline, or the cap."""
    assert process.stdout is not None and process.stderr is not None  # started with PIPEs
    buffers = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    timed_out = truncated = False
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            events = selector.select(min(remaining, POLL_S))
            for key, _ in events:
                chunk = os.read(key.fd, READ_CHUNK)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                buffer += chunk
                if len(buffer) > cap:
                    del buffer[cap:]
                    truncated = True
            if truncated:
                break
            if not events and _has_exited(process.pid):
                break  # exited; whatever still holds the pipes (a leftover child) is killed next
    return bytes(buffers[process.stdout.fileno()]), bytes(buffers[process.stderr.fileno()]), timed_out, truncated


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(function: Callable[[str], object], failed_path: str, _exc_info: object) -> None:
        parent = os.path.dirname(failed_path)
        os.chmod(parent, os.stat(parent).st_mode | stat.S_IRWXU)
        function(failed_path)

    try:
        shutil.rmtree(path, onerror=make_writable_and_retry)
    except OSError as exc:
        log.warning("could not remove sandbox directory %s: %s", path, exc)


def _remove_dirs_of_dead_processes() -> None:
    """Working directories left by processes killed mid-run (a pool worker past its deadline); their
    names carry the pid of the process that made them. Done once per process, by its first run."""
    global _stale_dirs_removed
    if _stale_dirs_removed:
        return
    _stale_dirs_removed = True
    temp_dir = tempfile.gettempdir()
    for name in os.listdir(temp_dir):
        parts = name.split("-")
        if (
            len(parts) == 4
            and name.startswith(DIR_PREFIX)
            and parts[2].isdigit()
            and not os.path.exists(f"/proc/{parts[2]}")
        ):
            _remove_tree(os.path.join(temp_dir, name))


def _run(source: str, stdin: str, limits: _Limits, extra_files: dict[str, str], use_bwrap: bool) -> ProgramResult:
    for name in extra_files:
        if not name or name != os.path.basename(name) or name in (".", "..", PROGRAM_FILE):
            raise ValueError(f"extra file name {name!r} must be a plain file name other than {PROGRAM_FILE}")
    _remove_dirs_of_dead_processes()
    slot = _UidSlot() if os.geteuid() == 0 else None
    root_dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-")
    try:
        work_dir, stdin_path = _prepare_work_dir(root_dir, source, stdin, extra_files, slot)
        uid = slot.uid if slot is not None else None
        argv, switch = _command(work_dir, limits, uid, use_bwrap)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work_dir}
        started = time.monotonic()
        with open(stdin_path, "rb") as stdin_file:
            try:
                process = subprocess.Popen(
                    argv,
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=work_dir,
                    env=env,
                    start_new_session=True,
                    **switch,
                )
            except (OSError, subprocess.SubprocessError) as exc:
                raise SandboxError(f"could not start {argv[0]}: {type(exc).__name__}: {exc}") from exc
        _running[process.pid] = uid
        try:
            stdout, stderr, timed_out, truncated, returncode = _collect(process, started, limits)
        finally:
            del _running[process.pid]
        seconds = time.monotonic() - started
    finally:
        if slot is not None:
            slot.release()
        _remove_tree(root_dir)
    return ProgramResult(
        returncode=returncode,
        stdout=stdout.decode("utf-8", errors="replace"),
        stderr=stderr.decode("utf-8", errors="replace"),
        timed_out=timed_out,
        output_truncated=truncated,
        seconds=seconds,
        isolation="bubblewrap" if use_bwrap else "rlimits",
    )


def kill_running_programs() -> None:
    """SIGKILL the programs this process is running now and what they started (their process group; as
    root, every process of their uid): for a process about to end in the middle of a run, whose own
    clean-up will not run (a pool worker whose run died)."""
    for pgid, uid in list(_running.items()):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if uid is not None:
            _kill_uid(uid)


def _prepare_work_dir(
    root_dir: str, source: str, stdin: str, extra_files: dict[str, str], slot: _UidSlot | None
) -> tuple[str, str]:
    """The program and its files in a private work dir (owned by the sandbox uid), and stdin beside it."""
    os.chmod(root_dir, 0o711)  # traversable by the sandbox uid, not listable
    work_dir = os.path.join(root_dir, "work")
    os.mkdir(work_dir, 0o700)
    for name, text in {PROGRAM_FILE: source, **extra_files}.items():
        with open(os.path.join(work_dir, name), "w", encoding="utf-8", errors="surrogatepass") as file:
            file.write(text)
    stdin_path = os.path.join(root_dir, "stdin")
    with open(stdin_path, "w", encoding="utf-8", errors="surrogatepass") as file:
        file.write(stdin)
    if slot is not None:
        for name in os.listdir(work_dir):
            os.chown(os.path.join(work_dir, name), slot.uid, slot.uid)
        os.chown(work_dir, slot.uid, slot.uid)
    return work_dir, stdin_path


def _command(work_dir: str, limits: _Limits, uid: int | None, use_bwrap: bool) -> tuple[list[str], dict[str, Any]]:
    """The argv (bubblewrap and the rlimit launcher around the interpreter) and how Popen switches user."""
    python = interpreter()
    argv = [python, "-I", "-S", PROGRAM_FILE]
    if use_bwrap:
        argv = _bwrap_argv(python, work_dir) + argv
    rlimits = _rlimits(limits, uid)
    launcher = _util_linux_launcher()
    if launcher is not None:
        return _launcher_argv(launcher, rlimits, uid) + argv, {}
    switch: dict[str, Any] = {
        "user": uid,
        "group": uid,
        "extra_groups": [] if uid is not None else None,
        "preexec_fn": _child_setup(rlimits),
    }
    return argv, switch


def _collect(process: subprocess.Popen, started: float, limits: _Limits) -> tuple[bytes, bytes, bool, bool, int]:
    """Output, timeout and truncation flags, and the exit status; the whole process group is killed after."""
    try:
        stdout, stderr, timed_out, truncated = _read_output(
            process, started + limits.timeout_s, limits.max_output_bytes
        )
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the leader is not reaped yet, so its pgid is ours
        except (ProcessLookupError, PermissionError):
            pass
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()
        try:
            returncode = process.wait(KILL_WAIT_S)
        except subprocess.TimeoutExpired as exc:
            raise SandboxError(f"sandboxed process {process.pid} did not die after SIGKILL") from exc
    return stdout, stderr, timed_out, truncated, returncode


@functools.lru_cache(maxsize=1)
def bubblewrap_available() -> bool:
    """Whether bubblewrap runs a program here, checked once per process with a real probe run."""
    if shutil.which("bwrap") is None:
        return False
    try:
        result = _run("print('ok')", "", _Limits(PROBE_TIMEOUT_S, 256, 4096), {}, use_bwrap=True)
    except (SandboxError, OSError) as exc:
        log.debug("bubblewrap probe failed: %s", exc)
        return False
    if result.returncode != 0 or result.stdout.strip() != "ok":
        log.debug("bubblewrap probe failed: exit %s, stderr %r", result.returncode, result.stderr[:300])
        return False
    return True


def _warn_unavailable_once() -> None:
    global _warned_unavailable
    if not _warned_unavailable:
        _warned_unavailable = True
        log.warning(UNAVAILABLE_WARNING)


def run_program(
    source: str,
    stdin: str,
    *,
    timeout_s: float,
    memory_mb: int,
    max_output_bytes: int,
    extra_files: dict[str, str] | None = None,
) -> ProgramResult:
    """Run `source` as a Python program on `stdin` under the isolation described in the module
    docstring. Raises SandboxError only when the sandbox itself cannot start the program."""
    if timeout_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0:
        raise ValueError("timeout_s, memory_mb and max_output_bytes must be positive")
    use_bwrap = bubblewrap_available()
    if not use_bwrap:
        _warn_unavailable_once()
    return _run(source, stdin, _Limits(timeout_s, memory_mb, max_output_bytes), extra_files or {}, use_bwrap)
