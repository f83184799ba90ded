"""Difficulty estimation speed: 2,000 problems x 8 rollouts with the tiny model, verified and committed.

    python benchmarks/difficulty_speed.py [--problems 2000] [--k 8]

Runs the `difficulty` stage as the pipeline does (sharded commits, the reward cache, the verifier pool)
on arithmetic problems with a freshly initialised tiny policy, and prints problems/s and rollouts/s.
Target: under 2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=2000)
    parser.add_argument("--k", type=int, default=8)
    args = parser.parse_args()
    from rlvr.flows.config import load_config
    from rlvr.storage.stage import run_stage
    from rlvr.storage.store import Store
    from rlvr.tasks.difficulty import DIFFICULTY
    from rlvr.tasks.initialize import INITIALIZE
    from rlvr.tasks.synthesize import SYNTHESIZE
    from rlvr.verifiers.pool import close_shared_pools

    cfg = load_config(
        None,
        [
            f"synthesize.sources=[{{type: arithmetic, digits: 2, terms: 2, count: {args.problems}}}]",
            "synthesize.test_fraction=0",
            "synthesize.warmup_fraction=0",
            f"difficulty.k={args.k}",
        ],
    )
    with tempfile.TemporaryDirectory() as root:
        store = Store.open(root, create=True)
        at = {"run_id": "bench", "seed": 0}
        problems = run_stage(store, SYNTHESIZE, cfg.synthesize, **at).ids["problems"]
        policy = run_stage(store, INITIALIZE, cfg.policy, params={"seed": 0}, step=0, **at).id
        started = time.perf_counter()
        made = run_stage(
            store,
            DIFFICULTY,
            cfg.difficulty,
            inputs={"problems": problems, "policy": policy},
            params={"verifier": cfg.label},
            **at,
        )
        seconds = time.perf_counter() - started
        rows = store.manifest(made.id).rows
    close_shared_pools()
    rollouts = rows * args.k
    print(
        f"difficulty: {rows} problems x {args.k} rollouts in {seconds:.1f} s "
        f"({rows / seconds:.0f} problems/s, {rollouts / seconds:.0f} rollouts/s); "
        f"target < 120 s: {'met' if seconds < 120 else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
