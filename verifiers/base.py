"""The verifier contract (docs/verifiers.md "Add a verifier", docs/architecture.md): a verifier scores one response
against one reference.

A verifier never raises for bad input and never returns a silent zero: every outcome is a `Score`
whose `status` says what happened (ok, wrong, unparseable, timeout, error).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

__all__ = [
    "MISSING_REFERENCE",
    "STATUSES",
    "Score",
    "Verifier",
    "is_missing",
    "non_text_error",
    "one_line",
    "self_check_error",
]

Status = Literal["ok", "wrong", "unparseable", "timeout", "error"]
STATUSES: tuple[str, ...] = ("ok", "wrong", "unparseable", "timeout", "error")
MISSING_REFERENCE = "missing reference"
REASON_CHARS = 300  # a reference problem is one line, short enough for a quarantine row


@dataclass(frozen=True)
class Score:
    """One verdict. `value` is the reward; `components` keeps partial-credit parts separately."""

    value: float
    status: Status
    components: dict[str, float] = field(default_factory=dict)
    extracted: str | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown score status {self.status!r}; expected one of {STATUSES}")


class Verifier(ABC):
    """Base class of every verifier. Subclasses set the class attributes and implement `score`.

    `rewrite_templates` (optional): the prompts CLPO's policy rewriter uses for this domain, by mode
    ("simplify", "diversify"), with `{question}` and `{answer}` fields; they say what a rewrite must
    keep in this domain (the answer, a schema, function signatures).
    """

    name: ClassVar[str]
    domain: ClassVar[str]
    version: ClassVar[str]
    rewrite_templates: ClassVar[Mapping[str, str]] = {}
    # What the run gives it besides (response, reference): nothing, or a model endpoint (the judge: the label
    # stage asks it, with the question, and its failed verdicts are left out of the update, never trained on as 0).
    needs: ClassVar[Literal["nothing", "endpoint"]] = "nothing"

    @abstractmethod
    def score(self, response: str, reference: Any) -> Score:
        """Score `response` against `reference`; never raise for bad input."""

    def reference_error(self, reference: Any) -> str | None:
        """Why `reference` can never be rewarded by this verifier (one line), or None when it is usable.

        The data stage quarantines a problem on this before any rollout is spent on it. By default the
        reference's own text is scored as the response: a reference that does not earn `ok` against
        itself cannot reward anything. Verifiers whose responses look different from their references,
        or whose scoring is expensive, override this with a parse of the reference. Never raises.
        """
        if is_missing(reference):
            return MISSING_REFERENCE
        try:
            response = reference if isinstance(reference, str) else json.dumps(reference)
        except (TypeError, ValueError, RecursionError) as exc:
            return one_line(f"reference is not JSON-serialisable: {exc}")
        return self_check_error(self, response, reference)


def non_text_error(response: Any) -> Score | None:
    """The `error` verdict every verifier gives a response that is not a string, else None."""
    if isinstance(response, str):
        return None
    return Score(0.0, "error", reason=f"response must be a string, got {type(response).__name__}")


def is_missing(reference: Any) -> bool:
    """A reference that holds nothing: None or a blank string."""
    return reference is None or (isinstance(reference, str) and not reference.strip())


def one_line(reason: str) -> str:
    """`reason` with its whitespace collapsed and cut to `REASON_CHARS`."""
    return " ".join(reason.split())[:REASON_CHARS]


def self_check_error(verifier: Verifier, response: str, reference: Any) -> str | None:
    """None when `verifier` scores `response` (the reference rendered as an answer) ok, else why not.

    An `error` verdict's reason is passed on as it is: with a well-formed response it names what is
    wrong with the reference (no database, a bad option)."""
    try:
        score = verifier.score(response, reference)
    except Exception as exc:
        return one_line(f"scoring the reference against itself raised {type(exc).__name__}: {exc}")
    if score.status == "ok":
        return None
    if score.status == "error" and score.reason:
        return one_line(score.reason)
    return one_line(f"the reference does not verify against itself ({score.status}: {score.reason})")
