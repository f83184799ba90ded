"""Drawing a batch at random: the checks and weighted draws every selection strategy shares, each using
the strategy's `random.Random` in one documented way so that a pick is reproducible from the seed."""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Mapping, Sequence

from rlvr.curricula.base import Pick, PoolProblem, arm_sizes


def require_selectable(pool: Sequence[PoolProblem], batch_size: int) -> None:
    """The two ways a select call can be unanswerable, as the same errors every strategy raises."""
    if not pool:
        raise ValueError("cannot select from an empty problem pool")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")


def problems_by_arm(pool: Sequence[PoolProblem]) -> dict[str, list[str]]:
    """Problem ids per arm, arms and ids sorted, so a draw depends only on the pool's contents."""
    members: dict[str, list[str]] = {arm: [] for arm in arm_sizes(pool)}
    for problem in pool:
        members[problem.arm].append(problem.problem_id)
    return {arm: sorted(ids) for arm, ids in members.items()}


def draw_index(cumulative: Sequence[float], rng: random.Random) -> int:
    """Inverse-CDF draw from cumulative weights, spending exactly one `rng.random()`.

    Index i is drawn when cumulative[i-1] <= u * total < cumulative[i], so zero-weight entries are never
    drawn; if rounding lands on the total, the last entry with positive weight is returned.
    """
    total = cumulative[-1] if cumulative else 0.0
    if not total > 0.0:
        raise ValueError("cannot draw from weights that sum to zero")
    index = min(bisect.bisect_right(cumulative, rng.random() * total), len(cumulative) - 1)
    while index > 0 and cumulative[index] == cumulative[index - 1]:
        index -= 1
    return index


def draw_arm_batch(
    members: Mapping[str, Sequence[str]], arm_probs: Mapping[str, float], batch_size: int, rng: random.Random
) -> list[Pick]:
    """`batch_size` slots, each an arm ~ Categorical(arm_probs) then a problem uniformly from it, with replacement.

    Per slot, in order: one `rng.random()` picks the arm (`draw_index` over the arms in `arm_probs`'
    order), then one `rng.randrange(len(members[arm]))` picks the problem from the arm's sorted ids.
    The pick's probability is P(arm) / |members[arm]|, the chance one draw yields that problem.
    """
    arms = list(arm_probs)
    cumulative = list(itertools.accumulate(arm_probs[arm] for arm in arms))
    picks = []
    for _ in range(batch_size):
        arm = arms[draw_index(cumulative, rng)]
        ids = members[arm]
        picks.append(Pick(ids[rng.randrange(len(ids))], arm, arm_probs[arm] / len(ids)))
    return picks
