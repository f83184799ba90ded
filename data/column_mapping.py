"""Mapping a parsed record's columns to the pipeline's fields: `map_record` picks the prompt, the reference (its
answer extracted from a worked solution: gsm8k, boxed) and the optional fields out of a record that
data/readers.py read, or says in one line why it cannot (the record's quarantine reason); whether a prompt or a
reference makes sense is checked elsewhere (data/validate.py).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlvr.errors import UserError

Extraction = Literal["none", "gsm8k", "boxed"]
EXTRACTIONS: tuple[str, ...] = ("none", "gsm8k", "boxed")
OPTIONAL_FIELDS = ("verifier", "domain", "category", "id", "difficulty_label")
INTEGER_FIELDS = ("id", "difficulty_label")  # integer ids and levels are common; they are kept as text

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


class ColumnMapping(BaseModel):
    """Which column of a user's record holds each field; the defaults fit most problem files."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = "prompt"
    reference: str | None = Field(None, description="None: 'reference' when the record has it, else 'answer'")
    verifier: str | None = "verifier"
    domain: str | None = "domain"
    category: str | None = "category"
    id: str | None = "id"
    difficulty_label: str | None = Field(None, description="a difficulty the source states, e.g. MATH's 'level'")
    solution: str | None = Field(
        "solution",
        description=(
            "a reference solution (GHPO's hints), e.g. MATH's 'solution'; without one, a reference extracted "
            "from a worked text (gsm8k, boxed) keeps that text as the solution"
        ),
    )


def extract_answer(text: str, mode: Extraction) -> str | None:
    """The final answer inside a worked solution: `gsm8k` takes the rest of the line after the last `####`
    (thousands separators dropped), `boxed` the content of the last `\\boxed{...}` or `\\fbox{...}`;
    None when there is none. `none` keeps the text."""
    _check_extraction(mode)
    if mode == "gsm8k":
        _, hashes, rest = text.rpartition("####")
        answer = _THOUSANDS.sub("", rest.lstrip().split("\n", 1)[0].strip())
        return answer if hashes and answer else None
    if mode == "boxed":
        starts = [match.end() for match in _BOXED.finditer(text)]
        return _braced(text, starts[-1]) if starts else None
    return text


def worked_text(text: str, mode: Extraction) -> str | None:
    """The worked solution a reference was extracted from: GSM8K's rationale before its `####` line (the
    answer line itself left out), a boxed solution whole; None when empty."""
    worked = text.rpartition("####")[0] if mode == "gsm8k" else text
    return worked.strip() or None


def _check_extraction(mode: str) -> None:
    if mode not in EXTRACTIONS:
        raise UserError(f"unknown answer extraction '{mode}'; known: {', '.join(EXTRACTIONS)}")


def _braced(text: str, start: int) -> str | None:
    """The stripped text from `start` to the brace that closes the one before it (`\\{` does not count);
    None when it never closes or is empty."""
    depth, pos = 1, start
    while pos < len(text):
        char = text[pos]
        if char == "\\":
            pos += 2
            continue
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return text[start:pos].strip() or None
        pos += 1
    return None


class _Rejected(Exception):
    """A record the mapping cannot use; the message is its quarantine reason."""


def map_record(values: dict[str, Any], mapping: ColumnMapping, extraction: Extraction) -> dict[str, Any] | str:
    """The pipeline's fields of a parsed record, or a one-line reason why the record cannot give them.

    A prompt is a string or a list of chat messages; a reference a string (its answer extracted), a number
    (as text) or an object or list (kept, for structured verifiers). Empty optional fields are left out.
    """
    _check_extraction(extraction)
    try:
        row = {
            "prompt": _prompt(values, mapping.prompt),
            "reference": _reference(values, mapping.reference, extraction),
        }
        for field in OPTIONAL_FIELDS:
            value = _optional(values, getattr(mapping, field), field)
            if value is not None:
                row[field] = value
        solution = _solution(values, mapping, extraction)
        if solution is not None:
            row["solution"] = solution
    except _Rejected as rejected:
        return str(rejected)
    return row


def _type_name(value: Any) -> str:
    return type(value).__name__


def _prompt(values: dict[str, Any], column: str) -> str | list[dict[str, Any]]:
    value = values.get(column)
    if value is None:
        raise _Rejected(f"missing field '{column}'")
    if isinstance(value, str) or _is_chat(value):
        return value
    kind = "a list that is not chat messages" if isinstance(value, list) else _type_name(value)
    raise _Rejected(f"field '{column}' must be a string or a list of {{role, content}} messages, got {kind}")


def _is_chat(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
            for message in value
        )
    )


def _solution(values: dict[str, Any], mapping: ColumnMapping, extraction: Extraction) -> str | None:
    """The record's own solution column, else (with answer extraction) the worked text of its reference."""
    reference_column = mapping.reference or ("reference" if values.get("reference") is not None else "answer")
    if mapping.solution is not None and mapping.solution != reference_column:
        own = _optional(values, mapping.solution, "solution")
        if own is not None:
            return own
    worked = values.get(reference_column)
    return worked_text(worked, extraction) if extraction != "none" and isinstance(worked, str) else None


def _reference(values: dict[str, Any], column: str | None, extraction: Extraction) -> Any:
    if column is None:
        column = "reference" if values.get("reference") is not None else "answer"
        if values.get(column) is None:
            raise _Rejected("missing field 'reference' (looked for 'reference' and 'answer')")
    value = values.get(column)
    if value is None:
        raise _Rejected(f"missing field '{column}'")
    if isinstance(value, str):
        answer = extract_answer(value, extraction)
        if answer is None:
            raise _Rejected(_no_answer(value, column, extraction))
        return answer
    if isinstance(value, int | float | Decimal) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise _Rejected(f"field '{column}' is {value}, not a usable number")
        return str(value)  # a number is an answer already: nothing to extract
    if isinstance(value, dict | list):
        if extraction != "none":
            raise _Rejected(
                f"answer extraction '{extraction}' needs a string in field '{column}', got {_type_name(value)}"
            )
        return value
    raise _Rejected(f"field '{column}' must be a string, a number, an object or a list, got {_type_name(value)}")


def _no_answer(text: str, column: str, extraction: str) -> str:
    if extraction == "gsm8k":
        found = "nothing after the last '####'" if "####" in text else "no '####'"
    else:
        found = "an unclosed or empty \\boxed{...}" if _BOXED.search(text) else "no \\boxed{...}"
    return f"answer extraction '{extraction}' found {found} in field '{column}'"


def _optional(values: dict[str, Any], column: str | None, field: str) -> str | None:
    if column is None:
        return None
    value = values.get(column)
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        return value
    if field in INTEGER_FIELDS and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise _Rejected(f"field '{column}' must be a string, got {_type_name(value)}")
