"""Kimi k1.5 prioritized sampling (docs/methods.md#prioritized-sampling): problems the policy still fails
are drawn more often, P(i) ∝ 1 − s_i, where s_i is the problem's success rate tracked from the run's own
rollouts.

Left as is, the rule gives never-solved problems (s = 0, zero GRPO gradient) the largest weight, so the
weight is 1 − max(s_i, success_floor): no problem weighs more than one solved `success_floor` of the
time. The default floor 0.5 ties everything at or below a 50% success rate, where the GRPO signal
p(1−p) peaks; success_floor = 0 is the paper's rule.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import Field

from rlvr.curricula.base import Pick, PoolProblem, SelectConfig, SelectionStrategy, StepFeedback
from rlvr.curricula.sampling import draw_index, require_selectable


class PrioritizedConfig(SelectConfig):
    type: Literal["prioritized"] = "prioritized"
    success_floor: float = Field(
        0.5, ge=0.0, lt=1.0, description="s below this counts as this, so unsolved problems cannot dominate"
    )
    history: int = Field(16, ge=1, description="most recent rollout rewards kept per problem")
    prior_success: float = Field(
        0.5, ge=0.0, le=1.0, description="s of a problem with no outcome yet and no difficulty estimate"
    )


def success_rate(rewards: Sequence[float]) -> float:
    """Mean reward with each reward clipped to [0, 1]: the success rate for binary rewards, the mean
    credit for partial-credit rewards, and never outside [0, 1] for shaped ones."""
    return sum(min(1.0, max(0.0, r)) for r in rewards) / len(rewards)


def priority_weight(success: float, floor: float) -> float:
    """1 − max(s, floor): Kimi's priority with the floor that keeps never-solved problems from dominating."""
    return 1.0 - max(success, floor)


class PrioritizedStrategy(SelectionStrategy):
    """Draws each slot from the whole pool with replacement, P(i) ∝ 1 − max(s_i, success_floor).

    s_i is the clipped mean of the problem's last `history` rollout rewards; before its first outcome it
    is the difficulty stage's p̂ (`PoolProblem.p_hat`), else `prior_success`. When every weight is 0
    (every problem always solved) the draw is uniform. rng: one `rng.random()` per slot, an inverse-CDF
    draw over the pool sorted by problem_id. A pick's probability is its weight over the total.
    """

    type = "prioritized"
    cfg: PrioritizedConfig

    def __init__(self, cfg: PrioritizedConfig) -> None:
        super().__init__(cfg)
        self.history: dict[str, list[float]] = {}
        self.updates = 0

    def success(self, problem: PoolProblem) -> float:
        rewards = self.history.get(problem.problem_id)
        if rewards:
            return success_rate(rewards)
        return problem.p_hat if problem.p_hat is not None else self.cfg.prior_success

    def draw_probabilities(self, pool: Sequence[PoolProblem]) -> list[tuple[PoolProblem, float]]:
        """Each problem of the pool (sorted by id) with its chance of being drawn in one draw."""
        ordered = sorted(pool, key=lambda p: p.problem_id)
        weights = [priority_weight(self.success(p), self.cfg.success_floor) for p in ordered]
        total = sum(weights)
        if total <= 0.0:
            return [(p, 1.0 / len(ordered)) for p in ordered]
        return [(p, w / total) for p, w in zip(ordered, weights)]

    def select(self, pool: Sequence[PoolProblem], batch_size: int, rng: random.Random) -> list[Pick]:
        require_selectable(pool, batch_size)
        drawable = self.draw_probabilities(pool)
        cumulative = list(itertools.accumulate(prob for _, prob in drawable))
        picks = []
        for _ in range(batch_size):
            problem, prob = drawable[draw_index(cumulative, rng)]
            picks.append(Pick(problem.problem_id, problem.arm, prob))
        return picks

    def observe(self, feedback: StepFeedback) -> list[dict[str, Any]]:
        """Append each slot's rewards to its problem's history (slots in order, oldest dropped first).

        Audit rows are the default ones plus `probability`, the chance one draw of this step landed in
        the arm (computed from the history before this update, the one the step was selected with).
        """
        arm_probability: dict[str, float] = {}
        for problem, prob in self.draw_probabilities(feedback.pool) if feedback.pool else []:
            arm_probability[problem.arm] = arm_probability.get(problem.arm, 0.0) + prob
        rows = [{**row, "probability": arm_probability.get(row["arm"])} for row in super().observe(feedback)]
        for outcome in sorted(feedback.outcomes, key=lambda o: o.slot):
            if outcome.rewards:
                kept = self.history.get(outcome.problem_id, []) + [float(r) for r in outcome.rewards]
                self.history[outcome.problem_id] = kept[-self.cfg.history :]
        self.updates += 1
        return rows

    def state_dict(self) -> dict[str, Any]:
        """The recent rewards of every problem that has had an outcome, and the number of updates."""
        return {"history": {pid: list(rewards) for pid, rewards in self.history.items()}, "updates": self.updates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = {str(pid): [float(r) for r in rewards] for pid, rewards in state.get("history", {}).items()}
        self.updates = int(state.get("updates", 0))
