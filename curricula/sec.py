"""SEC, the Self-Evolving Curriculum (docs/methods.md#sec): a non-stationary bandit over arms (problem
categories, difficulty bins or both) whose reward is the mean |advantage| the trainer already computes.

Arm values follow TD(0), arms are drawn by a Boltzmann rule, then a problem uniformly within the arm.
This module also owns the arm-then-problem draw (`draw_arm_batch`) and the inverse-CDF draw
(`draw_index`) that the other strategies here reuse, so every strategy spends its `rng` the same,
documented way and a seeded step is reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import Field

from rlvr.curricula.arm_bandit import ArmBandit
from rlvr.curricula.base import PoolProblem, ProblemOutcome, SelectConfig, StepFeedback, arm_sizes


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


class SecStrategy(ArmBandit):
    """SEC as specified in docs/methods.md#sec.

    Q starts at 0 for every arm, including arms that first appear in a later pool, so the first batch
    is uniform over arms. `select` draws with `draw_arm_batch` (two rng calls per slot, see there) and
    records P_t(arm) / |pool[arm]| per pick. `observe` applies TD(0) to the arms present in the batch,
    with r_t(arm) = mean over the arm's slots of `ProblemOutcome.mean_abs_advantage`; other arms keep Q.
    """

    type = "sec"
    value_key = "q"
    cfg: SecConfig

    def __init__(self, cfg: SecConfig) -> None:
        super().__init__(cfg)
        self.last_step: int | None = None

    @property
    def q(self) -> dict[str, float]:
        return self.values

    def initial_value(self) -> float:
        return 0.0  # Q starts at 0 for every arm

    def arm_probabilities(self, pool: Sequence[PoolProblem]) -> dict[str, float]:
        """P_t over the arms with problems in `pool`, sorted by arm, from the current Q."""
        return boltzmann_probabilities(self.values, list(arm_sizes(pool)), self.cfg.tau)

    def batch_reward(self, pulled: Sequence[ProblemOutcome]) -> float:
        return sum(o.mean_abs_advantage for o in pulled) / len(pulled)

    def next_value(self, before: float | None, reward: float) -> float:
        return td_update(before or 0.0, reward, self.cfg.alpha)

    def observe(self, feedback: StepFeedback) -> list[dict[str, Any]]:
        rows = super().observe(feedback)
        self.last_step = feedback.step
        return rows

    def state_dict(self) -> dict[str, Any]:
        """Q and cumulative pulls per arm, the number of updates (SEC's t) and the last observed step."""
        return {**super().state_dict(), "last_step": self.last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        last = state.get("last_step")
        self.last_step = None if last is None else int(last)
