"""Where a command's CPU goes, by kind of process: run it, sample /proc every half second, print CPU-seconds by kind.

    python benchmarks/suite_cpu.py [--every 0.5] [--json FILE] -- make test

Each process's last seen user + system time counts (so a process shorter than one sample is missed, and a forked
child shows its parent's command line: ranks are told apart by the name they give themselves). Processes that
started before the command (kernel threads, daemons) are left out. Used for issue 52's account of the test suite
(docs/architecture.md, "Testing"); Linux only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

TICKS = os.sysconf("SC_CLK_TCK")
KINDS = (  # (text in the command line, kind), first match wins
    ("zygote_main", "rank zygote"),
    ("multiprocessing.forkserver", "verifier pools (forkserver and workers)"),
    ("multiprocessing.spawn", "spawned processes (samplers)"),
    ("exec(eval(sys.stdin", "pytest-xdist workers"),
    ("prefect.server.api.server", "Prefect servers"),
    ("prefect server start", "Prefect servers"),
    ("rlvr.flows.cli", "rlvr processes (fresh and forked)"),
    ("mypy", "mypy"),
    ("compileall", "install"),
    ("uv pip", "install"),
    ("pytest-of-", "scripts and tools started by tests"),
)


@dataclass
class Seen:
    start: int  # clock ticks after boot: a reused pid is another process
    command: str
    name: str
    cpu: float


def kind_of(process: Seen) -> str:
    if process.name.startswith("rlvr-rank"):
        return "data-parallel ranks"
    return next((kind for text, kind in KINDS if text in process.command), f"other: {process.name}")


def read_process(pid: int) -> tuple[int, float, str] | None:
    """(start tick, CPU-seconds, name) of `pid`, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
        with open(f"/proc/{pid}/comm") as handle:
            name = handle.read().strip()
    except OSError:
        return None
    fields = stat[
        stat.rfind(")") + 2 :
    ].split()  # a zombie counts too (its times are final): not child_guard.start_time
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / TICKS, name


def sample(seen: dict[int, Seen], retired: list[Seen], since: int) -> None:
    """One pass over /proc: update every process started after tick `since`."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or (now := read_process(int(entry))) is None:
            continue
        start, cpu, name = now
        if start < since:
            continue
        pid = int(entry)
        known = seen.get(pid)
        if known is None or known.start != start:
            if known is not None:
                retired.append(known)
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    command = handle.read().replace(b"\0", b" ").decode(errors="replace")[:400]
            except OSError:
                continue
            known = seen[pid] = Seen(start, command, name, 0.0)
        known.name, known.cpu = name, max(known.cpu, cpu)


def boot_ticks_now() -> int:
    with open("/proc/uptime") as handle:
        return int(float(handle.read().split()[0]) * TICKS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--json", default=None, help="write every process seen here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = [part for part in args.command if part != "--"] or sys.exit("give the command after --")
    seen: dict[int, Seen] = {}
    retired: list[Seen] = []
    since, started = boot_ticks_now(), time.monotonic()
    child = subprocess.Popen(command)
    while child.poll() is None:
        sample(seen, retired, since)
        time.sleep(args.every)
    processes = [*retired, *seen.values()]
    by_kind: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for process in processes:
        by_kind[kind_of(process)] += process.cpu
        count[kind_of(process)] += 1
    print(f"exit {child.returncode}, {time.monotonic() - started:.0f} s, {sum(by_kind.values()):.0f} CPU-s seen")
    for kind, cpu in by_kind.most_common():
        print(f"{cpu:9.1f} CPU-s {count[kind]:6d} processes  {kind}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([asdict(process) for process in processes], handle)
    sys.exit(child.returncode)


if __name__ == "__main__":
    main()
