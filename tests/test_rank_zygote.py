"""Data-parallel ranks forked from one warm zygote (trainer/ranks/zygote.py): a rank's exit status reaches rank 0 as
a child's would (a status, or a signal as a negative one), a second request forks from the same zygote, a rank is
named `rlvr-rank-N`, and the zygote and its ranks go when their rank 0 does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlvr.trainer.ranks import zygote
from tests.cli_helpers import wait_for


def test_a_ranks_exit_status_and_a_signal_reach_rank_0_from_one_reused_zygote():
    bad = zygote.start_rank(["too", "few"])  # launch.py's argparse refuses it: status 2
    assert bad.wait(timeout=120) == 2
    first = zygote._zygote
    assert first is not None and not first.gone
    # A rank that waits to join a group nobody holds (rank 0's pid and start time are this process's)
    waiting = zygote.start_rank(["tcp://127.0.0.1:9", "3", "4", "1", "cpu", str(os.getpid()), "0"])
    assert zygote._zygote is first  # forked by the same zygote, no second start
    wait_for(lambda: _name(waiting.pid) == "rlvr-rank-3", 60, "the rank's name")
    assert waiting.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        waiting.wait(timeout=0.3)
    waiting.kill()
    assert waiting.wait(timeout=10) == -signal.SIGKILL


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_the_zygote_exits_with_its_rank_0():
    """A process that started ranks and is SIGKILLed leaves no zygote and, within seconds, no rank."""
    script = (
        "import os, sys; from rlvr.trainer.ranks import zygote; "
        "r = zygote.start_rank(['tcp://127.0.0.1:9', '1', '2', '1', 'cpu', str(os.getpid()), '0']); "
        "print(zygote._zygote.process.pid, r.pid, flush=True); import time; time.sleep(600)"
    )
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert rank0.stdout is not None
    zygote_pid, rank_pid = map(int, rank0.stdout.readline().split())
    rank0.kill()
    rank0.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (_gone(zygote_pid) and _gone(rank_pid)):
        time.sleep(0.1)
    assert _gone(zygote_pid) and _gone(rank_pid)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except OSError:
        return True
