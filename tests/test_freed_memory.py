"""A run's process gives freed tensor memory back to the system (trainer/rank_group.py `return_freed_memory`,
called by every tracked run: flows/runs.py)."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys
from pathlib import Path

import pytest

# 24 large tensors freed while small ones allocated between them stay: glibc's heap cannot shrink past the small
# ones, so without the fixed threshold the freed pages stay resident. The 24 MiB tensor freed first raises glibc's
# default threshold above 8 MiB, as a training step's transient buffers do.
PROBE = """
import sys, torch
from rlvr.trainer.rank_group import return_freed_memory

def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

if sys.argv[1] == "fixed":
    return_freed_memory()
first = torch.ones(24 << 18)
del first
before = resident_mb()
blocks, kept = [], []
for _ in range(24):
    blocks.append(torch.ones(8 << 18))
    kept.append(torch.ones(1 << 14))
del blocks
print(round(resident_mb() - before))
"""


def _retained_mb(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return int(done.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None, reason="glibc")
def test_freed_large_tensors_leave_the_process_only_with_the_fixed_threshold() -> None:
    assert _retained_mb("default") > 150  # 192 MiB freed, kept resident by glibc's heap
    assert _retained_mb("fixed") < 16


def test_a_tracked_run_fixes_the_threshold_before_it_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import rlvr.trainer.rank_group as rank_group
    from rlvr.flows import runs
    from rlvr.flows.config import load_config
    from rlvr.storage.store import open_store

    calls: list[str] = []
    monkeypatch.setattr(rank_group, "return_freed_memory", lambda: calls.append("fixed"))
    root = str(open_store(str(tmp_path / "store"), create=True).root)
    result = runs._tracked(root, load_config(None, ["run_id=memory"]), lambda: {"body": calls.copy()}, new=True)
    assert (calls, result["body"]) == (["fixed"], ["fixed"])
