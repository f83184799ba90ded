"""Finding the final answer in a response (verifiers/math.py's docstring, "Extraction"): the rules in their
order, the first that finds something wins; `extract_answer` returns the answer and the rule that found it."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from math_verify import parse

from rlvr.verifiers.math_reading import (
    LATEX_AND_EXPR,
    MATH_WORDS,
    MAX_BRACE_DEPTH,
    THOUSANDS,
    UNBRACED_FRAC,
    as_value,
    brace_depth,
    in_math_mode,
    is_value,
    normalize_answer,
    simple_rational,
    step_timeout,
)

MAX_ANSWER_CHARS = 1000  # an extracted answer longer than this is not a final answer


BOXED_SCAN_CHARS = 10_000  # how far a \boxed{ is followed looking for its closing brace


BOXED_TRIES = 5  # how many \boxed occurrences, from the last, are tried


TAIL_WINDOWS = (4_000, 256_000)  # last-match searches look at the response's tail first


def _last_match(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    """The last match of `pattern` in `text`, searching growing tails so 10 MB responses stay cheap.

    A match that starts near the cut of a tail may be a truncated piece of a longer match (or miss
    a look-behind), so it only counts if it starts well inside the tail; otherwise the tail grows.
    """
    for window in TAIL_WINDOWS:
        if window >= len(text):
            break
        start = len(text) - window
        last = None
        for match in pattern.finditer(text, start):
            last = match
        if last is not None and last.start() > start + 300:
            return last
    last = None
    for match in pattern.finditer(text):
        last = match
    return last


def _braced_span(text: str, start: int) -> tuple[str, int] | None:
    """(content, end) of the `{...}` group at or after `start` (spaces skipped), or of a bare token."""
    pos = start
    while pos < len(text) and text[pos] == " ":
        pos += 1
    if pos >= len(text):
        return None
    if text[pos] != "{":
        token = re.match(r"[^\s$]+", text[pos : pos + MAX_ANSWER_CHARS])
        return (token.group(0), pos + token.end()) if token else None
    depth = 0
    end = min(len(text), pos + BOXED_SCAN_CHARS)
    for i in range(pos, end):
        char = text[i]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[pos + 1 : i], i + 1
    return None


def _boxed_answers(text: str) -> list[tuple[int, int, str]]:
    """The last few non-empty `\\boxed{...}` / `\\fbox{...}`, as (start, end, content) in text order."""
    candidates: list[tuple[int, int]] = []
    for command in ("\\boxed", "\\fbox"):
        idx = len(text)
        for _ in range(BOXED_TRIES):
            idx = text.rfind(command, 0, idx)
            if idx == -1:
                break
            candidates.append((idx, idx + len(command)))
    answers = []
    for start, content_start in sorted(candidates, reverse=True)[:BOXED_TRIES]:
        span = _braced_span(text, content_start)
        if span is not None and span[0].strip():
            answers.append((start, span[1], span[0]))
    return answers[::-1]


# what may stand between boxed answers that together are one answer: "and", "or", commas, spacing
_ANSWER_LABEL = r"[A-Za-z](?:_\{?\w{1,3}\}?)?\s*="  # the `y_2 =` of `y_1 = \boxed{..}, y_2 = \boxed{..}`


_BOXED_SEPARATOR = re.compile(
    r"(?:\s|[,;&]|\\\\|\$|\\[()\[\]]|\\q?quad\b|\\[,;:! ]|\\text\s*\{[^{}]{0,30}\}|\b(?:and|or)\b"
    rf"|{_ANSWER_LABEL})*"
)


_LABEL_BEFORE = re.compile(rf"(?<![A-Za-z\\])({_ANSWER_LABEL})\s*$")


def _boxed_run(text: str, joined: Callable[[str], bool]) -> str | None:
    """The last boxed answer, with the boxed answers before it whose gaps `joined` accepts, as one list."""
    answers = _boxed_answers(text)
    if not answers:
        return None
    run = [answers[-1]]
    for answer in reversed(answers[:-1]):
        if answer[1] > run[0][0] or not joined(text[answer[1] : run[0][0]]):
            break
        run.insert(0, answer)
    if len(run) == 1:
        return run[0][2]
    labels = [_LABEL_BEFORE.search(text, max(0, start - 20), start) for start, _, _ in run]
    return ", ".join((label.group(1) if label else "") + content for label, (_, _, content) in zip(labels, run))


def _last_boxed(text: str) -> str | None:
    """The last boxed answer, with the boxed answers just before it that only "and", "or", commas
    or spacing separate from it: `\\boxed{-2} \\quad\\text{and}\\quad \\boxed{1}` is the list -2, 1,
    as math-verify reads it. So hedging (`\\boxed{1} or \\boxed{2}`) is not scored as its last answer.
    """
    return _boxed_run(text, lambda gap: _BOXED_SEPARATOR.fullmatch(gap) is not None)


_LIST_CONNECTOR = re.compile(r"[,;]|\b(?:and|or)\b")


def reference_boxed(text: str) -> str | None:
    """A reference's boxed answer; boxed answers with no prose or a list word between them
    ("\\boxed{1} cats and \\boxed{2} dogs") are one list: a reference states its answers, it does
    not hedge."""
    return _boxed_run(text, lambda gap: not has_prose(gap) or _LIST_CONNECTOR.search(gap) is not None)


_FINAL_ANSWER_I_HOPE = re.compile(r"final answer is\s*:?\s*([^\n]+?)\.?\s?I hope", re.IGNORECASE)


def _final_answer_i_hope(text: str) -> str | None:
    """Minerva's "The final answer is X. I hope it is correct.": math-verify's first priority."""
    found = _last_match(_FINAL_ANSWER_I_HOPE, text)
    if found is None:
        return None
    answer = found.group(1).strip()
    if answer.startswith(("$", "\\(", "\\[")):
        return _leading_math(answer)
    return None if has_prose(answer) else answer  # prose: math-verify's own pattern would not match


_MATH_ENV = re.compile(r"\$\$(.+?)\$\$|\$([^$]+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)


_LIST_JOIN = re.compile(r"\s*(?:,\s*(?:and\b|or\b)?|\band\b|\bor\b)\s*")


def _leading_math(text: str) -> str | None:
    """The math `text` starts with, as one `$...$` (so it reads as LaTeX): `$2$ and $3$` is `$2, 3$`."""
    contents, pos = [], 0
    while (env := _MATH_ENV.match(text, pos)) is not None:
        contents.append(next(group for group in env.groups() if group is not None).strip())
        join = _LIST_JOIN.match(text, env.end())
        if join is None:
            break
        pos = join.end()
    return "$" + ", ".join(contents) + "$" if contents else None


_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*:?", re.IGNORECASE)


_SENTENCE_END = re.compile(
    r"\n|\.(?:\s|$)|;\s|,?\s+(?:which|because|since|so|and|as|for|that|when|where|if)\b",
    re.IGNORECASE,
)


def _after_answer_is(text: str) -> str | None:
    last = _last_match(_ANSWER_IS, text)
    if last is None:
        return None
    tail = text[last.end() : last.end() + MAX_ANSWER_CHARS + 200].lstrip(" :\t")
    while tail.startswith("**"):  # "answer is **5**", or the end of a bold label: "**Answer:** 5"
        end = tail.find("**", 2)
        if end != -1 and not tail[2:3].isspace() and "\n" not in tail[2:end] and tail[2:end].strip():
            return tail[2:end]
        tail = tail[2:].lstrip(" :\t")
    math = _leading_math(tail)
    if math is not None:
        return math
    cut = _SENTENCE_END.search(tail)
    answer = tail[: cut.start()] if cut else tail
    return answer if answer.strip() else None


def _after_hashes(text: str) -> str | None:
    idx = text.rfind("####")
    if idx == -1:
        return None
    line = text[idx + 4 : idx + 4 + MAX_ANSWER_CHARS + 200].split("\n", 1)[0]
    return line if line.strip() else None


_ANSWER_LIKE_BOLD = re.compile(r"\*\*((?=[^*\n]*[\d\\])[^*\n]{1,200}?|\s*\(?[A-Za-z]\)?\s*)\*\*")


def _last_bold(text: str) -> str | None:
    """The last bold span that can be an answer: it holds a digit or a LaTeX command, or is one letter."""
    found = _last_match(_ANSWER_LIKE_BOLD, text)
    return found.group(1).strip() if found else None


_NUMBER = re.compile(
    r"-?\\[dt]?frac(?:\{\d+\}\{\d+\}|\d\d)"  # \frac{3}{8}, \dfrac{1}{2}, \frac12
    r"|(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?%?"
)


def _last_number(text: str) -> str | None:
    found = _last_match(_NUMBER, text)
    return found.group(0) if found else None


MARKER_RULES = (
    ("final answer", _final_answer_i_hope),
    ("boxed", _last_boxed),
    ("answer is", _after_answer_is),
    ("####", _after_hashes),
    ("bold", _last_bold),
)


MATH_VERIFY_RULE = "math-verify"


MATH_VERIFY_TAIL_CHARS = 4_000  # math-verify's regexes are quadratic on some text: it reads the tail


@dataclass(frozen=True)
class Extraction:
    """An answer found in a response.

    `value` is set when math-verify's own extraction found the answer: it has already parsed it, and
    parsing its normalised string again could read it differently. `parsed` is False when
    math-verify matched an answer it could not parse (then `text` is what it matched).
    """

    text: str
    rule: str
    value: Any = None
    parsed: bool = True


def _math_verify_tail(text: str) -> str:
    """The part of `text` math-verify reads: the tail, cut at a line start so no `$` pair is split."""
    if len(text) <= MATH_VERIFY_TAIL_CHARS:
        return text
    start = len(text) - MATH_VERIFY_TAIL_CHARS
    line_start = text.find("\n", start, start + MATH_VERIFY_TAIL_CHARS // 2)
    return text[line_start + 1 if line_start != -1 else start :]


_PUNCTUATION_BEFORE_CLOSER = re.compile(r"[.,;]\s*(\$\$|\$|\\\)|\\\])(?![\w\\{(\[$-])")


def _for_math_verify(text: str) -> str:
    """Two spellings math-verify's LaTeX parser fails on, rewritten (the value is unchanged).

    A sentence's full stop inside the math (`$\\frac{1}{2}.$`, `$$x = 3.$$`) makes the whole
    environment unparseable, and `\\frac\\pi4` loses its arguments; `\\frac32` and `\\frac3{3}`
    it reads itself.
    """
    text = _PUNCTUATION_BEFORE_CLOSER.sub(lambda m: m.group(1) + m.group(0)[0], text)
    return UNBRACED_FRAC.sub(r"\\\1{\2}{\3}", text)


def math_verify_answer(text: str) -> Extraction | None:
    """The answer math-verify's LaTeX and expression extraction finds, in its priority order.

    This is math-verify's `parse` on the response itself: "final answer is", `\\boxed`, "answer"
    anchors, then the rightmost LaTeX environment or plain number/expression. A number written
    with thousands separators (`$12\\,345$`, `$1 000$`), which its LaTeX parser reads as a sum or
    a product, is handed back as text, to be read as one number. Raises math-verify's
    TimeoutException when its alarm fires.
    """
    tail = _for_math_verify(_math_verify_tail(text))
    if brace_depth(tail) > MAX_BRACE_DEPTH:
        return Extraction(tail[-200:], MATH_VERIFY_RULE, parsed=False)
    found = parse(
        tail,
        extraction_config=LATEX_AND_EXPR,
        fallback_mode="first_match",
        parsing_timeout=step_timeout(),
        raise_on_error=True,
    )
    value = next((item for item in found if is_value(item)), None)
    matched = next((item.strip() for item in found if isinstance(item, str) and item.strip()), None)
    if value is None:
        return None if matched is None else Extraction(matched, MATH_VERIFY_RULE, parsed=False)
    if matched is not None and THOUSANDS.fullmatch(matched):
        return Extraction(matched, MATH_VERIFY_RULE)
    return Extraction(matched or str(value), MATH_VERIFY_RULE, as_value(value))


BARE_ANSWER_CHARS = 200


_LATEX_COMMAND_OR_TEXT = re.compile(r"\\(?:text|mathrm|mbox|operatorname)\s*\{[^{}]*\}|\\[A-Za-z]+")


_MATH_STRUCTURE = re.compile(r"[\\^{}\[\]()<>=,|\u2264\u2265\u2260]")


def is_bare_answer(text: str) -> bool:
    """Whether a response is nothing but an answer: one short line of math, no prose words.

    Such a response is read the way the reference is, as LaTeX: math-verify's plain-text
    extraction would read `x >= 5` as 5, `(2, 5)` as 5 and `x^2+2x+1` as nothing. Only text with
    some math structure (a LaTeX command, brackets, a relation, a comma) qualifies; plain numbers
    go to math-verify, which reads them well.
    """
    if len(text) > BARE_ANSWER_CHARS or "\n" in text or not _MATH_STRUCTURE.search(text):
        return False
    inner = normalize_answer(text) if in_math_mode(text) else text
    if "$" in inner:  # several math spans, or math inside prose: math-verify reads those
        return False
    return not has_prose(text)


def has_prose(text: str) -> bool:
    """Whether `text` holds a word that is not math (`pi`, `sqrt`, `inf` are math)."""
    words = re.findall(r"[A-Za-z]{2,}", _LATEX_COMMAND_OR_TEXT.sub(" ", text))
    return any(word.lower() not in MATH_WORDS for word in words)


def _answer_in_prose(text: str) -> Extraction | None:
    """For "Final Answer: The volume of $ABCD$ is 120.": what math-verify's answer-anchored
    patterns find in the line of the last "answer is" / "answer:" (here 120, not the sentence)."""
    marker = _last_match(_ANSWER_IS, text)
    line_start = text.rfind("\n", 0, marker.start()) + 1 if marker else 0
    found = math_verify_answer(text[line_start:])
    if found is None or not found.parsed:
        return None
    return Extraction(found.text, "answer is", found.value)


def extract_answer(response: str) -> Extraction | None:
    """The final answer in a response, or None when nothing that could be one is found.

    An explicit marker wins (`\\boxed`, "answer is", `####`, bold). Without one, the answer is what
    math-verify extracts from the response, so `$[0,1)$` is an interval and `$x \\geq 5$` an
    inequality, not their last number; the last number is the fallback only when math-verify finds
    nothing. A response that is wholly the answer (`12`, `3/4`, `(2, 5)`, `x >= 5`) is read whole,
    as the reference is.
    """
    text = response.replace("\u2212", "-")
    for rule, find in MARKER_RULES:
        answer = find(text)
        if answer is not None and answer.strip():
            if rule == "answer is" and has_prose(answer):
                return _answer_in_prose(text) or Extraction(answer.strip(), rule)
            return Extraction(answer.strip(), rule)
    bare = text.strip()
    if simple_rational(bare) is not None or is_bare_answer(bare):
        return Extraction(bare, "whole response")
    found = math_verify_answer(text)
    if found is not None:
        return found
    number = _last_number(text)
    return Extraction(number, "last number") if number else None
