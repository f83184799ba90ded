"""The pool a strategy selects from: the problems of some splits, each with its arm and difficulty."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rlvr.curricula.base import PoolProblem

UNBINNED = "unbinned"  # the bin of a problem the difficulty stage did not estimate


def arm_of(category: str, difficulty_bin: int | None, arms: str) -> str:
    """The arm a problem is sampled through: its category, its difficulty bin, or both (SEC's 2-D arms)."""
    bin_name = f"bin{difficulty_bin}" if difficulty_bin is not None else UNBINNED
    if arms == "category":
        return category
    if arms == "bin":
        return bin_name
    if arms == "category_bin":
        return f"{category}/{bin_name}"
    raise ValueError(f"unknown arms {arms!r}; expected category, bin or category_bin")


def build_pool(
    problems: Iterable[Mapping[str, Any]], difficulty: Iterable[Mapping[str, Any]], splits: Sequence[str], arms: str
) -> list[PoolProblem]:
    """The problems of `splits`, sorted by id, each with its arm and the difficulty stage's pass rate.

    `problems` rows need problem_id, split, category and domain; `difficulty` rows problem_id, bin and
    pass_rate.
    """
    stats = {row["problem_id"]: row for row in difficulty}
    pool = []
    for row in problems:
        if row["split"] not in splits:
            continue
        stat = stats.get(row["problem_id"])
        pool.append(
            PoolProblem(
                problem_id=row["problem_id"],
                arm=arm_of(row["category"] or "", stat["bin"] if stat else None, arms),
                domain=row["domain"] or "",
                category=row["category"] or "",
                p_hat=stat["pass_rate"] if stat else None,
            )
        )
    pool.sort(key=lambda p: p.problem_id)
    return pool
