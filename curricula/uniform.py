"""Uniform selection: every problem in the pool is equally likely; the baseline every curriculum must beat."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

from rlvr.curricula.base import Pick, PoolProblem, SelectConfig, SelectionStrategy


class UniformConfig(SelectConfig):
    type: Literal["uniform"] = "uniform"


class UniformStrategy(SelectionStrategy):
    """Picks without replacement while the pool is large enough, with replacement otherwise.

    The recorded probability is the pick's inclusion probability: batch_size / pool size without
    replacement, 1 / pool size per draw with replacement.
    """

    type = "uniform"

    def select(self, pool: Sequence[PoolProblem], batch_size: int, rng: random.Random) -> list[Pick]:
        if not pool:
            raise ValueError("cannot select from an empty problem pool")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        arm_of = {p.problem_id: p.arm for p in pool}
        ids = [p.problem_id for p in pool]
        if batch_size <= len(ids):
            return [Pick(pid, arm_of[pid], batch_size / len(ids)) for pid in rng.sample(ids, batch_size)]
        return [Pick(pid, arm_of[pid], 1.0 / len(ids)) for pid in (rng.choice(ids) for _ in range(batch_size))]
