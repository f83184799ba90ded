"""Wall-clock limits on a wrapped environment's calls (`env.step_timeout_s`), run in a thread of the run's process
or in a process of the episode's own (`env.isolation`); the gym and TextArena adapters use them.

Thread (the default, `run_limited`): each call into the wrapped environment runs in a helper thread while the
episode's thread waits up to the limit. Past it the helper is interrupted: CPython raises an exception in it
(PyThreadState_SetAsyncExc), which stops code that runs Python bytecode (a loop) at its next instruction. Code
blocked outside the interpreter (a sleep, a socket read, a C extension's own loop) sees that exception only when it
returns: no thread can stop it, so it runs on in its daemon thread, and the timeout says so. That is why process
isolation exists.

Process (`isolated_factory`): each episode's environment lives in a process of its own, forked from a host process
that built the environment's factory once from the run's `env` config (imported GEM, checked the options), so an
episode costs a fork (milliseconds) rather than a fresh interpreter. Nothing crosses the boundary but the task, the
seed and the response going in and the `Opening` or `Reply` coming back: the environment is built in the child,
never pickled. The run's process waits up to the limit for each answer and past it SIGKILLs the episode's process
(through a pidfd, so a reused pid is never hit); the host reaps it. The host exits within a second of the run's
process dying, SIGKILL included (it polls the run's pid and start time, rlvr/child_guard.py), and takes its
episodes' processes with it (PR_SET_PDEATHSIG: the host forks from its only thread).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import gc
import importlib
import multiprocessing
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from rlvr.child_guard import POLL_S, exit_when_gone, is_running, start_time
from rlvr.environments.base import EnvConfig, Environment, EnvironmentTimeout, Opening, Reply
from rlvr.spawn_main import without_main
from rlvr.verifiers.base import one_line

__all__ = ["IsolatedEnvironment", "in_episode_process", "isolated_factory", "run_limited"]

T = TypeVar("T")
INTERRUPT_WAIT_S = 1.0  # how long an interrupted helper thread gets to unwind before it is called stuck
START_TIMEOUT_S = 120.0  # a host that has not built its factory by then (GEM's import: ~1.5 s) is given up
CLOSE_WAIT_S = 2.0  # how long an episode's process gets to close its environment before it is killed
KILL_WAIT_S = 5.0  # how long a killed episode's process is waited for
_PR_SET_PDEATHSIG = 1

_context = multiprocessing.get_context("spawn")  # a fresh interpreter: no thread of the run's is copied
_in_episode_process = False


def in_episode_process() -> bool:
    """Whether this process is a host or an episode's process: calls run directly there (the run's process enforces
    the limit by killing), and an adapter's factory builds the environment itself rather than another process."""
    return _in_episode_process


# ---------------------------------------------------------------------------------------------
# Thread isolation


class _Interrupted(BaseException):
    """Raised inside a helper thread past its limit. A BaseException, so that a wrapped environment's own
    `except Exception` does not swallow it."""


def run_limited(call: Callable[[], T], limit_s: float | None, what: str) -> T:
    """`call()`, run in a helper thread for at most `limit_s` seconds (None: no limit, in this thread). Its result
    or exception comes back as if called here; past the limit the helper is interrupted and EnvironmentTimeout is
    raised, saying whether the interruption took (`what`: "reset", "step" or "close", for the message)."""
    if limit_s is None or _in_episode_process:
        return call()
    outcome: list[tuple[bool, Any]] = []

    def target() -> None:
        try:
            outcome.append((True, call()))
        except _Interrupted:
            pass
        except BaseException as exc:  # handed to the waiting thread, which raises it
            outcome.append((False, exc))

    helper = threading.Thread(target=target, name=f"environment-{what}", daemon=True)
    helper.start()
    helper.join(limit_s)
    if not helper.is_alive():
        if not outcome:
            raise RuntimeError(f"the environment's {what} was interrupted")
        done, value = outcome[0]
        if not done:
            raise value
        result: T = value
        return result
    assert helper.ident is not None  # started
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(helper.ident), ctypes.py_object(_Interrupted))
    helper.join(INTERRUPT_WAIT_S)
    past = f"the environment's {what} ran past env.step_timeout_s={limit_s:g} s"
    if not helper.is_alive():
        raise EnvironmentTimeout(f"{past} and was interrupted")
    raise EnvironmentTimeout(
        f"{past} and could not be interrupted (it is blocked outside Python bytecode: a sleep, I/O or a C "
        "extension); it runs on in a daemon thread: env.isolation=process kills such work"
    )


# ---------------------------------------------------------------------------------------------
# Process isolation: the host (one per env config and run process) and the episodes' processes it forks


def _host_main(conn: Connection, kind: str, config: str, owner: tuple[int, int | None]) -> None:
    """The host: build the factory of the environment class `kind` ("module:QualName") once, answer ("ready",
    error), then fork one process per episode on each "fork" request (the episode's end of a fresh socket pair comes
    with it) and answer the child's pid. Exits when the run's process is gone or closes its end."""
    global _in_episode_process
    _in_episode_process = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle
    try:
        module, _, name = kind.partition(":")
        cls = getattr(importlib.import_module(module), name)
        factory = cls.factory(EnvConfig.model_validate_json(config))
    except Exception as exc:
        conn.send(("ready", one_line(f"{type(exc).__name__}: {exc}")))
        return
    conn.send(("ready", None))
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the episodes' processes
    gc.freeze()  # the children's collections then skip the host's objects, whose pages stay shared
    while True:
        if not conn.poll(POLL_S):
            if not is_running(*owner):
                os._exit(0)
            continue
        try:
            message = conn.recv()
            if message != "fork":
                return
            fd = reduction.recv_handle(conn)
        except (EOFError, OSError):
            return
        host = os.getpid()
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # subprocess.wait needs its children reapable
            conn.close()
            _die_with(host, owner)
            _episode_main(Connection(fd), factory)
        os.close(fd)
        conn.send(pid)


def _die_with(host: int, owner: tuple[int, int | None]) -> None:
    """Make this episode's process die with its host (which exits within POLL_S of the run's process), even when a
    step hangs: PR_SET_PDEATHSIG, sound here because the host forks from its only thread; elsewhere a watcher."""
    if not sys.platform.startswith("linux"):
        exit_when_gone(*owner)
        return
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != host:  # the host died before prctl took effect
        os._exit(0)


def _episode_main(conn: Connection, factory: Callable[[], Environment]) -> None:
    """An episode's process: make the environment, then answer (op, args) with ("ok", result) or ("raised",
    "Type: message") until "close" or the run's end of the pipe closes; never returns."""
    environment: Environment | None = None
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            break
        try:
            if environment is None:
                environment = factory()
            result = getattr(environment, op)(*args)
            conn.send(("ok", result))
        except Exception as exc:
            try:
                conn.send(("raised", one_line(f"{type(exc).__name__}: {exc}")))
            except OSError:
                break
        if op == "close":
            break
    os._exit(0)


class _Host:
    """The run's handle on one host process: forks an episode's process on request, one request at a time."""

    def __init__(self, kind: str, config: str) -> None:
        self.conn, theirs = _context.Pipe(duplex=True)
        owner = (os.getpid(), start_time(os.getpid()))
        with without_main():
            self.process = _context.Process(
                target=_host_main, args=(theirs, kind, config, owner), name="environment-host", daemon=True
            )
            self.process.start()
        theirs.close()
        self._lock = threading.Lock()
        if not self.conn.poll(START_TIMEOUT_S):
            self.close()
            raise RuntimeError(f"the environment's host process did not start within {START_TIMEOUT_S:g} s")
        _, error = self.conn.recv()
        if error is not None:
            self.close()
            raise RuntimeError(f"the environment's host process could not build it: {error}")

    def alive(self) -> bool:
        return self.process.is_alive()

    def fork(self) -> tuple[Connection, int]:
        """A new episode's process: the run's end of its pipe and its pid."""
        ours, theirs = _context.Pipe(duplex=True)
        try:
            with self._lock:
                self.conn.send("fork")
                reduction.send_handle(self.conn, theirs.fileno(), self.process.pid)
                if not self.conn.poll(START_TIMEOUT_S):
                    raise RuntimeError("the environment's host process did not fork an episode's process")
                pid = int(self.conn.recv())
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return ours, pid

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.conn.close()
        self.process.join(CLOSE_WAIT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


_hosts: dict[tuple[str, str], _Host] = {}
_hosts_lock = threading.Lock()


def _host(kind: str, config: str) -> _Host:
    """The host process of (`kind`, `config`) in this process, started on first use (and again if it died)."""
    with _hosts_lock:
        host = _hosts.get((kind, config))
        if host is None or not host.alive():
            host = _hosts[kind, config] = _Host(kind, config)
        return host


@atexit.register
def _close_hosts() -> None:
    with _hosts_lock:
        for host in _hosts.values():
            host.close()
        _hosts.clear()


class IsolatedEnvironment(Environment):
    """An episode whose environment runs in a process of its own (module docstring): `reset` forks it from the
    host, each call waits at most `limit_s` for its answer, and past that the process is killed and
    EnvironmentTimeout raised. `isolated_factory` makes a subclass per wrapped type, with its name and attributes."""

    name = "isolated"
    version = "1"
    kind = ""  # "module:QualName" of the environment class the host builds

    def __init__(self, config: str, limit_s: float, solved_at: float | None) -> None:
        self.config = config
        self.limit_s = limit_s
        self.solved_at = solved_at
        self.pid: int | None = None  # the episode's process, while it lives
        self._conn: Connection | None = None
        self._pidfd: int | None = None

    def reset(self, task: Mapping[str, Any], seed: int) -> Opening:
        self._kill()
        self._conn, self.pid = _host(self.kind, self.config).fork()
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfd (Linux < 5.3), or the process already died
            self._pidfd = None
        opening = self._call("reset", (dict(task), seed))
        if not isinstance(opening, Opening):
            raise TypeError(f"reset returned {type(opening).__name__}, not an Opening")
        return opening

    def step(self, response: str) -> Reply:
        reply = self._call("step", (response,))
        if not isinstance(reply, Reply):
            raise TypeError(f"step returned {type(reply).__name__}, not a Reply")
        return reply

    def close(self) -> None:
        conn = self._conn
        if conn is not None:
            try:
                conn.send(("close", ()))
                if conn.poll(CLOSE_WAIT_S):
                    conn.recv()
            except (EOFError, OSError):
                pass
        self._kill()

    def _call(self, op: str, args: tuple[Any, ...]) -> Any:
        if self._conn is None:
            raise RuntimeError(f"{op} before reset")
        try:
            self._conn.send((op, args))
            answered = self._conn.poll(self.limit_s)
            status, value = self._conn.recv() if answered else (None, None)
        except (EOFError, OSError) as exc:
            self._kill()
            raise RuntimeError(f"the environment's process died during its {op}") from exc
        if not answered:
            self._kill()
            raise EnvironmentTimeout(
                f"the environment's {op} ran past env.step_timeout_s={self.limit_s:g} s; its process was killed"
            )
        if status == "raised":
            raise RuntimeError(f"the environment's {op} raised {value}")
        return value

    def _kill(self) -> None:
        """End the episode's process (SIGKILL) and wait until it is gone."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
        pid, pidfd, self.pid, self._pidfd = self.pid, self._pidfd, None, None
        if pid is None:
            return
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if pidfd is not None:
            select.select([pidfd], [], [], KILL_WAIT_S)  # readable once the process has exited
            os.close(pidfd)


_isolated_classes: dict[type[Environment], type[IsolatedEnvironment]] = {}


def _isolated_class(cls: type[Environment]) -> type[IsolatedEnvironment]:
    """The proxy type of `cls`: its name, version and attributes, its episodes in processes of their own."""
    if cls in _isolated_classes:
        return _isolated_classes[cls]
    attributes = {
        "name": cls.name,
        "version": cls.version,
        "env_keys": cls.env_keys,
        "scores_unrewarded": cls.scores_unrewarded,
        "kind": f"{cls.__module__}:{cls.__qualname__}",
        "__module__": __name__,
        "__doc__": f"{cls.__name__}, each episode in a process of its own.",
    }
    made = _isolated_classes[cls] = type(f"Isolated{cls.__name__}", (IsolatedEnvironment,), attributes)
    return made


def isolated_factory(
    cls: type[Environment], config: EnvConfig, solved_at: float | None
) -> Callable[[], IsolatedEnvironment]:
    """What makes an episode of `cls` in a process of its own, built there from `config` (its type and options), with
    `config.step_timeout_s` on every call; `solved_at`: the type's own success reward for these options."""
    made = _isolated_class(cls)
    text = config.model_dump_json()
    return functools.partial(made, text, config.step_timeout_s, solved_at)
