"""RuleReasoner's domain-aware dynamic sampling, DADS (docs/methods.md#dads): arms (domains, or whatever
`select.arms` groups by) whose rewards are still low are drawn more often, from an EMA of each arm's
mean reward.

The paper's exact formula was not verified; this is the reconstruction in docs/methods.md#dads:
r̄ ← γ·r̄ + (1−γ)·mean reward, w ∝ exp((1 − r̄)/τ), an arm drawn from w, then a problem uniformly.
Unlike SEC it rewards "not yet solved" rather than "learnable now", so it can chase arms that cannot be
solved. Two guards bound that: r̄ is clipped to [0, 1] before weighting, so no arm weighs more than
exp(1/τ) times another, and `uniform_share` of the probability is spread evenly over the arms.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import Field

from rlvr.curricula.arm_bandit import ArmBandit
from rlvr.curricula.base import PoolProblem, ProblemOutcome, SelectConfig, arm_sizes
from rlvr.curricula.sec import boltzmann_probabilities


class DadsConfig(SelectConfig):
    type: Literal["dads"] = "dads"
    gamma: float = Field(0.9, ge=0.0, lt=1.0, description="EMA decay of each arm's mean reward")
    tau: float = Field(0.5, gt=0.0, description="temperature of w ∝ exp((1 − r̄)/τ)")
    uniform_share: float = Field(
        0.1, ge=0.0, le=1.0, description="probability spread evenly over arms, so none falls below share/arms"
    )


def reward_ema(previous: float | None, batch_mean: float, gamma: float) -> float:
    """γ·r̄ + (1−γ)·mean; an arm's first batch sets r̄ to its mean, so the EMA is not biased to a prior."""
    if previous is None:
        return batch_mean
    return gamma * previous + (1.0 - gamma) * batch_mean


def dads_probabilities(
    ema: Mapping[str, float], arms: Sequence[str], tau: float, uniform_share: float
) -> dict[str, float]:
    """(1 − share)·softmax((1 − clip(r̄, 0, 1))/τ) + share/K over `arms`; an arm never observed counts
    as r̄ = 0 (unsolved as far as anyone knows), so new arms are explored first."""
    if not arms:
        return {}
    need = {arm: 1.0 - min(1.0, max(0.0, ema.get(arm, 0.0))) for arm in arms}
    soft = boltzmann_probabilities(need, arms, tau)
    return {arm: (1.0 - uniform_share) * soft[arm] + uniform_share / len(arms) for arm in arms}


class DadsStrategy(ArmBandit):
    """DADS: before each batch, arm probabilities from the reward EMAs; each slot an arm, then a problem.

    rng: as SEC, `draw_arm_batch` (one `rng.random()` for the arm, then one `rng.randrange` for the
    problem, per slot); a pick's probability is P(arm) / |pool[arm]|. The batch's mean reward of an arm is
    the mean over its slots of `ProblemOutcome.mean_reward` (each prompt counts once, whatever its group size).
    """

    type = "dads"
    value_key = "ema"
    cfg: DadsConfig

    @property
    def ema(self) -> dict[str, float]:
        return self.values

    def arm_probabilities(self, pool: Sequence[PoolProblem]) -> dict[str, float]:
        return dads_probabilities(self.values, list(arm_sizes(pool)), self.cfg.tau, self.cfg.uniform_share)

    def batch_reward(self, pulled: Sequence[ProblemOutcome]) -> float:
        return sum(o.mean_reward for o in pulled) / len(pulled)

    def next_value(self, before: float | None, reward: float) -> float:
        """The EMA; q_before / q_after in the rows are r̄ before and after (None before an arm's first batch)."""
        return reward_ema(before, reward, self.cfg.gamma)
