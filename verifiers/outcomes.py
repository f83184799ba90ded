"""What a `rewards` row says about solving, in one place (docs/rewards.md "What a verdict means").

Every stage that reads correctness or a group's learning signal reads it here: dynamic sampling and RLPR's std
filter, GHPO's hints, CLPO's accuracies, Knapsack's outcome buffers, the difficulty stage's pass rates and
evaluation. The rules, for every reward source:

- `error`: there is no verdict (a model's call failed, an environment crashed or hung, a reward that was not a
  finite number). Such a row has no outcome at all: it is never trained on and never counted as unsolved.
- solved means status `ok`, for every source that decides solving: the verifiers, the judge, reward models (a
  reward at their `threshold` or more), environments (their own verdict, or their reward at `env.solved_at` or
  more).
- graded sources decide no solving (RLPR: its `ok` says an answer was found, and its reward is a probability):
  their outcome is the reward itself, so a group's signal is its rewards' spread.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rlvr.errors import UserError

__all__ = [
    "DEFAULT_MAX_ERROR_RATE",
    "GRADED_VERIFIERS",
    "OUTCOME_SQL",
    "check_error_share",
    "is_error",
    "outcome",
    "solved",
]

DEFAULT_MAX_ERROR_RATE = 0.1  # reward.max_error_rate's default (verifiers/model_rewards.py RewardConfig)

GRADED_VERIFIERS = frozenset({"rlpr"})

# `outcome` as a DuckDB expression over a rewards table's columns, for queries over a run's history (Knapsack's
# buffers rebuilt after a resume); tests/test_outcomes.py checks it agrees with `outcome` row for row.
OUTCOME_SQL = (
    "CASE WHEN status = 'error' THEN NULL "
    f"WHEN verifier IN ({', '.join(repr(v) for v in sorted(GRADED_VERIFIERS))}) THEN score "
    "WHEN status = 'ok' THEN 1.0 ELSE 0.0 END"
)


def is_error(status: str) -> bool:
    """Whether a row holds no verdict at all (left out of the update, counted in `reward_errors`)."""
    return status == "error"


def solved(verifier: str, status: str) -> bool | None:
    """Whether the row's answer solved its problem; None where that is not known: an error row, or a graded
    source's (RLPR)."""
    if is_error(status) or verifier in GRADED_VERIFIERS:
        return None
    return status == "ok"


def outcome(verifier: str, status: str, score: float) -> float | None:
    """The row's outcome, what a group's signal and a problem's success rate are measured on: 1.0 solved, 0.0 not,
    a graded source's reward as it is, None for an error row (no outcome)."""
    if is_error(status):
        return None
    if verifier in GRADED_VERIFIERS:
        return score if math.isfinite(score) else None
    return 1.0 if status == "ok" else 0.0


def check_error_share(rows: Sequence[Mapping[str, Any]], what: str, max_error_rate: float) -> None:
    """Stop the run in one line when the share of `rows` (rewards columns: status, verifier, reason) with no verdict
    passes `reward.max_error_rate`: such rows are left out of the update and of every count, and past the threshold
    too little is left to learn or measure from. `what` names the rows ("rewards of step 3")."""
    failed = [r for r in rows if is_error(r["status"])]
    if not rows or len(failed) / len(rows) <= max_error_rate:
        return
    first = failed[0]
    raise UserError(
        f"{len(failed)} of {len(rows)} {what} have no verdict (status error; more than reward.max_error_rate "
        f"{max_error_rate:g}); first, from {first['verifier']}: {first['reason']}"
    )
