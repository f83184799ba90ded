"""Knapsack RL budget allocation (docs/methods.md#knapsack-rl): rollouts move from prompts whose groups would come
back all-correct or all-wrong to frontier prompts, keeping the step's total rollouts fixed.

Each prompt is a knapsack item: cost = rollouts, value = P(a group of N has both outcomes) x InfoGain(p).
The value functions are plain functions so the audit, the tests and other trainers can use them.
Two solvers: `greedy`, the exact priority-queue allocation (docs/methods.md#greedy-solver; the default), and
`dp_reference`, the authors' dynamic programme with its quirk, kept for parity with their allocations.

Decisions where the specification is silent (each follows the authors' code unless it would fail):
- The frontier's need is Σ floor(min(max_n, cost_alpha(p̂))) over effective prompts, compared with the
  budget left after the minimum counts, as the authors' code does (`int(min(max_n, cost))`).
- When every prompt is effective there is nowhere to put a frontier surplus, so the solver gets all of it
  (the authors' code divides by zero there).
- With no effective and no p̂=0 prompt, a positive remainder resets every prompt to an even split of the
  total (n each when the total is prompts x n, the authors' "uniform n"; the first prompts get one more
  when it does not divide), all flagged fallback. Every even split gives the remainder to the first
  positions.
- A total below the minimum counts (n, min_n, negative_n, positive_n) is an error, not a silent shortfall.
- Only the final "leftover goes uniformly to the effective prompts" step can push a count above max_n;
  it happens when the budget exceeds what the effective prompts can absorb within max_n.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, model_validator

from rlvr.curricula.base import AllocateConfig, Allocation, BudgetAllocator, Estimate, Pick, case_of


class KnapsackConfig(AllocateConfig):
    type: Literal["knapsack"] = "knapsack"
    min_n: int = Field(2, ge=1, description="rollouts every effective prompt (0 < p̂ < 1) starts with")
    max_n: int = Field(128, ge=1, description="most rollouts the solver gives one prompt")
    negative_n: int = Field(2, ge=0, description="rollouts for a prompt never solved (p̂ = 0)")
    positive_n: int = Field(2, ge=0, description="rollouts for a prompt always solved (p̂ = 1)")
    alpha: float = Field(0.9, gt=0.0, lt=1.0, description="wanted chance of a mixed group in cost_alpha")
    solver: Literal["greedy", "dp_reference"] = Field(
        "greedy", description="greedy: exact priority queue; dp_reference: the authors' DP, for parity"
    )
    unknown: Literal["prior", "uniform"] = Field(
        "uniform",  # the paper's; runs before 2026-11-26 used prior (and their dumps leave the key out)
        description=(
            "a prompt with no outcome in this run yet: prior = estimated by its pre-RL difficulty pass rate; "
            "uniform = the paper's choice, n rollouts as in a uniform budget"
        ),
    )

    @property
    def prior_for_unknown(self) -> bool:
        return self.unknown == "prior"

    @model_validator(mode="after")
    def _bounds_ordered(self) -> KnapsackConfig:
        if self.max_n < self.min_n:
            raise ValueError(f"max_n ({self.max_n}) must be >= min_n ({self.min_n})")
        return self


def p_nonzero(n: int, p: float) -> float:
    """P(a group of n rollouts holds both a success and a failure) = 1 − p^n − (1−p)^n; 0 for an empty group."""
    if n <= 0:
        return 0.0
    return 1.0 - p**n - (1.0 - p) ** n


def info_gain(p: float) -> float:
    """p(1−p)²: the authors' proxy for what one update on the prompt is worth; it peaks at p = 1/3."""
    return p * (1.0 - p) ** 2


def value(n: int, p: float) -> float:
    """Value(N, p) = P_nz(N, p) · InfoGain(p), the item value the allocation maximises in sum."""
    return p_nonzero(n, p) * info_gain(p)


def marginal_gain(n: int, p: float) -> float:
    """Δ_N(p) = Value(N+1, p) − Value(N, p) = InfoGain(p)·[p^N(1−p) + (1−p)^N p] for N >= 1.

    It decreases in N, which is why giving rollouts one at a time to the largest Δ is optimal.
    """
    if n <= 0:
        return value(n + 1, p) - value(n, p)
    return info_gain(p) * (p**n * (1.0 - p) + (1.0 - p) ** n * p)


def cost_alpha(p: float, alpha: float) -> float:
    """ln(1−α) / ln(max(p, 1−p)): about the smallest N with P_nz(N, p) >= α, defined for 0 < p < 1."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"cost_alpha needs 0 < p < 1, got {p}")
    return math.log(1.0 - alpha) / math.log(max(p, 1.0 - p))


def greedy_extra(p_hats: Sequence[float], min_n: int, max_n: int, budget: int) -> tuple[list[int], int]:
    """Extra rollouts (beyond min_n) per effective prompt maximising Σ Value, and the budget left unplaced.

    Each of `budget` rollouts goes to the prompt with the largest Δ at its current count, below max_n;
    equal Δ goes to the earlier prompt. Exact because the objective is separable and concave in N_i with
    unit costs. Budget is left only when every prompt has reached max_n.
    """
    counts = [min_n] * len(p_hats)
    heap = [(-marginal_gain(min_n, p), i) for i, p in enumerate(p_hats) if min_n < max_n]
    heapq.heapify(heap)
    left = budget
    while left > 0 and heap:
        _, i = heapq.heappop(heap)
        counts[i] += 1
        left -= 1
        if counts[i] < max_n:
            heapq.heappush(heap, (-marginal_gain(counts[i], p_hats[i]), i))
    return [c - min_n for c in counts], left


def dp_reference_extra(p_hats: Sequence[float], min_n: int, max_n: int, budget: int) -> tuple[list[int], int]:
    """The authors' multiple-choice knapsack DP (docs/methods.md#reference-dp), quirk included; same result
    shape as `greedy_extra`.

    Choice k in 1..max_n−min_n extra rollouts scores Value(k + min_n, p̂); the "no extra" choice scores
    0, not Value(min_n, p̂), which favours giving every frontier prompt at least one extra rollout.
    Ties keep the first option met (no extra, then the smallest k). The backtrack starts at the largest
    reachable total <= budget; the rest is returned as left over. O(|E| · budget · (max_n − min_n)).
    """
    cap = max_n - min_n
    best = [0.0] + [-math.inf] * budget
    choices: list[list[int]] = []
    for p in p_hats:
        gains = [value(k + min_n, p) for k in range(cap + 1)]
        row, choice = list(best), [0] * (budget + 1)
        for w in range(budget + 1):
            for k in range(1, min(cap, w) + 1):
                candidate = best[w - k] + gains[k]
                if candidate > row[w]:
                    row[w], choice[w] = candidate, k
        best = row
        choices.append(choice)
    usable = max(w for w in range(budget + 1) if best[w] > -math.inf)
    extra = [0] * len(p_hats)
    w = usable
    for i in range(len(p_hats) - 1, -1, -1):
        extra[i] = choices[i][w]
        w -= extra[i]
    return extra, budget - usable


SOLVERS = {"greedy": greedy_extra, "dp_reference": dp_reference_extra}


def checked_p_hats(picks: Sequence[Pick], estimates: Sequence[Estimate]) -> list[float | None]:
    """The estimates' p̂, refusing anything that is not None or a number in [0, 1]."""
    if len(picks) != len(estimates):
        raise ValueError(f"{len(picks)} picks but {len(estimates)} estimates")
    p_hats = []
    for pick, estimate in zip(picks, estimates):
        p = estimate.p_hat
        if p is not None and not 0.0 <= p <= 1.0:  # NaN fails this test too
            raise ValueError(f"p_hat of problem {pick.problem_id!r} is {p}; expected a value in [0, 1] or None")
        p_hats.append(p)
    return p_hats


def spread_evenly(counts: list[int], indices: Sequence[int], amount: int, flags: list[bool] | None = None) -> None:
    """Add `amount` over `indices` as evenly as integers allow, the first positions taking the remainder;
    flag (when `flags` is given) every index that received something."""
    base, remainder = divmod(amount, len(indices))
    for position, i in enumerate(indices):
        added = base + (1 if position < remainder else 0)
        counts[i] += added
        if flags is not None and added:
            flags[i] = True


class KnapsackAllocator(BudgetAllocator):
    """Knapsack RL allocation per docs/methods.md#knapsack-allocation, with the solver chosen by `solver`.

    Allocation.value is Value(n, p̂) (None for a prompt with no estimate); details hold cost_alpha (None
    outside 0 < p̂ < 1) and marginal_value, the gain one more rollout would have added (None when unknown).
    Deterministic: no randomness, ties broken by position.
    """

    type = "knapsack"
    cfg: KnapsackConfig

    def allocate(self, picks: Sequence[Pick], estimates: Sequence[Estimate], total_budget: int) -> list[Allocation]:
        p_hats = checked_p_hats(picks, estimates)
        if total_budget < 0:
            raise ValueError(f"total_budget must be >= 0, got {total_budget}")
        if not picks:
            if total_budget:
                raise ValueError(f"cannot spread a budget of {total_budget} rollouts over no prompts")
            return []
        counts = [self.initial_count(p) for p in p_hats]
        remaining = total_budget - sum(counts)
        if remaining < 0:
            raise ValueError(
                f"total budget {total_budget} is below the {sum(counts)} rollouts the minimum counts need "
                f"(n={self.cfg.n} unknown, min_n={self.cfg.min_n}, negative_n={self.cfg.negative_n}, "
                f"positive_n={self.cfg.positive_n}); raise the budget or lower them"
            )
        fallback = [False] * len(p_hats)
        effective = [i for i, p in enumerate(p_hats) if case_of(p) == "effective"]
        if effective:
            self.fill_frontier(p_hats, effective, counts, remaining, fallback)
        elif remaining:
            counts = self.fill_without_frontier(p_hats, counts, remaining, total_budget, fallback)
        return [self.describe(n, p, flag) for n, p, flag in zip(counts, p_hats, fallback)]

    def initial_count(self, p_hat: float | None) -> int:
        case = case_of(p_hat)
        return {
            "unknown": self.cfg.n,
            "effective": self.cfg.min_n,
            "zero": self.cfg.negative_n,
            "one": self.cfg.positive_n,
        }[case]

    def fill_without_frontier(
        self, p_hats: Sequence[float | None], counts: list[int], remaining: int, total_budget: int, fallback: list[bool]
    ) -> list[int]:
        """No effective prompt: the remainder goes evenly to the p̂=0 prompts, else every prompt gets an
        even split of the whole total (the authors' uniform fallback)."""
        zeros = [i for i, p in enumerate(p_hats) if case_of(p) == "zero"]
        if zeros:
            spread_evenly(counts, zeros, remaining, fallback)
            return counts
        uniform = [0] * len(p_hats)
        spread_evenly(uniform, range(len(p_hats)), total_budget)
        fallback[:] = [True] * len(p_hats)
        return uniform

    def fill_frontier(
        self,
        p_hats: Sequence[float | None],
        effective: Sequence[int],
        counts: list[int],
        remaining: int,
        fallback: list[bool],
    ) -> None:
        """The frontier surplus goes to the other prompts (fallback), the solver places the rest among the
        effective prompts, and whatever it cannot place is spread evenly over them."""
        frontier = [p for i in effective if (p := p_hats[i]) is not None]  # effective p̂ are numbers
        need = sum(int(min(self.cfg.max_n, cost_alpha(p, self.cfg.alpha))) for p in frontier)
        others = [i for i, p in enumerate(p_hats) if case_of(p) == "zero"]
        others = others or [i for i, p in enumerate(p_hats) if case_of(p) != "effective"]
        if need < remaining and others:
            spread_evenly(counts, others, remaining - need, fallback)
            remaining = need
        extra, left = SOLVERS[self.cfg.solver](frontier, self.cfg.min_n, self.cfg.max_n, remaining)
        for i, k in zip(effective, extra):
            counts[i] += k
        if left:
            spread_evenly(counts, effective, left)

    def describe(self, n: int, p_hat: float | None, fallback: bool) -> Allocation:
        if p_hat is None:
            return Allocation(
                n=n, case="unknown", value=None, fallback=fallback, details={"cost_alpha": None, "marginal_value": None}
            )
        cost = cost_alpha(p_hat, self.cfg.alpha) if 0.0 < p_hat < 1.0 else None
        return Allocation(
            n=n,
            case=case_of(p_hat),
            value=value(n, p_hat),
            fallback=fallback,
            details={"cost_alpha": cost, "marginal_value": marginal_gain(n, p_hat)},
        )
