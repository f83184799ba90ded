"""Uniform budgets: the same number of rollouts for every prompt (the GRPO default)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from rlvr.curricula.base import AllocateConfig, Allocation, BudgetAllocator, Estimate, Pick, case_of


class UniformBudgetConfig(AllocateConfig):
    type: Literal["uniform"] = "uniform"


class UniformBudget(BudgetAllocator):
    """total_budget / len(picks) rollouts each; the budget must divide evenly."""

    type = "uniform"

    def allocate(self, picks: Sequence[Pick], estimates: Sequence[Estimate], total_budget: int) -> list[Allocation]:
        if len(picks) != len(estimates):
            raise ValueError(f"{len(picks)} picks but {len(estimates)} estimates")
        if not picks:
            return []
        n, remainder = divmod(total_budget, len(picks))
        if n < 1 or remainder:
            raise ValueError(f"a total budget of {total_budget} does not split evenly over {len(picks)} prompts")
        return [Allocation(n=n, case=case_of(e.p_hat)) for e in estimates]
