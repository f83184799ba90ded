"""MMR1 Variance-Aware Sampling (docs/methods.md#vas): part of each batch is drawn in proportion to a
problem's variance-promotion score, VPS = a·OVS + b·TDS, and the rest uniformly.

OVS = p̂(1−p̂) is the outcome variance of the problem's latest group (the expected policy-gradient size is
bounded below by the reward variance); TDS is the diversity of that group's responses, a tie-breaker
favouring problems with varied solution paths. The paper's default weights, share and refresh period
were not verified: the defaults here (equal weights, half the batch, refresh every step) are the neutral
starting point docs/methods.md#vas gives, to be ablated. OVS lies in [0, 0.25] and TDS in [0, 1], so with equal
weights TDS moves VPS more than OVS does.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import Field

from rlvr.curricula.base import Pick, PoolProblem, SelectConfig, SelectionStrategy, StepFeedback
from rlvr.curricula.prioritized import success_rate
from rlvr.curricula.sampling import draw_index, require_selectable


class VasConfig(SelectConfig):
    type: Literal["vas"] = "vas"
    vps_share: float = Field(0.5, ge=0.0, le=1.0, description="λ: share of the batch drawn in proportion to VPS")
    ovs_weight: float = Field(0.5, ge=0.0, description="a: weight of the outcome variance p̂(1−p̂)")
    tds_weight: float = Field(0.5, ge=0.0, description="b: weight of the response diversity")
    update_every: int = Field(1, ge=1, description="steps between refreshes of the VPS table the draws use")


def outcome_variance(rewards: Sequence[float]) -> float:
    """OVS = p̂(1−p̂), p̂ the group's clipped mean reward (0 for an empty group)."""
    if not rewards:
        return 0.0
    p = success_rate(rewards)
    return p * (1.0 - p)


def ngrams(response: str) -> frozenset[tuple[str, ...]]:
    """Word unigrams and bigrams of a response: enough to tell reworded solutions from repeated ones."""
    words = response.split()
    return frozenset([(w,) for w in words] + list(zip(words, words[1:])))


def response_diversity(responses: Sequence[str]) -> float:
    """TDS: mean over response pairs of 1 − Jaccard(n-grams), in [0, 1].

    A cheap stand-in for 1 − self-BLEU: 0 when every response is the same text, 1 when no two share a
    word. Fewer than two responses show no diversity (0); two empty responses count as identical.
    """
    grams = [ngrams(r) for r in responses]
    pairs = list(itertools.combinations(grams, 2))
    if not pairs:
        return 0.0
    distance = 0.0
    for a, b in pairs:
        union = len(a | b)
        distance += 1.0 - (len(a & b) / union if union else 1.0)
    return distance / len(pairs)


def slot_split(batch_size: int, vps_share: float) -> tuple[int, int]:
    """(VPS slots, uniform slots): round(λ·B) half up, so λ = 0.5 and B = 5 gives 3 and 2."""
    drawn = min(batch_size, math.floor(vps_share * batch_size + 0.5))
    return drawn, batch_size - drawn


class VasStrategy(SelectionStrategy):
    """VAS with a VPS table refreshed every `update_every` steps from the latest outcome of each problem.

    A problem without a score in the table gets OVS = p̂(1−p̂) from the difficulty stage (0.25, the
    maximum, without one) and TDS = 1 (the maximum: nothing shows its responses alike), so unseen
    problems are explored. If every VPS is 0 the VPS part draws uniformly.
    rng: the first round(λ·B) slots take one `rng.random()` each, an inverse-CDF draw ∝ VPS over the pool
    sorted by problem_id; the remaining slots take one `rng.randrange(len(pool))` each. Both draw with
    replacement; a pick's probability is that of its own draw (VPS_i/ΣVPS, or 1/|pool|).
    """

    type = "vas"
    cfg: VasConfig

    def __init__(self, cfg: VasConfig) -> None:
        super().__init__(cfg)
        self.scores: dict[str, tuple[float, float]] = {}  # latest (OVS, TDS) per problem
        self.vps: dict[str, float] = {}  # the table the draws use, as of the last refresh
        self.updates = 0

    def prior_vps(self, problem: PoolProblem) -> float:
        ovs = problem.p_hat * (1.0 - problem.p_hat) if problem.p_hat is not None else 0.25
        return self.cfg.ovs_weight * ovs + self.cfg.tds_weight * 1.0

    def vps_probabilities(self, ordered: Sequence[PoolProblem]) -> list[float]:
        """Each problem's chance in one VPS draw (uniform when every VPS is 0)."""
        weights = [self.vps.get(p.problem_id, self.prior_vps(p)) for p in ordered]
        total = sum(weights)
        if total <= 0.0:
            return [1.0 / len(ordered)] * len(ordered)
        return [w / total for w in weights]

    def select(self, pool: Sequence[PoolProblem], batch_size: int, rng: random.Random) -> list[Pick]:
        require_selectable(pool, batch_size)
        ordered = sorted(pool, key=lambda p: p.problem_id)
        probs = self.vps_probabilities(ordered)
        cumulative = list(itertools.accumulate(probs))
        by_vps, uniform = slot_split(batch_size, self.cfg.vps_share)
        picks = []
        for _ in range(by_vps):
            i = draw_index(cumulative, rng)
            picks.append(Pick(ordered[i].problem_id, ordered[i].arm, probs[i]))
        for _ in range(uniform):
            problem = ordered[rng.randrange(len(ordered))]
            picks.append(Pick(problem.problem_id, problem.arm, 1.0 / len(ordered)))
        return picks

    def observe(self, feedback: StepFeedback) -> list[dict[str, Any]]:
        """Score each problem of the batch from this step's groups (a problem drawn twice pools its slots);
        refresh the table the draws use when the step count reaches a multiple of `update_every`.

        Audit rows are the default ones plus `probability` (the chance one slot of the step, counting both
        parts by their shares, landed in the arm) and `refreshed`.
        """
        rows = super().observe(feedback)
        arm_probability = self.arm_probabilities(feedback.pool)
        pooled: dict[str, tuple[list[float], list[str]]] = {}
        for outcome in sorted(feedback.outcomes, key=lambda o: o.slot):
            rewards, responses = pooled.setdefault(outcome.problem_id, ([], []))
            rewards.extend(outcome.rewards)
            responses.extend(outcome.responses)
        for problem_id, (rewards, responses) in pooled.items():
            self.scores[problem_id] = (outcome_variance(rewards), response_diversity(responses))
        self.updates += 1
        refreshed = self.updates % self.cfg.update_every == 0
        if refreshed:
            self.vps = {
                pid: self.cfg.ovs_weight * ovs + self.cfg.tds_weight * tds for pid, (ovs, tds) in self.scores.items()
            }
        return [{**row, "probability": arm_probability.get(row["arm"]), "refreshed": refreshed} for row in rows]

    def arm_probabilities(self, pool: Sequence[PoolProblem]) -> dict[str, float]:
        if not pool:
            return {}
        ordered = sorted(pool, key=lambda p: p.problem_id)
        share = self.cfg.vps_share
        result: dict[str, float] = {}
        for problem, prob in zip(ordered, self.vps_probabilities(ordered)):
            result[problem.arm] = result.get(problem.arm, 0.0) + share * prob + (1.0 - share) / len(ordered)
        return result

    def state_dict(self) -> dict[str, Any]:
        """Latest (OVS, TDS) per scored problem, the VPS table of the last refresh, the number of updates."""
        return {
            "scores": {pid: list(s) for pid, s in self.scores.items()},
            "vps": dict(self.vps),
            "updates": self.updates,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scores = {str(pid): (float(s[0]), float(s[1])) for pid, s in state.get("scores", {}).items()}
        self.vps = {str(pid): float(v) for pid, v in state.get("vps", {}).items()}
        self.updates = int(state.get("updates", 0))
