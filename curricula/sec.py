"""SEC, the Self-Evolving Curriculum (docs/methods.md#sec): a non-stationary bandit over arms (problem
categories, difficulty bins or both) whose reward is the mean |advantage| the trainer already computes.

Arm values follow TD(0), arms are drawn by a Boltzmann rule, then a problem uniformly within the arm.
This module also owns the arm-then-problem draw (`draw_arm_batch`) and the inverse-CDF draw
(`draw_index`) that the other strategies here reuse, so every strategy spends its `rng` the same,
documented way and a seeded step is reproducible.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import Field

from rlvr.curricula.base import (
    Pick,
    PoolProblem,
    SelectConfig,
    SelectionStrategy,
    StepFeedback,
    arm_sizes,
    outcomes_by_arm,
)
from rlvr.curricula.sampling import draw_arm_batch, problems_by_arm, require_selectable


class SecConfig(SelectConfig):
    type: Literal["sec"] = "sec"
    alpha: float = Field(0.5, gt=0.0, le=1.0, description="TD(0) learning rate (the authors' scripts use 0.5)")
    tau: float = Field(0.4, gt=0.0, description="Boltzmann temperature (the authors' math runs use 0.4)")


def boltzmann_probabilities(values: Mapping[str, float], arms: Sequence[str], tau: float) -> dict[str, float]:
    """softmax(value / tau) over `arms` (an arm missing from `values` counts as 0).

    Only the arms passed in get mass: that is how arms with an empty pool are masked. The maximum is
    subtracted before exponentiating so large values cannot overflow.
    """
    if not arms:
        return {}
    scaled = [values.get(arm, 0.0) / tau for arm in arms]
    top = max(scaled)
    weights = [math.exp(s - top) for s in scaled]
    total = sum(weights)
    return {arm: w / total for arm, w in zip(arms, weights)}


def td_update(q: float, reward: float, alpha: float) -> float:
    """TD(0): Q <- alpha * r + (1 - alpha) * Q, an exponential moving average of the arm's reward."""
    return alpha * reward + (1.0 - alpha) * q


class SecStrategy(SelectionStrategy):
    """SEC as specified in docs/methods.md#sec.

    Q starts at 0 for every arm, including arms that first appear in a later pool, so the first batch
    is uniform over arms. `select` draws with `draw_arm_batch` (two rng calls per slot, see there) and
    records P_t(arm) / |pool[arm]| per pick. `observe` applies TD(0) to the arms present in the batch,
    with r_t(arm) = mean over the arm's slots of `ProblemOutcome.mean_abs_advantage`; other arms keep Q.
    """

    type = "sec"
    cfg: SecConfig

    def __init__(self, cfg: SecConfig) -> None:
        super().__init__(cfg)
        self.q: dict[str, float] = {}
        self.pulls: dict[str, int] = {}
        self.updates = 0
        self.last_step: int | None = None

    def arm_probabilities(self, pool: Sequence[PoolProblem]) -> dict[str, float]:
        """P_t over the arms with problems in `pool`, sorted by arm, from the current Q."""
        return boltzmann_probabilities(self.q, list(arm_sizes(pool)), self.cfg.tau)

    def select(self, pool: Sequence[PoolProblem], batch_size: int, rng: random.Random) -> list[Pick]:
        require_selectable(pool, batch_size)
        return draw_arm_batch(problems_by_arm(pool), self.arm_probabilities(pool), batch_size, rng)

    def observe(self, feedback: StepFeedback) -> list[dict[str, Any]]:
        """TD(0) on the batch's arms; one audit row per arm of the pool (and per batch arm outside it).

        `probability` is P_t(arm), recomputed from the Q the step was selected with and the step's pool.
        An arm that was trained but is not in `feedback.pool` still gets its update (the batch is what
        was trained); its row has pool_size 0 and probability None.
        """
        sizes = arm_sizes(feedback.pool)
        probs = self.arm_probabilities(feedback.pool)
        grouped = outcomes_by_arm(feedback.outcomes)
        rows = []
        for arm in sorted(set(sizes) | set(grouped)):
            pulled = grouped.get(arm, [])
            q_before = self.q.get(arm, 0.0)
            reward = sum(o.mean_abs_advantage for o in pulled) / len(pulled) if pulled else None
            q_after = td_update(q_before, reward, self.cfg.alpha) if reward is not None else q_before
            self.q[arm] = q_after
            self.pulls[arm] = self.pulls.get(arm, 0) + len(pulled)
            rows.append(
                {
                    "arm": arm,
                    "pool_size": sizes.get(arm, 0),
                    "q_before": q_before,
                    "probability": probs.get(arm),
                    "pulls": len(pulled),
                    "reward": reward,
                    "q_after": q_after,
                    "cumulative_pulls": self.pulls[arm],
                }
            )
        self.updates += 1
        self.last_step = feedback.step
        return rows

    def state_dict(self) -> dict[str, Any]:
        """Q and cumulative pulls per arm, the number of updates (SEC's t) and the last observed step."""
        return {"q": dict(self.q), "pulls": dict(self.pulls), "updates": self.updates, "last_step": self.last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.q = {str(arm): float(q) for arm, q in state.get("q", {}).items()}
        self.pulls = {str(arm): int(n) for arm, n in state.get("pulls", {}).items()}
        self.updates = int(state.get("updates", 0))
        last = state.get("last_step")
        self.last_step = None if last is None else int(last)
