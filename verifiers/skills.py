"""Procedural "skills": categories of short problems with exact whole-number answers, written only with
the tiny model's characters (digits, + - * =) and checked by the `arithmetic` verifier.

Each category is one rule applied to a number n of up to `digits` digits (or to two single digits), so
a category's problems share the rule and differ in the numbers: what the policy learns on some of them
can carry over to unseen ones. The categories differ in how hard the rule is for a small model, which is
what a curriculum can exploit. With the defaults (n < 100) and the 124k-parameter tiny model
(benchmarks/demo_study.py):

- zero     `n*0=` -> 0: a constant answer; right after any warm start.
- copy     `n*1=` -> n: copy the operand; learnt early in RL.
- tens     `n*10=` -> n0: copy and append a 0 (answers up to 3 digits).
- plus10   `n+10=` -> n+10 (n <= 89), minus10 `n-10=` -> n-10 (n >= 10): copy the units digit, step the
  tens digit.
- succ     `n+1=` -> n+1 (n <= 98), pred `n-1=` -> n-1 (n >= 1): step the units digit, with a carry
  or borrow one time in ten; the hardest rules that still carry over to unseen operands.
- add      `a+b=` for single digits: a 100-entry table; RL fits its training pairs, but little carries
  over to unseen pairs (the "too hard" arm).
- also available: double `n+n=`, self_sub `n-n=`, sub `a-b=` (a >= b) and mul `a*b=` for single digits.

Answers are canonical numbers (no sign, no leading zero), so the verifier's exact numeric comparison is
an exact string comparison for every reference written here. A prompt that two categories share (3+1=
is both succ and add) belongs to the category listed first.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

GENERATOR_VERSION = "1"


def _numbers(low: int, high: int) -> range:
    return range(low, high + 1)


# Each category: every (prompt, answer) for operands of at most `digits` digits, in a fixed order.
def _zero(digits: int) -> Iterable[tuple[str, int]]:
    return ((f"{n}*0=", 0) for n in _numbers(0, 10**digits - 1))


def _copy(digits: int) -> Iterable[tuple[str, int]]:
    return ((f"{n}*1=", n) for n in _numbers(0, 10**digits - 1))


def _tens(digits: int) -> Iterable[tuple[str, int]]:
    return ((f"{n}*10=", n * 10) for n in _numbers(1, 10**digits - 1))


def _plus10(digits: int) -> Iterable[tuple[str, int]]:
    return ((f"{n}+10=", n + 10) for n in _numbers(0, 10**digits - 11))


def _minus10(digits: int) -> Iterable[tuple[str, int]]:
    return ((f"{n}-10=", n - 10) for n in _numbers(10, 10**digits - 1))


def _succ(digits: int) -> Iterable[tuple[str, int]]:
    return ((f"{n}+1=", n + 1) for n in _numbers(0, 10**digits - 2))


def _pred(digits: int) -> Iterable[tuple[str, int]]:
    return ((f"{n}-1=", n - 1) for n in _numbers(1, 10**digits - 1))


def _double(digits: int) -> Iterable[tuple[str, int]]:
    return ((f"{n}+{n}=", 2 * n) for n in _numbers(0, (10**digits - 1) // 2))


def _self_sub(digits: int) -> Iterable[tuple[str, int]]:
    return ((f"{n}-{n}=", 0) for n in _numbers(0, 10**digits - 1))


def _add(digits: int) -> Iterable[tuple[str, int]]:
    return ((f"{a}+{b}=", a + b) for a in range(10) for b in range(10))


def _sub(digits: int) -> Iterable[tuple[str, int]]:
    return ((f"{a}-{b}=", a - b) for a in range(10) for b in range(a + 1))


def _mul(digits: int) -> Iterable[tuple[str, int]]:
    return ((f"{a}*{b}=", a * b) for a in range(10) for b in range(10))


CATEGORIES: dict[str, Callable[[int], Iterable[tuple[str, int]]]] = {
    "zero": _zero,
    "copy": _copy,
    "tens": _tens,
    "plus10": _plus10,
    "minus10": _minus10,
    "succ": _succ,
    "pred": _pred,
    "add": _add,
    "double": _double,
    "self_sub": _self_sub,
    "sub": _sub,
    "mul": _mul,
}

DEFAULT_CATEGORIES = ["zero", "copy", "tens", "plus10", "minus10", "succ", "pred", "add"]


class SkillsSpec(BaseModel):
    """Which categories, how many problems of each (at most what the category has), operand digits."""

    model_config = ConfigDict(extra="forbid")

    categories: list[str] = Field(default_factory=lambda: list(DEFAULT_CATEGORIES), min_length=1)
    per_category: int = Field(100, ge=1)
    digits: int = Field(2, ge=1, le=3)

    @field_validator("categories")
    @classmethod
    def _known(cls, value: list[str]) -> list[str]:
        unknown = [c for c in value if c not in CATEGORIES]
        if unknown:
            raise ValueError(f"unknown categories {unknown}; known: {', '.join(CATEGORIES)}")
        if len(set(value)) != len(value):
            raise ValueError(f"categories repeat: {value}")
        return value


def category_space(category: str, digits: int) -> list[tuple[str, str]]:
    """Every (prompt, answer) of a category, in a fixed order."""
    return [(prompt, str(answer)) for prompt, answer in CATEGORIES[category](digits)]


def generate(spec: SkillsSpec, seed: int) -> list[dict[str, Any]]:
    """Rows `{"prompt", "answer", "source_index", "category", "domain", "params"}`, seeded.

    Per category, `per_category` distinct problems drawn without replacement (all of them, shuffled,
    when the category has fewer); categories are interleaved round-robin so any prefix is balanced.
    Each category draws from its own seeded stream, so adding a category leaves the others' draws alone.
    """
    params = json.dumps(spec.model_dump(), sort_keys=True)
    drawn: list[list[tuple[str, str, str]]] = []
    taken: set[str] = set()
    for category in spec.categories:
        space = [(prompt, answer) for prompt, answer in category_space(category, spec.digits) if prompt not in taken]
        taken.update(prompt for prompt, _ in space)
        rng = random.Random(f"{seed}/{category}")
        picked = rng.sample(space, min(spec.per_category, len(space)))
        drawn.append([(category, prompt, answer) for prompt, answer in picked])
    rows: list[dict[str, Any]] = []
    for position in range(max(len(d) for d in drawn)):
        for items in drawn:
            if position < len(items):
                category, prompt, answer = items[position]
                rows.append(
                    {
                        "prompt": prompt,
                        "answer": answer,
                        "source_index": len(rows),
                        "category": category,
                        "domain": "arithmetic",
                        "params": params,
                    }
                )
    return rows


_EXPRESSION = re.compile(r"^(\d+)([+\-*])(\d+)=$")


def rewrite(prompt: str, mode: str) -> tuple[str, str] | None:
    """A procedural rewrite of a skills problem (CLPO), as (prompt, answer), or None when there is none.

    "simplify" keeps the rule and drops the operand's tens digit (`57+1=` -> `7+1=`); "diversify" keeps
    the rule and the size of the numbers and changes the surface: the operand's digits reversed
    (`57+1=` -> `75+1=`), or the two operands of a single-digit sum or product swapped (`3+5=` -> `5+3=`).
    A rewrite that would leave the category's range (a negative answer, a leading zero) is None.
    """
    match = _EXPRESSION.match(prompt)
    if match is None:
        return None
    left, op, right = int(match.group(1)), match.group(2), int(match.group(3))
    if mode == "simplify":
        changed = (left % 10, right) if left >= 10 and left != right else None
    elif mode == "diversify":
        if left >= 10 and left != right:
            reversed_left = str(left)[::-1]
            changed = (int(reversed_left), right) if not reversed_left.startswith("0") else None
        else:
            changed = (right, left) if op in "+*" and left < 10 and right < 10 else None
    else:
        raise ValueError(f"unknown rewrite mode {mode!r}; expected simplify or diversify")
    if changed is None:
        return None
    a, b = changed
    value = a + b if op == "+" else a - b if op == "-" else a * b
    rewritten = f"{a}{op}{b}="
    return (rewritten, str(value)) if value >= 0 and rewritten != prompt else None
