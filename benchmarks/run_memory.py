"""Every process's peak memory over a whole `rlvr run`: the largest process under each sharding, and the ratio.

Each configuration is one `rlvr run` in a fresh store (a child of this script), with the given config and
overrides plus `train.data_parallel=N` and `train.sharding=S`. Every 0.2 s this script reads, from /proc, the
high-water mark of resident memory (VmHWM) of every process descended from the run, so a process's last reading is
its peak up to 0.2 s before it ended. Processes are named by role: the run itself (rank 0), a rank
(`rlvr.trainer.ranks.launch`), a sampler, a verifier worker, Prefect's server, other.

It prints one table row per configuration (the largest process's peak and when it came, rank 0's and the other
ranks' peaks, the wall time, and `rlvr plan`'s peaks for rank 0 and the other ranks, with --prompt-tokens) and, when both shardings ran at the same N, fsdp's largest peak over replicate's: the figure of
issue 53 (target at most 0.75x at N = 2, with gradient checkpointing and `micro_batch_tokens=512` on both).

    python benchmarks/run_memory.py [--config examples/smollm2-arithmetic.yaml] [--ranks 2] \
        [--shardings replicate fsdp] [--repeats 1] [--set KEY=VALUE ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from importlib import import_module
from pathlib import Path
from typing import IO

MB = 1e6
ROLES = (
    ("rlvr.trainer.ranks.launch", "rank"),
    ("prefect.server", "prefect"),
    ("child_guard", "prefect"),
    ("forkserver", "verifier"),
    ("multiprocessing.spawn", "spawned"),
)


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def descendants(root: int) -> list[int]:
    todo, seen = [root], []
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo += children(pid)
    return seen


def peak_and_command(pid: int) -> tuple[int, str] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024, command
    return None


def role(pid: int, root: int, command: str) -> str:
    if pid == root:
        return "run"
    return next((name for marker, name in ROLES if marker in command), "other")


def measure(config: str, ranks: int, sharding: str, extra: list[str]) -> dict[str, object]:
    """One whole run; the peak of every process it started, by pid, with its role."""
    store = tempfile.mkdtemp(prefix="rlvr-run-memory-")
    command = [
        sys.executable,
        "-m",
        "rlvr.flows.cli",
        "run",
        "--store",
        store,
        "--config",
        config,
        "--set",
        f"train.data_parallel={ranks}",
        "--set",
        f"train.sharding={sharding}",
    ]
    for item in extra:
        command += ["--set", item]
    started = time.monotonic()
    unbuffered = {**os.environ, "PYTHONUNBUFFERED": "1"}  # each line as it is printed
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=unbuffered)
    said: list[tuple[float, str]] = []  # the run's output lines, stamped: what it was doing when a peak came
    readers = [
        threading.Thread(target=_stamp_lines, args=(stream, started, said), daemon=True)
        for stream in (proc.stdout, proc.stderr)
    ]
    for reader in readers:
        reader.start()
    peaks: dict[int, tuple[int, str]] = {}
    grew_at: dict[int, float] = {}  # when each process's high-water mark last rose (seconds into the run)
    while proc.poll() is None:
        for pid in descendants(proc.pid):
            found = peak_and_command(pid)
            if found is not None and found[0] > peaks.get(pid, (0, ""))[0]:
                peaks[pid] = (found[0], role(pid, proc.pid, found[1]))
                grew_at[pid] = round(time.monotonic() - started, 1)
        time.sleep(0.2)
    for reader in readers:
        reader.join(timeout=5)
    if proc.returncode != 0:
        printed = "\n".join(line for _, line in said[-40:])
        raise SystemExit(f"the run failed ({proc.returncode}):\n{printed}")
    by_role: dict[str, list[int]] = {}
    for peak, name in peaks.values():
        by_role.setdefault(name, []).append(peak)
    largest_at = grew_at[max(peaks, key=lambda pid: peaks[pid][0])]
    return {
        "ranks": ranks,
        "sharding": sharding,
        "seconds": round(time.monotonic() - started, 1),
        "largest_mb": round(max(peak for peak, _ in peaks.values()) / MB),
        "largest_at_s": largest_at,
        "largest_during": max(((at, line) for at, line in said if at <= largest_at), default=(0.0, ""))[1],
        "run_mb": round(max(by_role.get("run", [0])) / MB),
        "other_ranks_mb": [round(p / MB) for p in sorted(by_role.get("rank", []), reverse=True)],
        "by_role_mb": {name: round(max(values) / MB) for name, values in sorted(by_role.items())},
    }


def _stamp_lines(stream: IO[str] | None, started: float, said: list[tuple[float, str]]) -> None:
    """Each line the run prints on `stream`, with the seconds into the run when it came."""
    assert stream is not None
    for line in stream:
        if line.strip():
            said.append((round(time.monotonic() - started, 1), line.strip()[:100]))


def planned(config: str, ranks: int, sharding: str, extra: list[str], prompt_tokens: int) -> dict[str, int]:
    """`rlvr plan`'s peak per rank name ("0", "1", "1..3", "0 (one process)") for the same run, in MB."""
    from rlvr.flows.config import load_config
    from rlvr.trainer.memory_plan import make_plan

    cfg = load_config(config, [*extra, f"train.data_parallel={ranks}", f"train.sharding={sharding}"])
    plan = make_plan(cfg, ranks, "cpu", prompt_tokens, run_modules=lambda: import_module("rlvr.flows.runs"))
    return {rank: round(plan.peak(rank).total / MB) for rank in plan.rank_names()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/smollm2-arithmetic.yaml")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--shardings", nargs="+", default=["replicate", "fsdp"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--prompt-tokens", type=int, default=48, help="rlvr plan's prompt length (SmolLM2's chat prompts: 45)"
    )
    args = parser.parse_args()
    rows = []
    print(
        "| N | sharding | run | largest process MB | its peak at s | rank 0 (the run) MB | other ranks MB | seconds "
        "| planned rank 0 MB | planned other ranks MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for repeat in range(args.repeats):
        for ranks in args.ranks:
            for sharding in args.shardings if ranks > 1 else ["fsdp"]:
                row = measure(args.config, ranks, sharding, args.extra)
                plan = planned(args.config, ranks, sharding, args.extra, args.prompt_tokens)
                row["planned_mb"] = plan
                rows.append(row)
                others = " / ".join(f"{mb:,}" for mb in row["other_ranks_mb"]) or "-"  # type: ignore[attr-defined]
                plan_0 = next(mb for rank, mb in plan.items() if rank.startswith("0"))
                plan_others = next((f"{mb:,}" for rank, mb in plan.items() if not rank.startswith("0")), "-")
                print(
                    f"| {ranks} | {sharding if ranks > 1 else 'one process'} | {repeat + 1} | "
                    f"{row['largest_mb']:,} | {row['largest_at_s']} | {row['run_mb']:,} | {others} | {row['seconds']} "
                    f"| {plan_0:,} | {plan_others} |",
                    flush=True,
                )
                print(f"    the largest peak came after the run printed: {row['largest_during']!r}", flush=True)
    for ranks in args.ranks:
        for repeat in range(args.repeats):
            pick = {
                r["sharding"]: r
                for r in rows[repeat * len(rows) // args.repeats :][: len(rows) // args.repeats]
                if r["ranks"] == ranks
            }
            if ranks > 1 and {"fsdp", "replicate"} <= pick.keys():
                ratio = pick["fsdp"]["largest_mb"] / pick["replicate"]["largest_mb"]  # type: ignore[operator]
                print(
                    f"N = {ranks}, run {repeat + 1}: fsdp's largest process / replicate's = {ratio:.3f}x "
                    "(issue 53's target at N = 2: <= 0.75x)"
                )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
