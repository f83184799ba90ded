"""A real `rlvr run` with Prefect's temporary server (its home in the store, as a user's first run has it) and
its verifier workers, ended by SIGKILL, SIGTERM or SIGINT: no process of it is left, and a signal to its whole
process group ends it at once with its failure recorded.

Not `serial` (tests/test_child_processes.py is): these watch only the run's own descendants, so they share the
machine with the parallel part; its bounds (10 s for the processes to go, 20 s for the run to end) hold under
that load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlvr.storage.store import Store
from tests.cli_helpers import REPO, cli_env, rlvr_command, wait_for
from tests.conftest import TINY_OVERRIDES
from tests.test_child_processes import _assert_all_gone, _cmdline, _descendants, _stat

SERVER_MARK = b"prefect.server.api.server:create_app"
FORKSERVER_MARK = b"multiprocessing.forkserver"


def _server_and_worker_up(family: dict[int, int]) -> bool:
    commands = {pid: _cmdline(pid) for pid in family}
    forkservers = {pid for pid, command in commands.items() if FORKSERVER_MARK in command}
    workers = [pid for pid in forkservers if (stat := _stat(pid)) is not None and stat[0] in forkservers]
    return any(SERVER_MARK in command for command in commands.values()) and bool(workers)


DEFAULT_SIGINT_THEN_EXEC = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def _start_run_until_server_and_worker_are_up(
    tmp_path: Path, *, own_group: bool = False
) -> tuple[subprocess.Popen[bytes], dict[int, int], Path]:
    """A real `rlvr run` with Prefect's temporary server (its home in the store), once both that server and a
    verifier worker are up: the process, its descendants so far and its log. `own_group`: the run leads a
    process group of its own, as under `timeout`, a batch scheduler or a container."""
    env = cli_env()
    for name in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_RESULTS_LOCAL_STORAGE_PATH"):
        env.pop(name, None)
    args = ["run", "--store", str(tmp_path / "store"), "--run-id", "children"]
    for override in [*TINY_OVERRIDES, "train.steps=60"]:
        args += ["--set", override]
    command = rlvr_command(*args)
    if own_group:  # a shell's background job (`make test &`) ignores SIGINT, and a child inherits that: not the run
        command = [sys.executable, "-c", DEFAULT_SIGINT_THEN_EXEC, *command[1:]]
    log = tmp_path / "run.log"
    with open(log, "w") as stderr:
        run = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=own_group,
        )
    family: dict[int, int] = {}

    def both_up() -> bool:
        if run.poll() is not None:
            raise AssertionError(f"the run ended first ({run.returncode}):\n{log.read_text()[-3000:]}")
        family.update(_descendants(run.pid))
        return _server_and_worker_up(family)

    try:
        wait_for(both_up, 240, "the Prefect server and a verifier worker", log=log, every=0.1)
        family.update(_descendants(run.pid))
    except BaseException:
        run.send_signal(signal.SIGKILL)
        run.wait()
        raise
    return run, family, log


@pytest.mark.slow
def test_sigkilled_run_leaves_no_process(tmp_path):
    run, family, _ = _start_run_until_server_and_worker_are_up(tmp_path)
    run.send_signal(signal.SIGKILL)
    run.wait()
    _assert_all_gone(family)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "status", "said", "error"),
    [
        (signal.SIGTERM, 143, "run 'children' stopped by SIGTERM; what it committed", "Stopped: stopped by SIGTERM"),
        (signal.SIGINT, 130, "run 'children' interrupted; what it committed", "KeyboardInterrupt: "),
    ],
)
def test_a_signal_to_the_runs_whole_group_ends_it_at_once_with_its_failure_recorded(
    tmp_path, signum, status, said, error
):
    """`timeout`, Slurm or a container stop the job's whole process group (SIGTERM), a terminal's Ctrl-C sends
    SIGINT to it. The run must still have its Prefect server while it records the crash: with the server in the
    run's group the two died together, and the run then retried for about 90 s to reach the dead server before
    it exited (a GPU's memory held all along)."""
    run, family, log = _start_run_until_server_and_worker_are_up(tmp_path, own_group=True)
    os.killpg(run.pid, signum)
    try:
        returncode = run.wait(timeout=20)
    except subprocess.TimeoutExpired as still_running:
        run.send_signal(signal.SIGKILL)
        run.wait()
        tail = log.read_text()[-3000:]
        raise AssertionError(f"the run still ran 20 s after the signal; its log ends:\n{tail}") from still_running
    _assert_all_gone(family)
    assert returncode == status
    assert f"{said} is intact: `rlvr resume children --store {tmp_path / 'store'}` continues" in log.read_text()
    record = Store.open(str(tmp_path / "store")).read_run("children")
    assert (record["status"], record["error"]) == ("failed", error)
