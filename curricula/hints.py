"""GHPO's adaptive guidance: a problem the policy cannot solve gets a prefix of its reference solution
as a hint in its prompt, growing while its groups stay all wrong and shrinking once they have signal.

Each problem has a hint level: 0 (no hint) or i >= 1 (the first `ratios[i-1]` of its solution's words).
After a step, every group of a problem with something to hint moves its level: up one when all of its
samples were wrong (raw correctness, not a shaped reward), down one otherwise (some sample was right: the
hint did its work, or was not needed). The levels are part of the selection state the update stage carries,
so the hint a pick gets is a pure function of committed artifacts and a resumed run gives the same.
Evaluation and difficulty estimation read the problems' own prompts: they never see a hint.

A hint never states the problem's answer: it is cut before the first step of the solution (a sentence or
a line) whose text states the answer as a number (`45`, `45.0`, `1,776`, `\\boxed{45}`, `90/2`, but not
`145` or `4.5` for 45) or as its own text, and never includes the last step (the one that states the answer
by construction: "The answer is 45.", `#### 45`, a boxed result). A problem whose first step already states
the answer has nothing to hint: it is treated as one without a solution (never hinted, its level never
moves), so a hinted group is never rewarded for copying the answer from its prompt.

GHPO (Liu et al. 2025) detects all-wrong groups and retries them with 1/4, 1/2, 3/4 of the solution;
here the retry is the next time the problem is drawn, and the level shrinks again once the problem has
signal, so a problem that became solvable is trained on without help. A short run draws most problems
once, so that retry rarely comes; with `from_difficulty` the difficulty pass's samples stand for the
first all-wrong group: a problem it never saw solved starts at level 1.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "GroupOutcome",
    "HintConfig",
    "Solution",
    "hint_prefix",
    "hintable_part",
    "hinted_prompt",
    "level_of",
    "next_levels",
    "ratio_of",
    "solutions_of",
    "start_levels",
    "starting_levels",
    "states_answer",
]

STATE_KEY = "hint_levels"  # where the levels live in the selection state dict


class HintConfig(BaseModel):
    """`select.hints`: GHPO's hint schedule."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="give problems with a `solution` hints after all-wrong groups")
    ratios: tuple[float, ...] = Field(
        (0.25, 0.5, 0.75),
        description=(
            "the share of the solution's words each hint level shows, level 1 first (at most the steps before "
            "the one that states the answer)"
        ),
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

    @model_validator(mode="after")
    def _settings_only_when_enabled(self) -> HintConfig:
        """The schedule's settings with hints off would be dropped from the run (its dump leaves them out): refused."""
        unused = sorted(self.model_fields_set - {"enabled"})
        if unused and not self.enabled:
            raise ValueError(f"select.hints.{unused[0]} is set but select.hints.enabled is false: set enabled=true too")
        return self

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


@dataclass(frozen=True)
class Solution:
    """A problem's worked solution as its hints read it: the text, and the answers no hint may state (the
    problem's `answer` and, where it differs, its `reference`)."""

    text: str
    answers: tuple[str, ...] = ()

    @cached_property
    def hintable(self) -> str:
        """The part of the text a hint may show (`hintable_part`)."""
        return hintable_part(self.text, self.answers)


def hint_prefix(solution: Solution, ratio: float) -> str:
    """The first ceil(ratio x words) whitespace-separated words of the solution (words, so a number is never
    cut in half), but never more than its hintable part: a hint stops before the step that states the answer.
    Empty at ratio 0, and at every ratio for a solution whose first step states the answer."""
    if ratio <= 0:
        return ""
    shown = min(math.ceil(ratio * len(solution.text.split())), len(solution.hintable.split()))
    return " ".join(solution.text.split()[:shown])


def hinted_prompt(prompt: str, solution: Solution | None, ratio: float, cfg: HintConfig) -> str:
    """The prompt a rollout samples from: unchanged at ratio 0, without a solution, or with nothing to hint."""
    hint = hint_prefix(solution, ratio) if solution is not None else ""
    return cfg.template.format(prompt=prompt, hint=hint) if hint else prompt


def solutions_of(problems: pa.Table) -> dict[str, Solution]:
    """problem_id -> solution of the problems that have something to hint: a solution whose first step does
    not state the answer (none for a problems table from before the `solution` column)."""
    if "solution" not in problems.column_names:
        return {}
    names = [name for name in ("problem_id", "solution", "answer", "reference") if name in problems.column_names]
    columns = problems.select(names).to_pydict()
    found: dict[str, Solution] = {}
    for row in zip(*columns.values()):
        pid, text, *answers = row
        if text:
            solution = Solution(text, tuple(dict.fromkeys(a for a in answers if a)))
            if solution.hintable:
                found[pid] = solution
    return found


# --- where a solution states its answer ------------------------------------------------------

# A step ends after a sentence's `.`, `!` or `?` followed by whitespace (not a decimal point), or at a newline.
_STEP_END = re.compile(r"(?<=[.!?])\s+|\s*\n\s*")
# A number as written: digits with optional thousands separators and decimals (`1,776.5`), read left to right
# as a whole, so `45` is not found in `145`, `4.5` or `1,045`.
_NUMBER = re.compile(r"(?<!\d)\d+(?:,\d{3}(?!\d))*(?:\.\d+)?(?!\d)(\s*\\?%)?")
# Fractions: `3/4`, `\frac{3}{4}` (`\dfrac`, `\tfrac`), `\frac34`.
_SLASH = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)(?![\d.]|\.\d)")
_FRAC = re.compile(r"\\[dt]?frac\s*(?:\{\s*([^{}]*?)\s*\}|(\d))\s*(?:\{\s*([^{}]*?)\s*\}|(\d))")
_WRAPPER = re.compile(r"^(?:\\boxed|\\fbox)\s*\{(.*)\}$", re.S)
_DECORATION = re.compile(r"\\text\s*\{[^{}]*\}|\\mbox\s*\{[^{}]*\}|\^\s*\{?\\circ\}?|°|\\[$%!,;]|[$%]|\\left|\\right")


def hintable_part(solution: str, answers: Iterable[str]) -> str:
    """The steps of `solution` before the first one that states one of `answers` (`states_answer`), never the
    last step; empty when the first step states it or the solution has one step. Steps are sentences and
    lines, and the part is checked as a whole, so an answer written across two steps is found too."""
    answers = [a for a in answers if a and a.strip()]
    text, kept = solution.strip(), ""
    for end in (match.start() for match in _STEP_END.finditer(text)):  # the end of each step but the last
        candidate = text[:end]
        if any(states_answer(candidate, answer) for answer in answers):
            break
        kept = candidate
    return kept


def states_answer(text: str, answer: str) -> bool:
    """Whether `text` states `answer`: a numeric answer as any number of the same magnitude (`45` in `= 45.`,
    `45.0`, `1,776` for 1776, `-6` for 6, `90/2`, `\\frac{3}{4}` for 0.75, `25%` for 0.25; never as part
    of a longer number), any other answer as its own text between word boundaries, spaces and `$` aside."""
    value = _value(answer)
    if value is not None:
        return abs(value) in {abs(v) for v in _numbers(text)}
    wanted = _plain(answer)
    if not wanted:
        return False
    pattern = re.escape(wanted)
    pattern = (r"(?<![A-Za-z0-9])" if wanted[0].isalnum() else "") + pattern
    pattern += r"(?![A-Za-z0-9])" if wanted[-1].isalnum() else ""
    return re.search(pattern, _plain(text)) is not None


def _numbers(text: str) -> set[Fraction]:
    """Every value a text writes as a number or a fraction (a percentage also as its share)."""
    values: set[Fraction] = set()
    for match in _NUMBER.finditer(text):
        value = Fraction(match.group(0).rstrip("%\\ \t\n").replace(",", ""))
        values.add(value)
        if match.group(1):
            values.add(value / 100)
    for top, bottom in _SLASH.findall(text):
        if Fraction(bottom):
            values.add(Fraction(top) / Fraction(bottom))
    for match in _FRAC.finditer(text):
        top, bottom = _value(match.group(1) or match.group(2) or ""), _value(match.group(3) or match.group(4) or "")
        if top is not None and bottom:
            values.add(top / bottom)
    return values


def _value(answer: str) -> Fraction | None:
    """The number an answer is (`45`, `-6`, `1,776`, `0.75`, `3/4`, `\\frac{3}{4}`, `\\boxed{45}`, `$18`,
    `25\\%`, `18 \\text{ dollars}`), or None when it is not one."""
    text = answer.strip()
    while (wrapped := _WRAPPER.match(text)) is not None:
        text = wrapped.group(1).strip()
    text = _DECORATION.sub("", text).replace(" ", "")
    sign = -1 if text.startswith("-") else 1
    text = text.removeprefix("-").removeprefix("+")
    if re.fullmatch(r"\d+(?:,\d{3})*(?:\.\d+)?|\.\d+", text):
        return sign * Fraction(text.replace(",", ""))
    if (slash := re.fullmatch(r"(\d+)/(\d+)", text)) and int(slash.group(2)):
        return sign * Fraction(int(slash.group(1)), int(slash.group(2)))
    frac = _FRAC.fullmatch(text)
    if frac is not None:
        top, bottom = frac.group(1) or frac.group(2), frac.group(3) or frac.group(4)
        if re.fullmatch(r"\d+", top) and re.fullmatch(r"\d+", bottom) and int(bottom):
            return sign * Fraction(int(top), int(bottom))
    return None


def _plain(text: str) -> str:
    """Text compared as written, less its spacing, `$` signs and LaTeX's spelling variants."""
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    return re.sub(r"\s+|\$|\\left|\\right|\\!", "", text)
