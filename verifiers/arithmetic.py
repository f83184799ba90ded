"""Exact-answer verifier for the built-in arithmetic generator: the whole answer, compared as a number.

The response is what the policy wrote after the prompt (cut at end-of-sequence by the rollout engine).
It must be a plain number (optional sign, digits, optional decimal part); anything else is
`unparseable`, a different number is `wrong`. Numbers are compared exactly with `Fraction`, so
"12", "12.0" and "+12" all equal 12 and no tolerance can let a near miss through. This is the
math verifier (`verifiers/math.py`) with strict extraction; the generator sits beside it.

Version: "<own version>+math.<math version>", as composites write theirs (verifiers/composite.py):
the comparison is the math verifier's, so a new math version must invalidate cached arithmetic
verdicts too, even when this file does not change.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from fractions import Fraction
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlvr.verifiers.base import MISSING_REFERENCE, Score, is_missing
from rlvr.verifiers.math import MathVerifier

_NUMBER = re.compile(r"[+-]?\d+(\.\d+)?")


def parse_number(text: str) -> Fraction | None:
    """The exact value of `text` if it is one plain number, else None."""
    text = text.strip()
    if not _NUMBER.fullmatch(text):
        return None
    return Fraction(text)


class ArithmeticVerifier(MathVerifier):
    """The math verifier with strict extraction: the whole response must be the number.

    The math verifier would find "12" in "5+7 is 12"; for the arithmetic domain, where the
    completion is the answer and nothing else, anything but a plain number is `unparseable`.
    The comparison itself is the math verifier's (exact, no tolerance).
    """

    name = "arithmetic"
    domain = "arithmetic"
    version = f"3+math.{MathVerifier.version}"

    def score(self, response: str, reference: Any) -> Score:
        expected = parse_number(str(reference))
        if expected is None:
            return Score(0.0, "error", {"correct": 0.0}, reason=f"reference {str(reference)[:40]!r} is not a number")
        got = parse_number(response) if isinstance(response, str) else None
        if got is None:
            return Score(0.0, "unparseable", {"correct": 0.0}, reason="response is not a plain number")
        return super().score(str(got), str(expected))

    def reference_error(self, reference: Any) -> str | None:
        """A plain number is always rewardable (by itself), so parsing it is the whole check; it must be
        cheap, as the data stage checks every generated problem."""
        if is_missing(reference):
            return MISSING_REFERENCE
        if parse_number(str(reference)) is None:
            return f"reference {str(reference)[:40]!r} is not a plain number"
        return None


_LAST_NUMBER = re.compile(r"(?<![\d.])[+-]?\d+(?:\.\d+)?(?![\d.]*\d)")


def final_number(text: str) -> str | None:
    """The last number `text` writes ("34 + 6 = 40." -> "40"; "-5" keeps its sign), thousands separators
    dropped; None when it writes none. A sign counts only when it is the number's own ("7 - 12" -> "12")."""
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    matches = list(_LAST_NUMBER.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    signed = last.group()[0] in "+-"
    binary = signed and last.start() > 0 and text[last.start() - 1].isdigit()  # "91-39": a minus, not a sign
    return last.group()[1:] if signed and (binary or last.group()[0] == "+") else last.group()


class FinalNumberVerifier(ArithmeticVerifier):
    """The arithmetic check for a model that answers in words: the response's last number must equal the
    reference exactly. Unlike `math`, which evaluates an expression it finds, an answer that only repeats
    the question ("91 - 39") is wrong, since its last number is 39: a policy cannot earn the reward by echoing
    the prompt, which is what a chat model trained against `math` on "What is 91 - 39?" learned to do."""

    name = "final_number"
    domain = "arithmetic"
    version = f"1+math.{MathVerifier.version}"

    def score(self, response: str, reference: Any) -> Score:
        found = final_number(response) if isinstance(response, str) else None
        if found is None:
            expected = parse_number(str(reference))
            if expected is None:
                return super().score("", reference)  # the reference's own error
            return Score(0.0, "unparseable", {"correct": 0.0}, reason="response writes no number")
        return super().score(found, reference)


# --- the generator that goes with this verifier ----------------------------------------------


class ArithmeticSpec(BaseModel):
    """Difficulty knobs of the procedural generator: operand digits, number of terms, operators."""

    model_config = ConfigDict(extra="forbid")

    digits: int = Field(1, ge=1, le=6)
    terms: int = Field(2, ge=2, le=6)
    ops: str = Field("+", pattern=r"^[+\-*]+$")
    count: int = Field(100, ge=1)
    operand_digits: list[int] | None = Field(
        None,
        exclude_if=lambda value: value is None,  # left out of dumps (so of params and ids) when unset
        description="exact digits of each operand, e.g. [3, 2] for 3-digit by 2-digit (overrides digits)",
    )

    @model_validator(mode="after")
    def _one_width_a_term(self) -> ArithmeticSpec:
        widths = self.operand_digits
        if widths is not None and (len(widths) != self.terms or not all(1 <= d <= 6 for d in widths)):
            raise ValueError(f"operand_digits needs one width in 1..6 for each of the {self.terms} terms, got {widths}")
        return self

    def operand_ranges(self) -> list[range]:
        """Each operand's values: 0 to 10**digits - 1, or exactly `operand_digits[i]` digits when set."""
        if self.operand_digits is None:
            return [range(10**self.digits)] * self.terms
        return [range(10 ** (d - 1) if d > 1 else 0, 10**d) for d in self.operand_digits]


GENERATOR_VERSION = "2"  # 2: rows carry a worked solution


def space_size(spec: ArithmeticSpec) -> int:
    """How many distinct problems the spec can produce."""
    return math.prod(len(values) for values in spec.operand_ranges()) * len(set(spec.ops)) ** (spec.terms - 1)


def _render(operands: list[int], operators: list[str]) -> str:
    text = str(operands[0])
    for op, value in zip(operators, operands[1:]):
        text += f"{op}{value}"
    return text


def generate(spec: ArithmeticSpec, seed: int) -> list[dict[str, Any]]:
    """Distinct problems `{"prompt": "3+4=", "answer": "7", "solution": "3 + 4 = 7. The answer is 7.",
    "source_index": i}`, seeded.

    When the spec's space is no larger than `count`, every problem is produced once, in a seeded
    order; otherwise distinct problems are drawn at random until `count` are found.
    """
    rng = random.Random(seed)
    ops = sorted(set(spec.ops))
    ranges = spec.operand_ranges()
    size = space_size(spec)
    if size <= spec.count:
        combos = [
            (list(operands), list(operators))
            for operands in itertools.product(*ranges)
            for operators in itertools.product(ops, repeat=spec.terms - 1)
        ]
        rng.shuffle(combos)
    else:
        seen: set[str] = set()
        combos = []
        while len(combos) < spec.count:
            operands = [rng.randrange(values.start, values.stop) for values in ranges]
            operators = [rng.choice(ops) for _ in range(spec.terms - 1)]
            expression = _render(operands, operators)
            if expression not in seen:
                seen.add(expression)
                combos.append((operands, operators))
    problems = []
    for index, (operands, operators) in enumerate(combos):
        expression = _render(operands, operators)
        answer = _evaluate(operands, operators)
        solution = worked_solution(operands, operators)
        problems.append(
            {"prompt": f"{expression}=", "answer": str(answer), "solution": solution, "source_index": index}
        )
    return problems


def worked_solution(operands: list[int], operators: list[str]) -> str:
    """The steps a person would write, ending with the answer: products first, then sums and differences left
    to right; a multi-digit right operand is split into its tens and the rest, so a hint that shows part of
    the steps shows a usable partial result."""
    steps, terms, signs = [], [operands[0]], []
    for op, value in zip(operators, operands[1:]):
        if op == "*":
            steps.append(_step(terms[-1], "*", value))
            terms[-1] *= value
        else:
            terms.append(value)
            signs.append(op)
    total = terms[0]
    for op, value in zip(signs, terms[1:]):
        steps.append(_step(total, op, value))
        total = total + value if op == "+" else total - value
    return " ".join([*steps, f"The answer is {total}."])


def _step(left: int, op: str, right: int) -> str:
    """One operation written out: "37 * 48 = 37 * 40 + 37 * 8 = 1480 + 296 = 1776." """
    apply = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}[op]
    result = apply(left, right)
    tens, units = right - right % 10, right % 10
    if right < 10 or units == 0:
        return f"{left} {op} {right} = {result}."
    if op == "*":
        return f"{left} * {right} = {left} * {tens} + {left} * {units} = {left * tens} + {left * units} = {result}."
    return f"{left} {op} {right} = {left} {op} {tens} {op} {units} = {apply(left, tens)} {op} {units} = {result}."


def _evaluate(operands: list[int], operators: list[str]) -> int:
    """Value with * binding tighter than + and -, left to right otherwise."""
    terms: list[int] = [operands[0]]
    signs: list[int] = [1]
    for op, value in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value)
            signs.append(1 if op == "+" else -1)
    return sum(sign * term for sign, term in zip(signs, terms))
