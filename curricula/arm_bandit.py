"""A bandit over arms (problem categories, difficulty bins or both), the shape SEC and DADS share: each
step draws every slot's arm from the arms' probabilities and then a problem uniformly within it
(`draw_arm_batch`), and after the step moves the value of each arm the batch pulled, from the arm's
reward in that batch. A subclass says what the reward is (`batch_reward`), how the value moves
(`next_value`), what an arm's value is before its first pull (`initial_value`) and how values become
probabilities (`arm_probabilities`). Its `curriculum_state` rows and its state are the same for both.
"""

from __future__ import annotations

import random
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from rlvr.curricula.base import (
    Pick,
    PoolProblem,
    ProblemOutcome,
    SelectConfig,
    SelectionStrategy,
    StepFeedback,
    arm_sizes,
    outcomes_by_arm,
)
from rlvr.curricula.sampling import draw_arm_batch, problems_by_arm, require_selectable


class ArmBandit(SelectionStrategy):
    """Arm values, pulls and updates, with the draw, the observation rows and the state shared; `value_key`
    names the values in the state dict ("q" for SEC, "ema" for DADS)."""

    value_key: ClassVar[str]

    def __init__(self, cfg: SelectConfig) -> None:
        super().__init__(cfg)
        self.values: dict[str, float] = {}
        self.pulls: dict[str, int] = {}
        self.updates = 0

    @abstractmethod
    def arm_probabilities(self, pool: Sequence[PoolProblem]) -> dict[str, float]:
        """P(arm) over the arms with problems in `pool`, from the current values."""

    @abstractmethod
    def batch_reward(self, pulled: Sequence[ProblemOutcome]) -> float:
        """The arm's reward in a batch, from the outcomes of its slots (at least one)."""

    @abstractmethod
    def next_value(self, before: float | None, reward: float) -> float:
        """The arm's value after a batch with this reward."""

    def initial_value(self) -> float | None:
        """An arm's value before its first pull (None: it has none yet)."""
        return None

    def select(self, pool: Sequence[PoolProblem], batch_size: int, rng: random.Random) -> list[Pick]:
        require_selectable(pool, batch_size)
        return draw_arm_batch(problems_by_arm(pool), self.arm_probabilities(pool), batch_size, rng)

    def observe(self, feedback: StepFeedback) -> list[dict[str, Any]]:
        """Move the values of the batch's arms; one audit row per arm of the pool (and per batch arm outside it).

        `probability` is P(arm), recomputed from the values the step was selected with and the step's pool.
        An arm that was trained but is not in `feedback.pool` still gets its update (the batch is what was
        trained); its row has pool_size 0 and probability None. q_before and q_after are the arm's value.
        """
        sizes = arm_sizes(feedback.pool)
        probs = self.arm_probabilities(feedback.pool)
        grouped = outcomes_by_arm(feedback.outcomes)
        rows = []
        for arm in sorted(set(sizes) | set(grouped)):
            pulled = grouped.get(arm, [])
            before = self.values.get(arm, self.initial_value())
            reward = self.batch_reward(pulled) if pulled else None
            after = self.next_value(before, reward) if reward is not None else before
            if after is not None:
                self.values[arm] = after
            self.pulls[arm] = self.pulls.get(arm, 0) + len(pulled)
            rows.append(
                {
                    "arm": arm,
                    "pool_size": sizes.get(arm, 0),
                    "q_before": before,
                    "probability": probs.get(arm),
                    "pulls": len(pulled),
                    "reward": reward,
                    "q_after": after,
                    "cumulative_pulls": self.pulls[arm],
                }
            )
        self.updates += 1
        return rows

    def state_dict(self) -> dict[str, Any]:
        """The value of every arm seen, cumulative pulls per arm and the number of updates."""
        return {self.value_key: dict(self.values), "pulls": dict(self.pulls), "updates": self.updates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.values = {str(arm): float(v) for arm, v in state.get(self.value_key, {}).items()}
        self.pulls = {str(arm): int(n) for arm, n in state.get("pulls", {}).items()}
        self.updates = int(state.get("updates", 0))
