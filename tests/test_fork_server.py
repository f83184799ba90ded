"""tests/fork_server.py, which the run-heavy files start their `rlvr` processes with: a forked command gives the
exit status, stdout and stderr a new interpreter would, a signal ends it as it ends any process, and an environment
that the server's imports would not honour is refused before anything is forked."""

from __future__ import annotations

import signal
import subprocess

import pytest

from rlvr.storage.store import Store
from tests.cli_helpers import rlvr
from tests.fork_server import ForkServer


def test_a_forked_command_gives_the_status_and_output_a_new_interpreter_gives(tmp_path, rlvr_forks: ForkServer):
    root = str(tmp_path / "store")
    Store.open(root, create=True)
    args = ("query", "SELECT 6 * 7 AS n", "--store", root, "--format", "json")
    forked, fresh = rlvr(*args, forks=rlvr_forks), rlvr(*args)
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout) == (0, '{"n": 42}\n')

    missing = ("query", "SELECT 1", "--store", str(tmp_path / "absent"))
    forked, fresh = rlvr(*missing, forks=rlvr_forks), rlvr(*missing)
    assert forked.returncode == fresh.returncode == 2
    assert forked.stderr.strip().splitlines() == fresh.stderr.strip().splitlines()
    assert len(forked.stderr.strip().splitlines()) == 1 and forked.stderr.startswith("error: ")


def test_a_forked_command_is_a_process_a_signal_ends(tmp_path, rlvr_forks: ForkServer):
    root = str(tmp_path / "store")
    Store.open(root, create=True)
    endless = "SELECT count(*) FROM range(1000000) a, range(1000000) b"  # 10^12 rows: killed long before the end
    child = rlvr_forks.start(["query", endless, "--store", root])
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=1)
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL
    assert child.poll() == -signal.SIGKILL


def test_an_environment_the_imports_would_not_honour_is_refused(rlvr_forks: ForkServer):
    elsewhere = {**rlvr_forks.env, "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    with pytest.raises(AssertionError, match=r"read \['PREFECT_API_URL'\] already"):
        rlvr_forks.start(["runs"], env=elsewhere)
    changed = {**rlvr_forks.env, "RLVR_HEARTBEAT_S": "0.1"}  # read when used, not at import: allowed
    assert rlvr_forks.start(["--help"], env=changed).wait(timeout=60) == 0
