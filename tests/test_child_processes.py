"""Child processes die with the run, SIGKILL included: the guard (rlvr/child_guard.py) in front of Prefect's
temporary server, and the pool workers' watch on the run's process. A real `rlvr run` killed while both its
Prefect server and its verifier workers are up: tests/test_run_signals.py (not serial)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from prefect.exceptions import TerminationSignal

from rlvr.child_guard import EXIT_PARENT_GONE, guarded_command, start_time
from rlvr.errors import Stopped
from rlvr.flows.runs import _sigterm_raises_stopped
from rlvr.verifiers import sandbox
from tests.cli_helpers import REPO, cli_env, wait_for

pytestmark = pytest.mark.serial  # each process must be gone within seconds of its parent

GONE_WITHIN_S = 10.0


# ---------------------------------------------------------------------------------------------
# Processes, named by pid and start time so that a reused pid is never taken for the old process


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a process, or None when there is no such pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[1]), fields[0].decode(), int(fields[19])


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read().replace(b"\0", b" ")
    except OSError:
        return b""


def _gone(pid: int, started: int) -> bool:
    """The process that had `pid` and `started` no longer runs: reaped, a zombie, or its pid reused."""
    stat = _stat(pid)
    return stat is None or stat[2] != started or stat[1] in ("Z", "X")


def _descendants(root: int) -> dict[int, int]:
    """pid -> start time of every running process below `root`."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _stat(int(name))) is not None and stat[1] not in ("Z", "X"):
            children.setdefault(stat[0], []).append(int(name))
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            if (stat := _stat(pid)) is not None:
                found[pid] = stat[2]
                todo.append(pid)
    return found


def _wait_for_family(root: int, enough: Callable[[dict[int, int]], bool], what: str, timeout: float) -> dict[int, int]:
    """The descendants of `root` once `enough` says they are all there."""

    def ready() -> dict[int, int] | None:
        found = _descendants(root)
        return found if enough(found) else None

    return wait_for(ready, timeout, what, every=0.1)


def _assert_all_gone(processes: dict[int, int], within: float = GONE_WITHIN_S) -> None:
    deadline = time.monotonic() + within
    while any(not _gone(pid, started) for pid, started in processes.items()) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = {pid: _cmdline(pid)[:200] for pid, started in processes.items() if not _gone(pid, started)}
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)  # leave nothing behind, even when the test fails
    assert survivors == {}


def _start_parent(script: str, *, tmp_path: Path) -> tuple[subprocess.Popen[str], list[int]]:
    """Start `script` as a throwaway parent process; it prints the pids to watch on its first line."""
    path = tmp_path / f"parent_{uuid.uuid4().hex}.py"
    path.write_text(textwrap.dedent(script))
    parent = subprocess.Popen(
        [sys.executable, str(path)], cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    line = parent.stdout.readline()
    if not line:
        parent.wait()
        assert parent.stderr is not None
        raise AssertionError(f"the parent died before starting its children:\n{parent.stderr.read()[-3000:]}")
    return parent, [int(pid) for pid in line.split()]


def _kill(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()
    for pipe in (process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()


# ---------------------------------------------------------------------------------------------
# The guard


def test_guard_stops_its_command_when_the_parent_is_killed(tmp_path):
    parent, [guard] = _start_parent(
        """
        import subprocess, time
        from rlvr.child_guard import guarded_command
        guard = subprocess.Popen(guarded_command(["sleep", "60"]))
        print(guard.pid, flush=True)
        time.sleep(60)
        """,
        tmp_path=tmp_path,
    )
    family = _wait_for_family(parent.pid, lambda found: len(found) == 2, "guard and sleep", 10)
    assert guard in family
    _kill(parent)
    _assert_all_gone(family, within=3.0)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("raise SystemExit(3)", 3),
        ("import os; os.kill(os.getpid(), 15)", -15),
        ("import os; os.kill(os.getpid(), 9)", -9),
        ("import os; os.kill(os.getpid(), 6)", 128 + 6),  # SIGABRT: no core dump of the guard
    ],
)
def test_guard_exits_as_its_command_did(code, expected):
    assert subprocess.run(guarded_command([sys.executable, "-c", code]), timeout=30).returncode == expected


def test_guard_forwards_sigterm_and_its_command_dies_with_it():
    trap = "import signal, sys, time; signal.signal(15, lambda *_: sys.exit(7)); print('ready', flush=True); time.sleep(60)"
    guard = subprocess.Popen(guarded_command([sys.executable, "-c", trap]), stdout=subprocess.PIPE, text=True)
    assert guard.stdout is not None and guard.stdout.readline() == "ready\n"
    guard.terminate()
    assert guard.wait(10) == 7
    guard.stdout.close()

    guard = subprocess.Popen(guarded_command(["sleep", "60"]))
    family = wait_for(lambda: _descendants(guard.pid), 10, "the guarded sleep")
    guard.kill()  # what Prefect's stop() does when the server takes more than 5 s to stop
    guard.wait()
    _assert_all_gone(family, within=3.0)


def test_guard_does_not_start_its_command_for_a_parent_already_gone(tmp_path):
    started = tmp_path / "started"
    command = [sys.executable, "-c", f"open({str(started)!r}, 'w')"]
    # Its parent is not the one named: that one died and the guard was re-parented before it got going.
    assert subprocess.run(guarded_command(command, parent_pid=1), timeout=30).returncode == EXIT_PARENT_GONE
    assert not started.exists()


# ---------------------------------------------------------------------------------------------
# Pool workers


def test_busy_pool_worker_exits_when_the_run_is_killed(tmp_path):
    parent, workers = _start_parent(
        """
        import time
        from rlvr.verifiers.math import MathVerifier
        from rlvr.verifiers.pool import VerifierPool

        class Slow(MathVerifier):
            name = "slow-for-child-test"

            def score(self, response, reference):
                time.sleep(60)
                return super().score(response, reference)

        if __name__ == "__main__":
            with VerifierPool(Slow, workers=1, timeout_s=120) as pool:
                print(*pool.worker_pids(), flush=True)
                pool.score_many([("a", "b")])
        """,
        tmp_path=tmp_path,
    )
    family = _wait_for_family(parent.pid, lambda found: set(workers) <= set(found), "the worker", 30)
    time.sleep(1.0)  # the call is running
    _kill(parent)
    _assert_all_gone(family, within=5.0)


def test_sampler_worker_exits_when_the_run_is_killed():
    """SIGKILL the process that started a sampler worker (flows/sampler_process.py): the worker is gone within 30 s
    (its pipe closes)."""
    script = (
        "import sys, time\n"
        "from rlvr.flows.sampler_process import WorkerProcess\n"
        "from tests.sampler_jobs import Doubler\n"
        "if __name__ == '__main__':\n"
        "    worker = WorkerProcess(Doubler, (0,), name='test-worker')\n"
        "    worker.submit('pid')\n"
        "    print(worker.result(), flush=True)\n"
        "    time.sleep(600)\n"
    )
    run = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(run.stdout.readline())
        started = start_time(worker_pid)
        assert started is not None
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=10)
        deadline = time.monotonic() + 30  # seconds when idle; 10 were once not enough on 2 cores running 3 jobs
        while start_time(worker_pid) == started and time.monotonic() < deadline:
            time.sleep(0.1)
        assert start_time(worker_pid) != started, "the worker outlived the killed run"
    finally:
        run.kill()


@pytest.mark.parametrize("isolation", ["bubblewrap", "rlimits"])
def test_sandboxed_programs_die_with_a_worker_whose_run_is_killed(tmp_path, isolation):
    if isolation == "bubblewrap" and not sandbox.bubblewrap_available():
        pytest.skip("bubblewrap cannot run here (not installed, or no user namespaces)")
    if isolation == "rlimits" and os.geteuid() != 0:
        pytest.skip("without bubblewrap and without root, a child that calls setsid() escapes the group kill")
    marker = f"rlvr-child-test-{uuid.uuid4().hex}"
    program = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    os.execv(sys.executable, [sys.executable, '-S', '-c', 'import time; time.sleep(60)', '{marker}'])\n"
        "time.sleep(60)\n"
    )
    pair = (f"```python\n{program}\n```", {"asserts": ["assert True"], "timeout_s": 60})
    parent, _ = _start_parent(
        f"""
        from rlvr.verifiers import sandbox
        from rlvr.verifiers.code import CodeVerifier
        from rlvr.verifiers.pool import VerifierPool

        class Code(CodeVerifier):
            name = "code-for-child-test"

            def score(self, response, reference):
                if {isolation == "rlimits"!r}:
                    sandbox.bubblewrap_available = lambda: False
                return super().score(response, reference)

        if __name__ == "__main__":
            with VerifierPool(Code, workers=1, timeout_s=120) as pool:
                print(*pool.worker_pids(), flush=True)
                pool.score_many([{pair!r}])
        """,
        tmp_path=tmp_path,
    )
    sleeper = wait_for(lambda: _marked(marker), 30, "the sandboxed program's detached child")
    family = _descendants(parent.pid) | sleeper
    _kill(parent)
    _assert_all_gone(family, within=5.0)


def _marked(marker: str) -> dict[int, int]:
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and marker.encode() in _cmdline(int(name)) and (stat := _stat(int(name))) is not None:
            found[int(name)] = stat[2]
    return found


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the drop itself, on purpose
def test_a_stop_that_python_drops_inside_a_finalizer_is_delivered_again():
    """A signal handler's exception raised inside a `__del__` or a weakref callback is printed and dropped by
    Python ("Exception ignored in"): a run once went on after SIGTERM that way, its TerminationSignal lost in a
    WeakKeyDictionary callback. The run's hook sends the process the signal again, whose handler then stops the run."""

    class Finalized:
        def __del__(self) -> None:
            raise TerminationSignal(signal=signal.SIGTERM)  # as Prefect's SIGTERM handler raises, landing here

    hook, handler = sys.unraisablehook, signal.getsignal(signal.SIGTERM)
    started = time.monotonic()
    with pytest.raises(Stopped, match="stopped by SIGTERM"), _sigterm_raises_stopped():
        Finalized()  # unreferenced at once: its __del__ runs here, and Python drops what it raised
        while time.monotonic() - started < 5:
            time.sleep(0.001)
    assert time.monotonic() - started < 1
    assert (sys.unraisablehook, signal.getsignal(signal.SIGTERM)) == (hook, handler)  # both given back
