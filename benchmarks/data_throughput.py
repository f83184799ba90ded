"""Data stage throughput: 100,000+ problems from 20+ reasoning-gym datasets plus arithmetic, generated,
validated (every reference checked by its verifier), deduplicated (exact and MinHash near) and committed.

    python benchmarks/data_throughput.py [--per-dataset 4400] [--arithmetic 5000]

Prints problems/s per phase (generate, validate, deduplicate, split + commit) and the whole
`synthesize` stage as the pipeline runs it (one `run_stage` into a temp store). Target: under 60 s on
2 cores for the whole stage.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time

DATASETS = [
    "basic_arithmetic", "gcd", "lcm", "leg_counting", "simple_geometry", "number_format", "coin_flip",
    "fraction_simplification", "isomorphic_strings", "complex_arithmetic", "aiw", "syllogism", "ransom_note",
    "palindrome_generation", "number_sorting", "decimal_arithmetic", "color_cube_rotation", "letter_counting",
    "decimal_chain_sum", "word_sequence_reversal", "sentence_reordering", "binary_alternation",
]  # fmt: skip


def overrides(per_dataset: int, arithmetic: int) -> list[str]:
    names = ", ".join(DATASETS)
    return [
        f"synthesize.sources=[{{type: reasoning_gym, datasets: [{names}], count: {per_dataset}}},"
        f" {{type: arithmetic, digits: 3, terms: 2, count: {arithmetic}}}]",
    ]


def phases(cfg) -> dict[str, float]:
    """Seconds of each phase, run one after another as the stage does."""
    from rlvr.data.sources import make_sources
    from rlvr.data.validate import validate
    from rlvr.tasks.synthesize import Pool, deduplicate

    seconds: dict[str, float] = {}
    started = time.perf_counter()
    raw = {name: list(source.rows(0)) for name, source in make_sources(cfg.sources).items()}
    seconds["generate"] = time.perf_counter() - started
    started = time.perf_counter()
    pool = Pool()
    for name, source in make_sources(cfg.sources).items():
        accepted, rejected, count = validate(raw[name], name, source.verifier, cfg.max_prompt_chars)
        pool.accepted += accepted
        pool.rejected += rejected
        pool.read[name] = count
    seconds["validate"] = time.perf_counter() - started
    started = time.perf_counter()
    deduplicate(pool, cfg.near_duplicates, "bench")
    seconds["deduplicate"] = time.perf_counter() - started
    seconds["rows"] = sum(pool.read.values())
    seconds["accepted"] = len(pool.accepted)
    seconds["quarantined"] = len(pool.rejected)
    seconds["duplicates"] = len(pool.duplicates)
    return seconds


def whole_stage(cfg) -> tuple[float, dict]:
    from rlvr.storage.stage import run_stage
    from rlvr.storage.store import Store
    from rlvr.tasks.synthesize import SYNTHESIZE

    with tempfile.TemporaryDirectory() as root:
        store = Store.open(root, create=True)
        started = time.perf_counter()
        made = run_stage(store, SYNTHESIZE, cfg, run_id="bench")
        seconds = time.perf_counter() - started
        counts = store.manifest(made.ids["problems"]).extra["counts"]
    return seconds, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-dataset", type=int, default=4400)
    parser.add_argument("--arithmetic", type=int, default=5000)
    args = parser.parse_args()
    from rlvr.flows.config import load_config

    cfg = load_config(None, overrides(args.per_dataset, args.arithmetic)).synthesize
    print(f"{len(DATASETS)} reasoning-gym datasets x {args.per_dataset} + {args.arithmetic} arithmetic problems")
    for name in DATASETS:  # each dataset's scorer is built once per process: not part of the throughput
        from rlvr.verifiers.reasoning_gym import _score_answer_fn

        _score_answer_fn(name)
    split = phases(cfg)
    rows = split["rows"]
    print(
        f"rows {rows:.0f}: accepted {split['accepted']:.0f}, quarantined {split['quarantined']:.0f}, "
        f"duplicates {split['duplicates']:.0f}"
    )
    for phase in ("generate", "validate", "deduplicate"):
        print(f"  {phase:<12} {split[phase]:6.1f} s  {rows / split[phase]:9.0f} problems/s")
    seconds, counts = whole_stage(cfg)
    kept = sum(c["accepted"] for c in counts.values())
    print(
        f"whole synthesize stage (read, validate, dedup, split, commit): {seconds:.1f} s, "
        f"{rows / seconds:.0f} problems/s, {kept} problems committed; target < 60 s: "
        f"{'met' if seconds < 60 else 'MISSED'}"
    )
    worst = sorted(counts.items(), key=lambda item: -item[1]["quarantined"])[:3]
    for name, c in itertools.islice(worst, 3):
        if c["quarantined"]:
            print(f"  quarantined in {name}: {c['by_check']}")


if __name__ == "__main__":
    main()
