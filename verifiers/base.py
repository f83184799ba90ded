"""The verifier contract (README "Add a verifier", docs/architecture.md): a verifier scores one response
against one reference.

A verifier never raises for bad input and never returns a silent zero: every outcome is a `Score`
whose `status` says what happened (ok, wrong, unparseable, timeout, error).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

Status = Literal["ok", "wrong", "unparseable", "timeout", "error"]
STATUSES: tuple[str, ...] = ("ok", "wrong", "unparseable", "timeout", "error")


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

    @abstractmethod
    def score(self, response: str, reference: Any) -> Score:
        """Score `response` against `reference`; never raise for bad input."""


def non_text_error(response: Any) -> Score | None:
    """The `error` verdict every verifier gives a response that is not a string, else None."""
    if isinstance(response, str):
        return None
    return Score(0.0, "error", reason=f"response must be a string, got {type(response).__name__}")
