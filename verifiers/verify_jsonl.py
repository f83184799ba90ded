"""`rlvr verify`: score a JSONL file of {"response": ..., "reference": ...} lines through the pool.

One output dict per input line, in input order, numbered from 1. A line that is not a JSON object
with a string "response" and a non-null "reference" gets status "error" and a reason; it never stops
the run. Lines are read and scored in chunks, so a large file streams in bounded memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

from rlvr.verifiers.base import Score
from rlvr.verifiers.pool import VerifierPool

CHUNK_LINES = 512


def parse_line(line: str) -> tuple[str, Any] | str:
    """(response, reference) from one input line, or the reason it cannot be scored."""
    if not line.strip():
        return "empty line"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"not valid JSON: {exc.msg} at column {exc.colno}"
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    missing = [key for key in ("response", "reference") if key not in record]
    if missing:
        return f"missing key(s): {', '.join(missing)}"
    if not isinstance(record["response"], str):
        return f"'response' must be a string, got {type(record['response']).__name__}"
    if record["reference"] is None:
        return "'reference' is null"
    return record["response"], record["reference"]


def result_row(line_number: int, score: Score) -> dict:
    return {
        "line": line_number,
        "score": float(score.value),
        "status": score.status,
        "extracted": score.extracted,
        "reason": score.reason,
        "components": dict(score.components),
    }


def verify_lines(
    verifier_name: str,
    lines: Iterable[str],
    *,
    workers: int = 2,
    timeout_s: float = 5.0,
) -> Iterator[dict]:
    """Score each line; yields {"line", "score", "status", "extracted", "reason", "components"}."""
    numbered = enumerate(lines, start=1)
    with VerifierPool(verifier_name, workers=workers, timeout_s=timeout_s) as pool:
        while True:
            chunk = list(islice(numbered, CHUNK_LINES))
            if not chunk:
                return
            parsed = [(number, parse_line(line)) for number, line in chunk]
            scorable = [(number, item) for number, item in parsed if isinstance(item, tuple)]
            scores = iter(pool.score_many([item for _, item in scorable]))
            for number, item in parsed:
                if isinstance(item, tuple):
                    yield result_row(number, next(scores))
                else:
                    yield result_row(number, Score(0.0, "error", reason=f"malformed input line: {item}"))
