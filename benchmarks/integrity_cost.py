"""What checking artifacts against their manifests costs: on a running step, on a cold read, and at a resume.

Ours: reads that compare every file's size and sha256 with its manifest (`Store.check_reads`, the default).
Peer: the same store code with the check off, in the same process, on the same runs.

    python benchmarks/integrity_cost.py [--steps 40] [--set key=value ...]

1. A step of the default config, checks on and off (two runs of one config, in alternating order of two
   rounds each, so that warm-up and machine load fall on both). In a running process the stages read each
   other's tables from memory, so the check should cost nothing measurable there.
2. A cold read of every artifact of the run (what a resumed or fresh process pays), checked and not.
3. The check a resume makes before it continues (`find_damage` over the run), against the run's time.
Queries (`rlvr query`, DuckDB over the parts) skip the check, so `benchmarks/query_speed.py` is unchanged.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

_tmp = tempfile.mkdtemp(prefix="rlvr-bench-integrity-")
os.environ.setdefault("PREFECT_HOME", os.path.join(_tmp, "prefect"))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_UI_ENABLED", "false")
os.environ.setdefault("HF_HOME", os.path.join(_tmp, "hf"))

WARMUP_STEPS = 5


def timed_run(root: str, steps: int, overrides: list[str], check: bool) -> tuple[float, float]:
    """(seconds per RL step in steady state, seconds of the whole run) with reads checked or not."""
    from rlvr import progress
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute
    from rlvr.storage.stage import RESIDENTS, TABLES
    from rlvr.storage.store import Store

    TABLES.clear()
    RESIDENTS.clear()
    Store.check_reads = check
    stamps: dict[int, float] = {}

    def listener(event: str, fields: dict) -> None:
        if event == "step":
            stamps[fields["step"]] = time.perf_counter()

    progress.listen(listener)
    cfg = load_config(
        None,
        ["run_id=bench", f"train.steps={steps}", f"evaluate.every={steps}", f"checkpoint.every={steps}", *overrides],
    )
    started = time.perf_counter()
    try:
        execute(root, cfg)
    finally:
        progress.stop_listening(listener)
        Store.check_reads = True
    first, last = WARMUP_STEPS, steps - 1
    return (stamps[last] - stamps[first]) / (last - first), time.perf_counter() - started


def cold_read_seconds(root: str, check: bool, repeats: int = 3) -> tuple[float, int]:
    """Best-of-`repeats` seconds to read every artifact of the store in a fresh Store, and the bytes read."""
    from rlvr.storage.store import Store

    best, size = float("inf"), 0
    for _ in range(repeats):
        Store.check_reads = check
        store = Store.open(root)
        manifests = store.manifests()
        started = time.perf_counter()
        for manifest in manifests:
            if manifest.table_files:
                store.read_table(manifest.artifact_id)
            for entry in manifest.binary_files:
                store.read_file(manifest.artifact_id, entry["path"].removeprefix("files/"))
        best = min(best, time.perf_counter() - started)
        size = sum(e["bytes"] for m in manifests for e in m.files)
    Store.check_reads = True
    return best, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override key=value")
    args = parser.parse_args()

    per_step: dict[bool, list[float]] = {True: [], False: []}
    run_seconds = 0.0
    for index, check in enumerate((True, False, False, True)):
        step, whole = timed_run(os.path.join(_tmp, f"store-{index}"), args.steps, args.overrides, check)
        per_step[check].append(step)
        run_seconds = whole if check else run_seconds
    root = os.path.join(_tmp, "store-0")
    checked, size = cold_read_seconds(root, True)
    unchecked, _ = cold_read_seconds(root, False)

    from rlvr.storage.integrity import find_damage
    from rlvr.storage.store import Store

    started = time.perf_counter()
    damage = find_damage(Store.open(root), {"bench"})
    resume_check = time.perf_counter() - started
    assert damage == []

    on, off = statistics.mean(per_step[True]), statistics.mean(per_step[False])
    print(f"{'what':58}{'checked':>12}{'unchecked':>12}")
    print(f"{'RL step of the default config, ms (mean of 2 runs)':58}{on * 1000:>12.1f}{off * 1000:>12.1f}")
    print(f"{'  the runs':58}{' / '.join(f'{s * 1000:.0f}' for s in per_step[True]):>12}"
          f"{' / '.join(f'{s * 1000:.0f}' for s in per_step[False]):>12}")  # fmt: skip
    print(
        f"{f'cold read of the whole run ({size / 1e6:.1f} MB), ms':58}{checked * 1000:>12.1f}{unchecked * 1000:>12.1f}"
    )
    print(f"{'check at resume (every file of the run), ms':58}{resume_check * 1000:>12.1f}")
    print(
        f"checked/unchecked step: {on / off:.3f}x ({(on - off) / off:+.1%}); cold read {checked / unchecked:.2f}x; "
        f"resume check {resume_check / run_seconds:.2%} of the run's {run_seconds:.0f} s"
    )


if __name__ == "__main__":
    main()
