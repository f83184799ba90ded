"""Text verifier: normalised exact match, multiple choice, and BLEU against references
(docs/methods.md#text-and-bleu, BLEUBERI).

Reference: a plain string (exact mode, that string is the answer) or a dict / its JSON string:
  {"mode": "exact",  "answer": TEXT or [TEXT, ...]}     any of the answers, after normalisation
  {"mode": "choice", "answer": "B"}                      one letter A-Z ("(B)" and "b" are read as B)
  {"mode": "bleu",   "references": [TEXT, ...], "threshold": 0.5}   ("answer" also names one reference)
"mode" defaults to "exact".

What is compared: for exact and bleu, the content of the last <answer>...</answer> tag if there is one,
else the whole response. For choice the letter is taken, first rule that finds one wins, from
  1. the last <answer> tag's content (the rules below then apply to it alone),
  2. the last "answer is B" / "Answer: (B)" / "answer: option B",
  3. a response that is only a letter ("B", "(B)", "B."),
  4. a last line that starts with one ("B. Paris", "(B) Paris"),
  5. the last "(B)" anywhere.
Letters are capitals only, so the article "a" is never read as choice A.

Exact normalisation (SQuAD style): lowercase, drop punctuation, drop the articles a/an/the, collapse
whitespace. Value 1/0, component "exact" (choice: "correct").
BLEU: sacrebleu's sentence BLEU (13a tokenizer, exp smoothing, effective order) of the text against all
references at once; value = BLEU / 100 in [0, 1], kept as component "bleu"; status ok iff value >=
threshold (default 0.5, i.e. BLEU 50), else wrong. The value is the reward either way; the threshold
only says which responses count as passing (pass rates, curricula).

Statuses: unparseable when there is no text (or, for choice, no letter); error for a bad reference.
"""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Any

from rlvr.verifiers.base import MISSING_REFERENCE, Score, Status, Verifier, is_missing, non_text_error, self_check_error

DEFAULT_BLEU_THRESHOLD = 0.5
MODES = ("exact", "choice", "bleu")

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_ANSWER_IS_LETTER = re.compile(r"(?i:answer)\s*(?:(?i:is)\s*)?[:=]?\s*(?:(?i:option|choice)\s*)?[(\[]?([A-Z])\b")
_ONLY_LETTER = re.compile(r"\s*[(\[]?([A-Z])[)\]]?[.:]?\s*")
_LINE_STARTS_WITH_LETTER = re.compile(r"\s*(?:[(\[]([A-Z])[)\]]|([A-Z])[.):])(?:\s|$)")
_PARENTHESISED_LETTER = re.compile(r"\(([A-Z])\)")
_REFERENCE_LETTER = re.compile(r"\s*\(?([A-Za-z])\)?\.?\s*")


def normalize_text(text: str) -> str:
    """Lowercase, punctuation removed, articles removed, whitespace collapsed."""
    text = text.lower()
    text = "".join(" " if unicodedata.category(char).startswith("P") else char for char in text)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def answer_text(response: str) -> str:
    """The last <answer> tag's content, else the whole response; stripped."""
    tags = _ANSWER_TAG.findall(response)
    return (tags[-1] if tags else response).strip()


def extract_choice(response: str) -> str | None:
    """The chosen letter (see the module docstring for the rules), or None."""
    tags = _ANSWER_TAG.findall(response)
    text = tags[-1] if tags else response
    answer_is = list(_ANSWER_IS_LETTER.finditer(text))
    if answer_is:
        return answer_is[-1].group(1)
    only = _ONLY_LETTER.fullmatch(text)
    if only:
        return only.group(1)
    lines = [line for line in text.splitlines() if line.strip()]
    if lines:
        starts = _LINE_STARTS_WITH_LETTER.match(lines[-1])
        if starts:
            return starts.group(1) or starts.group(2)
    parenthesised = list(_PARENTHESISED_LETTER.finditer(text))
    if parenthesised:
        return parenthesised[-1].group(1)
    return None


def _reference_dict(reference: Any) -> dict[str, Any] | str:
    """The reference as a dict with a mode, or a reason it cannot be used."""
    if isinstance(reference, str):
        if reference.lstrip().startswith("{"):
            try:
                parsed = json.loads(reference)
            except (ValueError, RecursionError):
                return "text reference looks like JSON but does not parse"
            reference = parsed
        else:
            return {"mode": "exact", "answer": reference}
    if not isinstance(reference, dict):
        return "text reference must be a string or a dict with a mode"
    mode = reference.get("mode", "exact")
    if mode not in MODES:
        return f"unknown text mode {mode!r}; known: {', '.join(MODES)}"
    return {**reference, "mode": mode}


def _strings(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return value
    return None


def _gold_letter(ref: dict[str, Any]) -> str | None:
    """The choice-mode answer as a capital letter ("(b)" is B), or None when it is not one letter."""
    gold = ref.get("answer")
    gold_match = _REFERENCE_LETTER.fullmatch(gold) if isinstance(gold, str) else None
    return gold_match.group(1).upper() if gold_match else None


def _correct_response(ref: dict[str, Any]) -> str:
    """What a correct response to a reference says: its letter, or its first answer or reference text that
    normalisation leaves non-empty ("" when the reference has none, which `score` then reports)."""
    if ref["mode"] == "choice":
        return _gold_letter(ref) or ""
    texts = _strings(ref.get("references", ref.get("answer")) if ref["mode"] == "bleu" else ref.get("answer"))
    return next((text for text in texts or [] if normalize_text(text)), "")


class TextVerifier(Verifier):
    name = "text"
    domain = "text"
    version = "1"

    def score(self, response: str, reference: Any) -> Score:
        ref = _reference_dict(reference)
        if isinstance(ref, str):
            return Score(0.0, "error", reason=ref)
        if (problem := non_text_error(response)) is not None:
            return problem
        if ref["mode"] == "choice":
            return self._choice(response, ref)
        if ref["mode"] == "bleu":
            return self._bleu(response, ref)
        return self._exact(response, ref)

    def reference_error(self, reference: Any) -> str | None:
        """The reference's own answer (letter, text) must score ok: it checks the mode's fields and, for
        BLEU, that the threshold can be reached."""
        if is_missing(reference):
            return MISSING_REFERENCE
        ref = _reference_dict(reference)
        if isinstance(ref, str):
            return ref
        return self_check_error(self, _correct_response(ref), ref)

    @staticmethod
    def _exact(response: str, ref: dict[str, Any]) -> Score:
        answers = _strings(ref.get("answer"))
        if answers is None or not any(normalize_text(answer) for answer in answers):
            return Score(0.0, "error", reason='exact mode needs "answer": a non-empty string or a list of strings')
        text = answer_text(response)
        if not text:
            return Score(0.0, "unparseable", {"exact": 0.0}, reason="empty answer")
        normalized = normalize_text(text)
        if any(normalized == normalize_text(answer) for answer in answers):
            return Score(1.0, "ok", {"exact": 1.0}, text[:2000], "matches after normalisation")
        return Score(
            0.0, "wrong", {"exact": 0.0}, text[:2000], f"normalised answer {normalized[:80]!r} matches no reference"
        )

    @staticmethod
    def _choice(response: str, ref: dict[str, Any]) -> Score:
        gold_letter = _gold_letter(ref)
        if gold_letter is None:
            return Score(0.0, "error", reason='choice mode needs "answer": one letter A-Z')
        letter = extract_choice(response)
        if letter is None:
            return Score(0.0, "unparseable", {"correct": 0.0}, reason="no choice letter found")
        if letter == gold_letter:
            return Score(1.0, "ok", {"correct": 1.0}, letter, f"chose {letter}")
        return Score(0.0, "wrong", {"correct": 0.0}, letter, f"chose {letter}, expected {gold_letter}")

    @staticmethod
    def _bleu(response: str, ref: dict[str, Any]) -> Score:
        references = _strings(ref.get("references", ref.get("answer")))
        if references is None:
            return Score(0.0, "error", reason='bleu mode needs "references": a non-empty list of strings')
        threshold = ref.get("threshold", DEFAULT_BLEU_THRESHOLD)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
            return Score(0.0, "error", reason="bleu threshold must be a number in [0, 1]")
        text = answer_text(response)
        if not text:
            return Score(0.0, "unparseable", {"bleu": 0.0}, reason="empty answer")
        import sacrebleu

        value = min(
            1.0, sacrebleu.sentence_bleu(text, references).score / 100
        )  # identical text gives 100.00000000000004
        status: Status = "ok" if value >= threshold else "wrong"
        return Score(
            value, status, {"bleu": value}, text[:2000], f"BLEU {value * 100:.1f} vs threshold {threshold * 100:g}"
        )
