"""How long a data-parallel group of 2 ranks takes to start, three times in one process: ranks forked from the
process's warm zygote (trainer/ranks/zygote.py, the default) against each rank a fresh interpreter
(`python -m rlvr.trainer.ranks.launch`, the launch before it), in the same run.

    python benchmarks/rank_start.py [--groups 3] [--world 2]

Prints, per group, the seconds from `RankGroup(...)` to every rank joined, and the CPU-seconds this process and its
descendants spent meanwhile (ranks that already exited are not counted).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence

import psutil
import torch

from rlvr.trainer.ranks import launch


def fresh_rank(argv: Sequence[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "rlvr.trainer.ranks.launch", *argv])


def cpu_seconds(me: psutil.Process) -> float:
    times = me.cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    me = psutil.Process()
    zygote_start = launch.start_rank
    for mode, start in (("fresh interpreters", fresh_rank), ("zygote (default)", zygote_start)):
        launch.start_rank = start
        for index in range(args.groups):
            cpu, wall = cpu_seconds(me), time.monotonic()
            group = launch.RankGroup(args.world, "fsdp", torch.device("cpu"))
            joined, spent = time.monotonic() - wall, cpu_seconds(me) - cpu
            group.close()
            print(f"{mode:20s} group {index + 1}: every rank joined in {joined:6.2f} s, {spent:5.2f} CPU-s")


if __name__ == "__main__":
    main()
