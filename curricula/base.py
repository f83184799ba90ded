"""The two curriculum interfaces: a selection strategy (which problems a step trains on) and a budget
allocator (how many rollouts each gets), with the plain data they exchange with the pipeline.

Both are plain code: no Prefect, no store, no I/O. The select / update / allocate stages (tasks/)
build their inputs from artifacts, call them, and write what they return as artifact rows, so every
decision is a row a query can explain. A strategy's whole memory is `state_dict()`: the pipeline
persists it after every step and a resumed run continues from it exactly.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from rlvr.curricula.hints import HintConfig

__all__ = [
    "AllocateConfig",
    "Allocation",
    "BudgetAllocator",
    "Estimate",
    "Pick",
    "PoolProblem",
    "ProblemOutcome",
    "SelectConfig",
    "SelectionStrategy",
    "StepFeedback",
    "arm_sizes",
    "case_of",
    "outcomes_by_arm",
]


@dataclass(frozen=True)
class PoolProblem:
    """A problem a strategy may pick: its arm (the category it is sampled through) and what is known of it.

    `p_hat` is the difficulty stage's pass rate under the reference policy (None when not estimated).
    """

    problem_id: str
    arm: str
    domain: str = ""
    category: str = ""
    p_hat: float | None = None


@dataclass(frozen=True)
class Pick:
    """One batch slot's problem, its arm, and the probability of drawing that problem (as the strategy
    defines it; each strategy's docstring says which probability it records)."""

    problem_id: str
    arm: str
    probability: float


@dataclass(frozen=True)
class ProblemOutcome:
    """What one batch slot produced: its rewards and the GRPO advantages the trainer computes from them
    (every group, before any filtering, so a filtered group counts with advantages of 0)."""

    slot: int
    problem_id: str
    arm: str
    rewards: tuple[float, ...]
    advantages: tuple[float, ...]
    responses: tuple[str, ...] = ()

    @property
    def mean_abs_advantage(self) -> float:
        """(1/G) Σ_j |A_j|: SEC's learning-progress signal for this prompt (0 for an empty group)."""
        return sum(abs(a) for a in self.advantages) / len(self.advantages) if self.advantages else 0.0

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else 0.0


@dataclass(frozen=True)
class StepFeedback:
    """Everything a strategy learns from one step: the pool it selected from and each slot's outcome."""

    step: int
    pool: Sequence[PoolProblem]
    outcomes: Sequence[ProblemOutcome]


def arm_sizes(pool: Sequence[PoolProblem]) -> dict[str, int]:
    """Problems per arm, arms in sorted order (so every strategy iterates arms the same way)."""
    sizes: dict[str, int] = {}
    for problem in pool:
        sizes[problem.arm] = sizes.get(problem.arm, 0) + 1
    return dict(sorted(sizes.items()))


def outcomes_by_arm(outcomes: Sequence[ProblemOutcome]) -> dict[str, list[ProblemOutcome]]:
    grouped: dict[str, list[ProblemOutcome]] = {}
    for outcome in outcomes:
        grouped.setdefault(outcome.arm, []).append(outcome)
    return grouped


class SelectConfig(BaseModel):
    """Fields every selection strategy shares; each strategy's config subclasses it and adds `type`."""

    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(64, ge=1, description="prompts per RL step")
    splits: list[str] = Field(default_factory=lambda: ["train", "warmup"], description="splits the pool is drawn from")
    arms: str = Field(
        "category",
        pattern="^(category|bin|category_bin)$",
        description="what an arm is: the problem's category, its difficulty bin, or both (SEC's 2-D arms)",
    )
    hints: HintConfig = Field(
        default_factory=HintConfig,
        exclude_if=lambda value: not value.enabled,  # left out of dumps (so of ids) when off: earlier runs keep theirs
        description="GHPO: hints from the problem's solution after all-wrong groups (curricula/hints.py)",
    )


class SelectionStrategy(ABC):
    """Picks each step's batch; learns from the step's feedback; its state is a plain dict."""

    type: ClassVar[str]
    version: ClassVar[str] = "1"

    def __init__(self, cfg: SelectConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    def select(self, pool: Sequence[PoolProblem], batch_size: int, rng: random.Random) -> list[Pick]:
        """`batch_size` picks from `pool` (sorted by problem_id by the caller), using only `rng` for chance."""

    def observe(self, feedback: StepFeedback) -> list[dict[str, Any]]:
        """Learn from a finished step; return one audit row per arm for the `curriculum_state` view.

        The default learns nothing and reports, per arm of the pool, how often it was pulled and the mean
        |advantage| of its prompts (SEC's reward), so every strategy's choices can be audited alike.
        """
        sizes = arm_sizes(feedback.pool)
        grouped = outcomes_by_arm(feedback.outcomes)
        rows = []
        for arm, size in sizes.items():
            pulled = grouped.get(arm, [])
            reward = sum(o.mean_abs_advantage for o in pulled) / len(pulled) if pulled else None
            rows.append({"arm": arm, "pool_size": size, "pulls": len(pulled), "reward": reward})
        return rows

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (JSON-serialisable)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned."""


@dataclass(frozen=True)
class Estimate:
    """What is known of a picked problem's success rate when its budget is decided.

    `p_hat` is None when there is no valid estimate; `count` is the number of outcomes behind it
    (0 when it comes from elsewhere, e.g. the difficulty stage), `source` says where it came from.
    """

    p_hat: float | None
    count: int = 0
    source: str = "none"


@dataclass(frozen=True)
class Allocation:
    """Rollouts for one pick and why: `case` is effective / zero / one / unknown (the p̂ case it fell in),
    `value` the allocator's objective for this N (None when it has none), `fallback` whether leftover
    budget had to be spread outside the allocator's own rule."""

    n: int
    case: str = "unknown"
    value: float | None = None
    fallback: bool = False
    details: Mapping[str, Any] = field(default_factory=dict)


class AllocateConfig(BaseModel):
    """Fields every allocator shares; each allocator's config subclasses it and adds `type`."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(8, ge=1, description="rollouts per prompt of the uniform reference; total budget = prompts x n")

    @property
    def prior_for_unknown(self) -> bool:
        """Whether a problem without outcomes in this run is estimated by its pre-RL difficulty pass rate
        (True) or left unknown (its case then decides: the allocator's uniform count)."""
        return True


class BudgetAllocator(ABC):
    """Maps the step's picks to rollout counts under a total budget (ragged groups allowed)."""

    type: ClassVar[str]
    version: ClassVar[str] = "1"

    def __init__(self, cfg: AllocateConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    def allocate(self, picks: Sequence[Pick], estimates: Sequence[Estimate], total_budget: int) -> list[Allocation]:
        """One Allocation per pick, in order; the counts sum to `total_budget`."""


def case_of(p_hat: float | None) -> str:
    """The Knapsack RL case a success-rate estimate falls in."""
    if p_hat is None:
        return "unknown"
    if p_hat <= 0.0:
        return "zero"
    if p_hat >= 1.0:
        return "one"
    return "effective"
