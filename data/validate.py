"""Validation of raw problem rows: each becomes a `Candidate` or a `Rejected` row with its reason.

The checks, in order (the first that fails is the row's `failed_check` in `quarantine`):
  read       the record could not be read (a malformed line, a broken CSV quote, non-UTF-8 bytes)
  fields     a field the column mapping needs is missing or of the wrong type
  prompt     missing, of the wrong type, empty, over `max_prompt_chars`, not valid UTF-8, or holding a control
             character other than tab, newline and carriage return (NUL, ESC, DEL, ...)
  reference  missing, of the wrong type, not valid UTF-8, or holding such a control character
  verifier   names no registered verifier
  id         repeats the `id` of an earlier row of the same source
  parse      the problem's verifier cannot use the reference (`Verifier.reference_error`)
  solution   a reference solution (optional) that is not text, or holds such a control character
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rlvr.storage.ids import canonical_json
from rlvr.verifiers.base import Verifier
from rlvr.verifiers.registry import get_verifier, registered

RAW_CHARS = 2000  # how much of a rejected row's text the quarantine keeps


@dataclass(frozen=True)
class Candidate:
    """An accepted row, in the problem schema's terms (prompt and reference as text)."""

    source: str
    source_index: int
    prompt: str
    reference: str
    answer: str
    verifier: str
    domain: str
    category: str
    params: str
    difficulty_label: str | None
    solution: str | None = None


@dataclass(frozen=True)
class Rejected:
    source: str
    source_index: int
    check: str
    reason: str
    row_json: str


def as_text(value: Any) -> str:
    """A prompt or reference as stored: strings as they are, anything else as canonical JSON."""
    return value if isinstance(value, str) else canonical_json(value)


_CONTROLS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")  # Unicode category Cc, less tab and line ends


def _text_error(text: str) -> str | None:
    """Why `text` cannot be stored and shown safely: not UTF-8, or a control character (a NUL cuts C strings
    short in tokenizers and terminals, an ESC rewrites the terminal that prints it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"is not valid UTF-8 (character {exc.start})"
    found = _CONTROLS.search(text)
    if found is not None:
        return f"contains control character U+{ord(found.group()):04X} at character {found.start()}"
    return None


def _prompt_problem(prompt: Any, max_chars: int) -> str | None:
    if prompt is None:
        return "missing prompt"
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(m, Mapping) and isinstance(m.get("content"), str) for m in prompt):
            return "a chat prompt must be a non-empty list of {role, content} messages"
        prompt = " ".join(m["content"] for m in prompt)
    if not isinstance(prompt, str):
        return f"prompt must be text or chat messages, got {type(prompt).__name__}"
    if not prompt.strip():
        return "empty prompt"
    if len(prompt) > max_chars:
        return f"prompt is {len(prompt)} characters; the limit (synthesize.max_prompt_chars) is {max_chars}"
    error = _text_error(prompt)
    return f"prompt {error}" if error else None


def _reference_problem(reference: Any) -> str | None:
    if reference is None or (isinstance(reference, str) and not reference.strip()):
        return "missing reference"
    if not isinstance(reference, str | int | float | dict | list) or isinstance(reference, bool):
        return f"reference must be text, a number or JSON, got {type(reference).__name__}"
    error = _text_error(as_text(reference))
    return f"reference {error}" if error else None


class Validator:
    """Checks rows of one source; remembers the ids it has seen and one verifier instance per name."""

    def __init__(self, source: str, default_verifier: str, max_prompt_chars: int) -> None:
        self.source = source
        self.default_verifier = default_verifier
        self.max_prompt_chars = max_prompt_chars
        self.known = set(registered())
        self.verifiers: dict[str, Verifier] = {}
        self.ids: dict[str, int] = {}

    def check(self, row: Mapping[str, Any]) -> Candidate | Rejected:
        index = int(row.get("source_index", -1))
        failed = self._first_failure(row, index)
        if failed is not None:
            check, reason = failed
            return Rejected(self.source, index, check, reason, _row_json(row))
        reference = row.get("reference", row.get("answer"))
        answer = row.get("answer", reference)
        return Candidate(
            source=self.source,
            source_index=index,
            prompt=as_text(row["prompt"]),
            reference=as_text(reference),
            answer=answer if isinstance(answer, str) else as_text(answer),
            verifier=row.get("verifier") or self.default_verifier,
            domain=str(row.get("domain") or ""),
            category=str(row.get("category") or ""),
            params=str(row.get("params") or ""),
            difficulty_label=row.get("difficulty_label"),
            solution=row.get("solution") or None,
        )

    def _first_failure(self, row: Mapping[str, Any], index: int) -> tuple[str, str] | None:
        if row.get("error") is not None:
            return str(row.get("error_check", "read")), str(row["error"])
        if (problem := _prompt_problem(row.get("prompt"), self.max_prompt_chars)) is not None:
            return "prompt", problem
        reference = row.get("reference", row.get("answer"))
        if (problem := _reference_problem(reference)) is not None:
            return "reference", problem
        name = row.get("verifier") or self.default_verifier
        if name not in self.known:
            return "verifier", f"unknown verifier {name!r}; registered: {', '.join(sorted(self.known))}"
        user_id = row.get("id")
        if user_id is not None:
            if str(user_id) in self.ids:
                return "id", f"duplicate id {user_id!r} (first at record {self.ids[str(user_id)]})"
            self.ids[str(user_id)] = index
        if name not in self.verifiers:
            self.verifiers[name] = get_verifier(name)
        error = self.verifiers[name].reference_error(reference)
        if error:
            return "parse", f"{name}: {error}"
        return _solution_problem(row.get("solution"))


def _solution_problem(solution: Any) -> tuple[str, str] | None:
    if solution is None:
        return None
    if not isinstance(solution, str):
        return "solution", f"solution must be text, got {type(solution).__name__}"
    error = _text_error(solution)
    return ("solution", f"solution {error}") if error else None


def _row_json(row: Mapping[str, Any]) -> str:
    """The rejected row as JSON for the quarantine (long values cut; undecodable text escaped)."""
    shown = {k: (v[:RAW_CHARS] if isinstance(v, str) else v) for k, v in row.items()}
    text = json.dumps(shown, default=str, ensure_ascii=True)
    return text if len(text) <= 4 * RAW_CHARS else text[: 4 * RAW_CHARS]


def validate(
    rows: Iterable[Mapping[str, Any]], source: str, default_verifier: str, max_prompt_chars: int
) -> tuple[list[Candidate], list[Rejected], int]:
    """(accepted, rejected, rows read) for one source's rows."""
    validator = Validator(source, default_verifier, max_prompt_chars)
    accepted: list[Candidate] = []
    rejected: list[Rejected] = []
    count = 0
    for row in rows:
        count += 1
        result = validator.check(row)
        if isinstance(result, Candidate):
            accepted.append(result)
        else:
            rejected.append(result)
    return accepted, rejected, count
