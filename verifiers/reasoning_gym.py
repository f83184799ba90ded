"""reasoning-gym verifier: one adapter that scores every reasoning-gym generator with that generator's own
`score_answer(answer, entry)`, plus `rg_problems`, which draws problems from a generator.

Reference: `{"dataset": NAME, "entry": ENTRY}` (a dict or its JSON string), where ENTRY is the item the
generator produced (question, answer, metadata) as stored, i.e. after a JSON round trip. For entries of
reasoning-gym's own "composite" dataset the scorer of `entry["metadata"]["source_dataset"]` is used.

Answer extraction: the content of the last <answer>...</answer> tag if there is one, else the last
non-empty line of the response.

Decision on partial credit: reasoning-gym's default scorer (and several others) gives partial credit,
e.g. len(answer) / len(response answer) when the true answer is a substring of a longer one, so
"the answer is 42, or maybe 17" earns part of the reward for 42. We keep the dataset's score as the
component `rg_score`, but the reward is binary: value 1.0 and status ok only when rg_score == 1.0,
otherwise value 0.0 and status wrong. A policy cannot collect reward by hedging or padding.

Statuses: unparseable when no answer can be extracted (empty response or empty <answer> tag); error for
a bad reference (unknown dataset, no entry) or a scorer that raises (the reason names it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import cache
from typing import Any

from rlvr.verifiers.base import MISSING_REFERENCE, Score, Verifier, is_missing, non_text_error, one_line

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
COMPOSITE_DATASET = "composite"


def extract_answer(response: str) -> str | None:
    """The last <answer> tag's content, else the last non-empty line; None when there is nothing."""
    tags = _ANSWER_TAG.findall(response)
    if tags:
        answer = tags[-1].strip()
        return answer or None
    lines = [line.strip() for line in response.splitlines() if line.strip()]
    return lines[-1] if lines else None


@cache
def _score_answer_fn(dataset: str) -> Callable[[str | None, dict[str, Any]], float]:
    """The dataset's bound `score_answer` (building the dataset object once per process)."""
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(dataset)


def dataset_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _reference_parts(reference: Any) -> tuple[str, dict[str, Any]] | str:
    """(scorer dataset name, entry), or a reason why the reference cannot be used."""
    if isinstance(reference, str):
        try:
            reference = json.loads(reference)
        except (ValueError, RecursionError):
            return "reference is not JSON"
    if not isinstance(reference, dict) or not isinstance(reference.get("entry"), dict):
        return 'reasoning_gym reference must be {"dataset": NAME, "entry": {question, answer, metadata}}'
    entry = reference["entry"]
    metadata = entry.get("metadata") if isinstance(entry.get("metadata"), dict) else {}
    dataset = reference.get("dataset") or metadata.get("source_dataset")
    if dataset == COMPOSITE_DATASET:
        dataset = metadata.get("source_dataset")
    if not isinstance(dataset, str) or dataset not in dataset_names():
        return f"unknown reasoning-gym dataset {dataset!r}"
    return dataset, entry


class ReasoningGymVerifier(Verifier):
    name = "reasoning_gym"
    domain = "reasoning_gym"
    version = "1"

    def score(self, response: str, reference: Any) -> Score:
        parts = _reference_parts(reference)
        if isinstance(parts, str):
            return Score(0.0, "error", reason=parts)
        dataset, entry = parts
        if (problem := non_text_error(response)) is not None:
            return problem
        return self._score_entry(response, dataset, entry)

    def reference_error(self, reference: Any) -> str | None:
        """The entry's own answer, given in an <answer> tag, must earn 1.0 from the dataset's scorer.

        An entry whose answer is null (datasets scored on metadata, where many answers are valid:
        rush_hour, graph_color, ...) cannot be checked this way and is accepted."""
        if is_missing(reference):
            return MISSING_REFERENCE
        parts = _reference_parts(reference)
        if isinstance(parts, str):
            return parts
        dataset, entry = parts
        answer = entry.get("answer")
        if answer is None:
            return None
        score = self._score_entry(f"<answer>{answer}</answer>", dataset, entry)
        if score.status == "ok":
            return None
        return one_line(f"the entry's own answer is not rewarded ({score.status}: {score.reason})")

    def _score_entry(self, response: str, dataset: str, entry: dict[str, Any]) -> Score:
        answer = extract_answer(response)
        if answer is None:
            return Score(
                0.0, "unparseable", {"rg_score": 0.0}, reason="no answer (empty response or empty <answer> tag)"
            )
        try:
            rg_score = float(_score_answer_fn(dataset)(answer, entry))
        except Exception as exc:
            return Score(
                0.0,
                "error",
                {"rg_score": 0.0},
                answer[:2000],
                f"{dataset} scorer raised {type(exc).__name__}: {exc}"[:300],
            )
        if rg_score == 1.0:
            return Score(1.0, "ok", {"rg_score": rg_score}, answer[:2000], f"{dataset}: correct")
        return Score(
            0.0,
            "wrong",
            {"rg_score": rg_score},
            answer[:2000],
            f"{dataset}: scorer gave {rg_score:g}; only 1.0 is rewarded",
        )


def rg_problems(dataset: str, count: int, seed: int) -> list[dict[str, Any]]:
    """`count` problems of a reasoning-gym generator as {"prompt", "reference"} rows, reference as the
    verifier reads it. Entries go through a JSON round trip (values JSON cannot hold become strings),
    so the reference is exactly what a store keeps and what the scorer is checked against."""
    import reasoning_gym

    generator = reasoning_gym.create_dataset(dataset, size=count, seed=seed)
    rows = []
    for index in range(count):
        entry = json.loads(json.dumps(generator[index], default=str))
        rows.append({"prompt": entry["question"], "reference": {"dataset": dataset, "entry": entry}})
    return rows
