"""Problem sources: where a run's raw problems come from, chosen by `synthesize.source.type`.

A source turns its config and a seed into problem rows. Procedural generators live beside the
verifier that checks their answers (verifiers/arithmetic.py, verifiers/skills.py), as reasoning-gym pairs each task's
generator with its scorer; this module holds the interface, the registry and the adapters.

A row is a dict with at least `prompt`, `answer` and `source_index` (its position in the source),
plus `category` (the arm a curriculum samples through), `domain` and `params` (the JSON of what made
it). The synthesize stage validates, deduplicates and splits the rows; bad rows are quarantined.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from rlvr.curricula.clpo import Rewrite, Rewriter, RewriteRequest
from rlvr.plugins import TypedRegistry
from rlvr.verifiers import skills
from rlvr.verifiers.arithmetic import GENERATOR_VERSION, ArithmeticSpec, generate


class SourceConfig(BaseModel):
    """Fields every source shares; each source's config subclasses it and adds `type`."""

    model_config = ConfigDict(extra="forbid")


class ProblemSource(ABC):
    """Yields raw problem rows for a seed (the same rows for the same config and seed)."""

    type: ClassVar[str]
    generator_version: ClassVar[str] = "1"

    def __init__(self, cfg: SourceConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    def rows(self, seed: int) -> Iterable[dict[str, Any]]:
        """The raw rows, in a deterministic order."""

    def rewrite(self, prompt: str, answer: str, mode: str) -> tuple[str, str] | None:
        """A procedural rewrite of one of this source's problems (CLPO's rewriter for generator-backed
        domains): mode "simplify" (easier, e.g. a lower difficulty knob) or "diversify" (a new surface at
        the same difficulty), as (prompt, answer); None when the source has no such rewrite."""
        return None


class ArithmeticSourceConfig(SourceConfig, ArithmeticSpec):
    """The built-in arithmetic generator: `digits`-digit operands, `terms` terms, operators from `ops`."""

    type: Literal["arithmetic"] = "arithmetic"


class ArithmeticSource(ProblemSource):
    """Seeded, distinct `a+b=` style problems; one category per (digits, terms).

    Rewrites keep the value: simplify computes one operation ahead (one term fewer: "2+3+4=" -> "5+4=",
    products first), diversify swaps the operands of the first commutative operation ("2+3*4=" ->
    "2+4*3=", or the first two of a sum).
    """

    type = "arithmetic"
    generator_version = GENERATOR_VERSION

    def rewrite(self, prompt: str, answer: str, mode: str) -> tuple[str, str] | None:
        parsed = parse_expression(prompt)
        if parsed is None:
            return None
        operands, operators = parsed
        if mode == "simplify":
            changed = _fold_first_operation(operands, operators)
        elif mode == "diversify":
            changed = _swap_first_commutative(operands, operators)
        else:
            raise ValueError(f"unknown rewrite mode {mode!r}; expected simplify or diversify")
        if changed is None:
            return None
        rewritten = render_expression(*changed)
        return (rewritten, answer) if rewritten != prompt else None

    def rows(self, seed: int) -> Iterable[dict[str, Any]]:
        assert isinstance(self.cfg, ArithmeticSourceConfig)
        spec = ArithmeticSpec(**self.cfg.model_dump(exclude={"type"}))
        params = json.dumps(spec.model_dump(), sort_keys=True)
        category = f"d{spec.digits}t{spec.terms}"
        for row in generate(spec, seed):
            yield {**row, "category": category, "domain": "arithmetic", "params": params}


class SkillsSourceConfig(SourceConfig, skills.SkillsSpec):
    """The skills generator: `categories`, `per_category` problems of each, operands of `digits` digits."""

    type: Literal["skills"] = "skills"


class SkillsSource(ProblemSource):
    """Seeded skills problems (verifiers/skills.py), one category per rule; checked by `arithmetic`.
    Rewrites keep the rule: simplify drops the operand's tens digit, diversify reverses its digits."""

    type = "skills"
    generator_version = skills.GENERATOR_VERSION

    def rows(self, seed: int) -> Iterable[dict[str, Any]]:
        assert isinstance(self.cfg, SkillsSourceConfig)
        return skills.generate(skills.SkillsSpec(**self.cfg.model_dump(exclude={"type"})), seed)

    def rewrite(self, prompt: str, answer: str, mode: str) -> tuple[str, str] | None:
        return skills.rewrite(prompt, mode)


class ProceduralRewriter(Rewriter):
    """CLPO's rewriter for generator-backed domains: the problem source's own `rewrite`."""

    name = "procedural"

    def __init__(self, source: ProblemSource) -> None:
        self.source = source

    def rewrite(self, requests: Sequence[RewriteRequest]) -> list[Rewrite | None]:
        results: list[Rewrite | None] = []
        for request in requests:
            made = self.source.rewrite(request.prompt, request.answer, request.mode)
            results.append(Rewrite(*made) if made is not None else None)
        return results


_TOKEN = re.compile(r"^(-?\d+)((?:[+\-*]\d+)*)=$")


def parse_expression(prompt: str) -> tuple[list[int], list[str]] | None:
    """`"12+3*4="` -> ([12, 3, 4], ["+", "*"]) (a leading minus sign belongs to the first operand)."""
    match = _TOKEN.match(prompt.replace(" ", ""))
    if match is None:
        return None
    rest = re.findall(r"([+\-*])(\d+)", match.group(2))
    return [int(match.group(1))] + [int(value) for _, value in rest], [op for op, _ in rest]


def render_expression(operands: list[int], operators: list[str]) -> str:
    text = str(operands[0])
    for op, value in zip(operators, operands[1:]):
        text += f"{op}{value}"
    return f"{text}="


def _fold_first_operation(operands: list[int], operators: list[str]) -> tuple[list[int], list[str]] | None:
    """One term fewer, same value: the first product if there is one, else the first two operands
    (nothing for a single operation: folding it would print the answer)."""
    if len(operators) < 2:
        return None
    i = operators.index("*") if "*" in operators else 0
    if operators[i] == "*":
        value = operands[i] * operands[i + 1]
    else:
        value = operands[i] + operands[i + 1] if operators[i] == "+" else operands[i] - operands[i + 1]
    if value < 0 and i > 0:
        return None  # "a+-b" is not in the generator's language
    return operands[:i] + [value] + operands[i + 2 :], operators[:i] + operators[i + 1 :]


def _swap_first_commutative(operands: list[int], operators: list[str]) -> tuple[list[int], list[str]] | None:
    """The operands of the first product swapped, or the first two operands of a sum (same value)."""
    for i, op in enumerate(operators):
        binds_right = i + 1 < len(operators) and operators[i + 1] == "*"
        binds_left = i > 0 and operators[i - 1] == "*"
        if op == "*" or (op == "+" and not binds_right and not binds_left and (i == 0 or operators[i - 1] == "+")):
            if operands[i] == operands[i + 1] or (i == 0 and operands[0] < 0):
                continue
            swapped = list(operands)
            swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
            return swapped, list(operators)
    return None


SOURCES: TypedRegistry[ProblemSource] = TypedRegistry(
    "problem source", SourceConfig, ProblemSource, group="rlvr.sources"
)
SOURCES.register(ArithmeticSourceConfig, ArithmeticSource)
SOURCES.register(SkillsSourceConfig, SkillsSource)
SOURCES.default = "skills"  # the demo's task: a section without `type` is the skills generator
