"""Uniform selection: every problem in the pool is equally likely; the baseline every curriculum beats."""

from __future__ import annotations

import random
from collections.abc import Sequence


def select_uniform(problem_ids: Sequence[str], batch_size: int, seed: int) -> list[tuple[str, float]]:
    """Pick `batch_size` problems uniformly; return (problem_id, probability of that pick).

    Without replacement while the pool is large enough (probability = batch_size / pool size, the
    inclusion probability); with replacement otherwise (probability = 1 / pool size per draw).
    The pool is sorted first so the pick depends only on its contents and the seed.
    """
    if not problem_ids:
        raise ValueError("cannot select from an empty problem pool")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    pool = sorted(problem_ids)
    rng = random.Random(seed)
    if batch_size <= len(pool):
        picks = rng.sample(pool, batch_size)
        return [(pid, batch_size / len(pool)) for pid in picks]
    return [(rng.choice(pool), 1.0 / len(pool)) for _ in range(batch_size)]
