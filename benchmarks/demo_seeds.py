"""The demo on several seeds: `rlvr run --set seed=N` as `make demo` runs it, one store per seed.

Prints a row per seed (held-out greedy accuracy before RL, i.e. after the warm start, and at the end;
their ratio; wall minutes of the whole command) and a last line with the worst seed against the demo's
promise: every seed ends at 0.6 or more, at least doubles its warm-start accuracy, in under 5 minutes
on 2 cores. With --parallel 2 the runs share the cores, so their minutes are not the demo's own.

    python benchmarks/demo_seeds.py [--seeds 0 1 2 3 4] [--parallel 1] [--out DIR] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run_seed(root: Path, seed: int, overrides: list[str], config: str | None = None) -> float:
    """One whole `rlvr run` for this seed (from `config` when given); returns its wall seconds."""
    command = [sys.executable, "-m", "rlvr.flows.cli", "run", "--store", str(root / f"seed-{seed}"), "--run-id", "demo"]
    if config is not None:
        command += ["--config", config]
    for item in [f"seed={seed}", *overrides]:
        command += ["--set", item]
    started = time.monotonic()
    result = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "PREFECT_LOGGING_LEVEL": "ERROR"}
    )
    if result.returncode != 0:
        raise RuntimeError(f"seed {seed} failed: {result.stderr[-2000:]}")
    return time.monotonic() - started


def accuracies(root: Path, seed: int) -> tuple[float, float]:
    """Held-out accuracy after the warm start and after the last RL step."""
    from rlvr.storage.store import Store
    from rlvr.storage.views import query

    rows = query(
        Store.open(str(root / f"seed-{seed}")),
        "SELECT phase, step, accuracy FROM evals WHERE phase IN ('warmstart', 'rl') ORDER BY step",
    ).to_pylist()
    warm = next(r["accuracy"] for r in rows if r["phase"] == "warmstart")
    return warm, rows[-1]["accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="keep the stores here (default: a temp dir)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="rlvr-demo-seeds-"))
    with ThreadPoolExecutor(args.parallel) as pool:
        seconds = dict(zip(args.seeds, pool.map(lambda s: run_seed(root, s, args.overrides), args.seeds)))
    print(f"{'seed':>4}{'after warm start':>18}{'after RL':>10}{'ratio':>8}{'minutes':>9}")
    figures = {seed: accuracies(root, seed) for seed in args.seeds}
    for seed, (warm, final) in figures.items():
        ratio = final / warm if warm else float("inf")
        print(f"{seed:>4}{warm:>18.2f}{final:>10.2f}{ratio:>8.2f}{seconds[seed] / 60:>9.1f}")
    worst_seed = min(figures, key=lambda s: figures[s][1])
    warm, final = figures[worst_seed]
    kept = all(f >= 0.6 and f >= 2 * w for w, f in figures.values())
    print(
        f"worst seed {worst_seed}: {final:.2f} ({final / warm if warm else float('inf'):.2f}x its warm start); slowest "
        f"{max(seconds.values()) / 60:.1f} min; every seed >= 0.6 and >= 2x: {'yes' if kept else 'NO'} (stores in {root})"
    )


if __name__ == "__main__":
    main()
