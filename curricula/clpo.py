"""CLPO, Curriculum Learning meets Policy Optimization (docs/methods.md#clpo): each step's rollouts diagnose
difficulty online; hard problems are simplified and medium ones diversified by a rewriter, and a rewrite
that the current policy solves sometimes but not always joins the problem pool. Hard-labelled samples
also get a smaller weight on the trainer's KL-to-reference term.

Plain decisions and the rewriter interface; generating, verifying and writing are the restructure stage's.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Label = Literal["hard", "medium", "easy"]
Mode = Literal["simplify", "diversify"]


class RestructureConfig(BaseModel):
    """The restructure stage (off by default). Thresholds and weights are the authors' released ones."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    rewriter: Literal["procedural", "policy"] = Field(
        "procedural",
        description="procedural: the problem source's own rewrite (generator-backed domains); "
        "policy: the policy rewrites through the domain verifier's prompt templates (the paper's CLPO)",
    )
    modes: Literal["both", "hard_only", "medium_only"] = "both"
    hard_threshold: float = Field(0.3, ge=0, le=1, description="accuracy <= this is hard (acc 0 included)")
    medium_threshold: float = Field(0.7, ge=0, le=1, description="accuracy in (hard, this] is medium")
    rollouts: int = Field(4, ge=2, description="samples of each rewrite that decide whether it is kept")
    max_new_tokens: int = Field(400, ge=1, description="length limit of a policy rewrite")
    kl_weight_hard: float = Field(0.5, ge=0, description="KL weight multiplier of hard-labelled samples")
    join: Literal["next_step", "same_step"] = Field(
        "next_step",
        exclude_if=lambda value: value == "next_step",  # left out of dumps (so of ids) at what earlier runs did
        description=(
            "same_step (the paper): kept rewrites train in the step that made them, on the samples that judged "
            "them, within the step's rollout budget (`share` of its prompts are left for rewrites); next_step: "
            "they join the pool for later steps only and their samples are extra"
        ),
    )
    share: float = Field(
        0.25,
        gt=0,
        lt=1,
        exclude_if=lambda value: value == 0.25,
        description="same_step: the share of select.batch_size (so of the rollout budget) kept for rewrites",
    )

    def rewrite_slots(self, batch_size: int) -> int:
        """How many of a step's `batch_size` prompts are rewrites (same_step; 0 otherwise): at least one."""
        return max(1, math.floor(self.share * batch_size)) if self.enabled and self.join == "same_step" else 0

    @model_validator(mode="after")
    def _ordered(self) -> RestructureConfig:
        if self.hard_threshold > self.medium_threshold:
            raise ValueError("hard_threshold must not exceed medium_threshold")
        return self


def label_of(accuracy: float, cfg: RestructureConfig) -> Label:
    """hard if accuracy <= hard_threshold, medium up to medium_threshold, easy above."""
    if accuracy <= cfg.hard_threshold:
        return "hard"
    if accuracy <= cfg.medium_threshold:
        return "medium"
    return "easy"


def mode_for(label: Label, cfg: RestructureConfig) -> Mode | None:
    """Hard problems are simplified, medium ones diversified, easy ones left alone (modes may restrict)."""
    if label == "hard" and cfg.modes in ("both", "hard_only"):
        return "simplify"
    if label == "medium" and cfg.modes in ("both", "medium_only"):
        return "diversify"
    return None


def kl_weight(label: Label, cfg: RestructureConfig) -> float:
    """s(label): the factor on the KL coefficient of a sample of a problem with this label."""
    return cfg.kl_weight_hard if label == "hard" else 1.0


def reveals_answer(prompt: str, answer: str) -> bool:
    """True when the rewritten prompt states the answer: the reference appears in it as a whole token
    (for a number: not inside a longer number)."""
    answer = answer.strip()
    if not answer:
        return False
    pattern = rf"(?<![\w.]){re.escape(answer)}(?![\w]|\.\d)"
    return re.search(pattern, prompt) is not None


def keeps_rewrite(accuracy: float) -> bool:
    """A rewrite is kept only when the policy solves it sometimes but not always (it gives gradient)."""
    return 0.0 < accuracy < 1.0


@dataclass(frozen=True)
class RewriteRequest:
    """One problem to rewrite, and how."""

    problem_id: str
    prompt: str
    answer: str
    domain: str
    mode: Mode
    params: str = ""


@dataclass(frozen=True)
class Rewrite:
    """A new problem made from a request: its prompt and reference answer (usually the original's)."""

    prompt: str
    answer: str


class Rewriter(ABC):
    """Turns problems into easier (simplify) or differently worded (diversify) problems."""

    name: str

    @abstractmethod
    def rewrite(self, requests: Sequence[RewriteRequest]) -> list[Rewrite | None]:
        """One result per request, in order; None when this problem cannot be rewritten that way."""
