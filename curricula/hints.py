"""GHPO's adaptive guidance: a problem the policy cannot solve gets a prefix of its reference solution
as a hint in its prompt, growing while its groups stay all wrong and shrinking once they have signal.

Each problem has a hint level: 0 (no hint) or i >= 1 (the first `ratios[i-1]` of its solution's words).
After a step, every group of a problem with a solution moves its level: up one when all of its samples
were wrong (raw correctness, not a shaped reward), down one otherwise (some sample was right: the hint
did its work, or was not needed). The levels are part of the selection state the update stage carries,
so the hint a pick gets is a pure function of committed artifacts and a resumed run gives the same.
Evaluation and difficulty estimation read the problems' own prompts: they never see a hint.

GHPO (Liu et al. 2025) detects all-wrong groups and retries them with 1/4, 1/2, 3/4 of the solution;
here the retry is the next time the problem is drawn, and the level shrinks again once the problem has
signal, so a problem that became solvable is trained on without help. A short run draws most problems
once, so that retry rarely comes; with `from_difficulty` the difficulty pass's samples stand for the
first all-wrong group: a problem it never saw solved starts at level 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "GroupOutcome",
    "HintConfig",
    "hint_prefix",
    "hinted_prompt",
    "level_of",
    "next_levels",
    "ratio_of",
    "solutions_of",
    "start_levels",
    "starting_levels",
]

STATE_KEY = "hint_levels"  # where the levels live in the selection state dict


class HintConfig(BaseModel):
    """`select.hints`: GHPO's hint schedule."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="give problems with a `solution` hints after all-wrong groups")
    ratios: tuple[float, ...] = Field(
        (0.25, 0.5, 0.75), description="the share of the solution's words each hint level shows, level 1 first"
    )
    template: str = Field(
        "{prompt}\n\nThe beginning of a solution, to continue from: {hint}",
        description="how a hint joins the prompt ({prompt} and {hint})",
    )
    from_difficulty: bool = Field(
        False,
        exclude_if=lambda value: value is False,  # left out of dumps (so of ids) when off
        description=(
            "a problem the difficulty pass never saw solved (pass rate 0) starts at level 1: its first draw is "
            "hinted, so hints act in runs too short to draw a problem twice"
        ),
    )

    @field_validator("ratios")
    @classmethod
    def _increasing(cls, ratios: tuple[float, ...]) -> tuple[float, ...]:
        if not ratios or any(not 0 < r <= 1 for r in ratios) or list(ratios) != sorted(set(ratios)):
            raise ValueError(f"hint ratios must be increasing shares in (0, 1], got {list(ratios)}")
        return ratios

    @field_validator("template")
    @classmethod
    def _has_prompt_and_hint_fields(cls, template: str) -> str:
        if "{prompt}" not in template or "{hint}" not in template:
            raise ValueError("the hint template needs both {prompt} and {hint}")
        return template


@dataclass(frozen=True)
class GroupOutcome:
    """One group of a step for the hint schedule: its problem and whether any sample was correct."""

    slot: int
    problem_id: str
    any_correct: bool


def start_levels(pass_rates: Mapping[str, float | None], hintable: set[str], cfg: HintConfig) -> dict[str, int]:
    """The level of each problem before its first group (`from_difficulty`): 1 for a hintable problem whose
    difficulty pass rate is 0, none otherwise (level 0)."""
    if not cfg.from_difficulty:
        return {}
    return {pid: 1 for pid, rate in pass_rates.items() if rate == 0 and pid in hintable}


def starting_levels(problems: pa.Table, difficulty: Iterable[Mapping[str, Any]], cfg: HintConfig) -> dict[str, int]:
    """`start_levels` of a run's problems table and its difficulty rows (problem_id, pass_rate)."""
    if not (cfg.enabled and cfg.from_difficulty):
        return {}
    rates = {str(row["problem_id"]): row["pass_rate"] for row in difficulty}
    return start_levels(rates, set(solutions_of(problems)), cfg)


def level_of(problem_id: str, levels: Mapping[str, int], start: Mapping[str, int]) -> int:
    """A problem's level: the carried one once it has had a group, else its start level."""
    return levels.get(problem_id, start.get(problem_id, 0))


def ratio_of(level: int, cfg: HintConfig) -> float:
    """The share of the solution a level shows (0.0 at level 0)."""
    return 0.0 if level <= 0 else cfg.ratios[min(level, len(cfg.ratios)) - 1]


def next_levels(
    levels: Mapping[str, int],
    outcomes: Iterable[GroupOutcome],
    hintable: set[str],
    cfg: HintConfig,
    start: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """The levels after a step: each group of a problem in `hintable` (those with a solution), in slot order,
    moves its problem's level (its `start` level before its first group) up one when it was all wrong and
    down one otherwise. Level 0 is stored only for problems with a start level, which it then replaces."""
    start = start or {}
    after = dict(levels)
    for outcome in sorted(outcomes, key=lambda o: o.slot):
        if outcome.problem_id not in hintable:
            continue
        level = level_of(outcome.problem_id, after, start)
        level = max(level - 1, 0) if outcome.any_correct else min(level + 1, len(cfg.ratios))
        after[outcome.problem_id] = level
    return {problem: level for problem, level in sorted(after.items()) if level > 0 or problem in start}


def hint_prefix(solution: str, ratio: float) -> str:
    """The first ceil(ratio x words) whitespace-separated words of `solution` (words, so a number is never
    cut in half); empty at ratio 0."""
    words = solution.split()
    return " ".join(words[: math.ceil(ratio * len(words))]) if ratio > 0 else ""


def hinted_prompt(prompt: str, solution: str | None, ratio: float, cfg: HintConfig) -> str:
    """The prompt a rollout samples from: unchanged at ratio 0 or without a solution."""
    hint = hint_prefix(solution or "", ratio)
    return cfg.template.format(prompt=prompt, hint=hint) if hint else prompt


def solutions_of(problems: pa.Table) -> dict[str, str]:
    """problem_id -> solution of the problems that have one (none for a problems table from before the column)."""
    if "solution" not in problems.column_names:
        return {}
    columns = problems.select(["problem_id", "solution"]).to_pydict()
    return {pid: text for pid, text in zip(columns["problem_id"], columns["solution"]) if text}
