"""Math verifier: finds the final answer in a response and decides whether it equals the reference.

Extraction, first rule that finds something wins:
  1. Minerva's "The final answer is X. I hope it is correct." (math-verify's first priority),
  2. the last `\\boxed{...}` (nested braces allowed; `\\fbox{...}` too); boxed answers just before it
     that only "and", "or", commas or spacing separate from it make one list with it,
  3. after the last "answer is" / "answer:": the math that follows (`$2$ and $3$` is one list), else
     the words up to the end of the sentence; if those are prose, what math-verify's answer-anchored
     patterns find in that line ("Final Answer: The volume is 120." gives 120),
  4. the rest of the line after the last "####" (GSM8K style),
  5. the last **bold** span that holds a digit, a LaTeX command or a single letter,
  6. the whole response, when it is nothing but an answer (`12`, `(2, 5)`, `x >= 5`, `x^2+2x+1`),
  7. without any of those: what math-verify's own LaTeX and expression extraction finds in the
     response (its last 4,000 characters), in its priority order; a match it cannot parse
     (`$-[0,1)$`) is `unparseable`, not a number picked out of it,
  8. only when math-verify finds nothing: the last number.

Reading: the reference and the answers of every rule but 7 are normalised (thousands separators,
trailing units, scientific notation, Python-style `**`, `\\frac\\pi4`, `2(3)`) and parsed as LaTeX,
so a bare `x^2+2x+1`, `[0,1)` or `x \\ge 5` keeps its meaning; a comma between digits is a decimal
comma in plain text (`1000,99`, as math-verify reads plain text) and separates a list in LaTeX
(`\\boxed{2,3}`). A long reference in prose is a worked solution: its answer is found as a response's.
Before math-verify reads a response, a full stop inside the math (`$\\frac{1}{2}.$`) is moved out and
`\\frac\\pi4` gets its braces; a number with thousands separators it found (`$12\\,345$`, which its
LaTeX parser reads as 12+345) is read as one number.

Comparison: two number literals (integers, fractions, decimals) are decided exactly when that
settles it; otherwise math-verify's `verify` decides, with a relation and the set it describes
comparable both ways (`x > 2` and `(2, \\infty)`).

math-verify alone accepts some unequal answers: its numeric path compares `evalf(chop=True)` to 15
digits, so 1/2004! "equals" 1/2006!, and it rounds floats to 6 decimal places, so 1e-7 "equals"
2e-7. Every `True` from math-verify is therefore confirmed here: exact numbers must be exactly equal
(rationals by `==`, irrationals to 50 significant digits), and a decimal answer must agree to a
relative 1e-5. Elements of tuples, sets and interval ends are confirmed the same way.

Statuses: `unparseable` when no answer can be extracted or the extracted answer cannot be parsed;
`wrong` when it parses and differs; `error` when the reference cannot be used or an answer is too
large to evaluate safely (power towers, huge factorials: refused up front by a digit bound);
`timeout` when math-verify's own alarm fires (main thread only; elsewhere the pool's hard timeout
applies, see verifiers/pool.py).
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any, ClassVar

import sympy
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

from rlvr.verifiers.base import MISSING_REFERENCE, Score, Verifier, is_missing, non_text_error, one_line

# We report timeouts and failures as statuses; math-verify's log lines would only repeat them.
logging.getLogger("math_verify").setLevel(logging.ERROR)

MAX_ANSWER_CHARS = 1000  # an extracted answer longer than this is not a final answer
MAX_BRACE_DEPTH = 40  # deeper LaTeX nesting is refused before the LaTeX parser recurses on it
MAX_DIGITS = 20_000  # numbers that would evaluate to more digits are refused (2006! has 5,700)
BOXED_SCAN_CHARS = 10_000  # how far a \boxed{ is followed looking for its closing brace
BOXED_TRIES = 5  # how many \boxed occurrences, from the last, are tried
DECIMAL_REL_TOL = 1e-5  # relative agreement required when either side is a decimal
EXACT_DIGITS = 60  # precision of the confirmation of exact irrational values
EXACT_REL_TOL = 1e-50
STEP_TIMEOUT_S = 3  # math-verify's alarm per parse / compare, in whole seconds (main thread only)

_LATEX_AND_EXPR = (LatexExtractionConfig(), ExprExtractionConfig())

# ---------------------------------------------------------------------------------------------
# Extraction


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


def _reference_boxed(text: str) -> str | None:
    """A reference's boxed answer; boxed answers with no prose or a list word between them
    ("\\boxed{1} cats and \\boxed{2} dogs") are one list: a reference states its answers, it does
    not hedge."""
    return _boxed_run(text, lambda gap: not _has_prose(gap) or _LIST_CONNECTOR.search(gap) is not None)


_FINAL_ANSWER_I_HOPE = re.compile(r"final answer is\s*:?\s*([^\n]+?)\.?\s?I hope", re.IGNORECASE)


def _final_answer_i_hope(text: str) -> str | None:
    """Minerva's "The final answer is X. I hope it is correct.": math-verify's first priority."""
    found = _last_match(_FINAL_ANSWER_I_HOPE, text)
    if found is None:
        return None
    answer = found.group(1).strip()
    if answer.startswith(("$", "\\(", "\\[")):
        return _leading_math(answer)
    return None if _has_prose(answer) else answer  # prose: math-verify's own pattern would not match


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


def _is_value(item: Any) -> bool:
    return isinstance(item, (sympy.Basic, sympy.MatrixBase))


def _as_value(item: Any) -> Any:
    """Matrices come back mutable; an immutable one is a sympy.Basic, safe to cache and to size."""
    return sympy.ImmutableMatrix(item) if isinstance(item, sympy.MatrixBase) else item


_PUNCTUATION_BEFORE_CLOSER = re.compile(r"[.,;]\s*(\$\$|\$|\\\)|\\\])(?![\w\\{(\[$-])")
_SYMBOL_COMMAND = r"\\(?:pi|tau|infty|alpha|beta|gamma|delta|theta|lambda|mu|sigma|phi|omega)(?![A-Za-z])"
_UNBRACED_FRAC = re.compile(rf"\\([dtc]?frac)\s*({_SYMBOL_COMMAND}|[A-Za-z0-9])\s*({_SYMBOL_COMMAND}|[A-Za-z0-9])")


def _for_math_verify(text: str) -> str:
    """Two spellings math-verify's LaTeX parser fails on, rewritten (the value is unchanged).

    A sentence's full stop inside the math (`$\\frac{1}{2}.$`, `$$x = 3.$$`) makes the whole
    environment unparseable, and `\\frac\\pi4` loses its arguments; `\\frac32` and `\\frac3{3}`
    it reads itself.
    """
    text = _PUNCTUATION_BEFORE_CLOSER.sub(lambda m: m.group(1) + m.group(0)[0], text)
    return _UNBRACED_FRAC.sub(r"\\\1{\2}{\3}", text)


def math_verify_answer(text: str) -> Extraction | None:
    """The answer math-verify's LaTeX and expression extraction finds, in its priority order.

    This is math-verify's `parse` on the response itself: "final answer is", `\\boxed`, "answer"
    anchors, then the rightmost LaTeX environment or plain number/expression. A number written
    with thousands separators (`$12\\,345$`, `$1 000$`), which its LaTeX parser reads as a sum or
    a product, is handed back as text, to be read as one number. Raises math-verify's
    TimeoutException when its alarm fires.
    """
    tail = _for_math_verify(_math_verify_tail(text))
    if _brace_depth(tail) > MAX_BRACE_DEPTH:
        return Extraction(tail[-200:], MATH_VERIFY_RULE, parsed=False)
    found = parse(
        tail,
        extraction_config=_LATEX_AND_EXPR,
        fallback_mode="first_match",
        parsing_timeout=_step_timeout(),
        raise_on_error=True,
    )
    value = next((item for item in found if _is_value(item)), None)
    matched = next((item.strip() for item in found if isinstance(item, str) and item.strip()), None)
    if value is None:
        return None if matched is None else Extraction(matched, MATH_VERIFY_RULE, parsed=False)
    if matched is not None and _THOUSANDS.fullmatch(matched):
        return Extraction(matched, MATH_VERIFY_RULE)
    return Extraction(matched or str(value), MATH_VERIFY_RULE, _as_value(value))


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
    return not _has_prose(text)


def _has_prose(text: str) -> bool:
    """Whether `text` holds a word that is not math (`pi`, `sqrt`, `inf` are math)."""
    words = re.findall(r"[A-Za-z]{2,}", _LATEX_COMMAND_OR_TEXT.sub(" ", text))
    return any(word.lower() not in _MATH_WORDS for word in words)


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
            if rule == "answer is" and _has_prose(answer):
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


# ---------------------------------------------------------------------------------------------
# Normalisation of an answer string (response or reference)

_WRAPPERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("**", "**"))
_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_THOUSANDS = re.compile(r"[-+]?[1-9]\d{0,2}(?:(?:,|\{,\}|\\,| )\d{3})+(?:\.\d+)?%?")
_SCIENTIFIC = re.compile(r"([-+]?\d+(?:\.\d+)?)[eE]([-+]?\d+)")
# LaTeX's parser reads 2(3) as the mixed number 2+3; it is a product
_NUMBER_TIMES_PARENTHESIS = re.compile(r"(?<=[\d)])\s*\((?=[-+]?\d+(?:\.\d+)?\))")
_MATH_WORDS = {"pi", "e", "i", "sqrt", "infty", "inf", "infinity", "ln", "log", "sin", "cos", "tan"}
_NUMBER_WITH_UNIT = re.compile(
    r"(?P<number>[-+]?\d+(?:\.\d+)?(?:/\d+)?%?)(?P<space>\s*)"
    r"(?P<unit>[A-Za-z]+\.?(?:\^?[23])?(?:\s*(?:/|per)\s*[A-Za-z]+(?:\^?[23])?)?(?:\s+[A-Za-z]+)?)"
)


def normalize_answer(answer: str) -> str:
    """Rewrite surface forms math-verify does not read into ones it does; the value is unchanged."""
    text = re.sub(r"\\!\s*", "", answer.strip().replace("\u2212", "-"))
    changed = True
    while changed:
        changed = False
        for opener, closer in _WRAPPERS:
            if len(text) >= len(opener) + len(closer) and text.startswith(opener) and text.endswith(closer):
                text = text[len(opener) : len(text) - len(closer)].strip()
                changed = True
        if text.endswith("."):
            text = text[:-1].rstrip()
            changed = True
        text_command = _TEXT_COMMAND.fullmatch(text)
        if text_command:
            text = text_command.group(1).strip()
            changed = True
    if text.count("$") == 1:  # a currency sign, not a math delimiter
        for currency in ("\\$", "$"):
            if text.startswith(currency):
                text = text[len(currency) :].strip()
                break
    text = text.replace("\u00b0", "")
    text = _UNBRACED_FRAC.sub(r"\\\1{\2}{\3}", text)
    text = _NUMBER_TIMES_PARENTHESIS.sub(r"\\cdot(", text)
    if _THOUSANDS.fullmatch(text):
        text = re.sub(r",|\{,\}|\\,| ", "", text)
    scientific = _SCIENTIFIC.fullmatch(text)
    if scientific:
        text = f"{scientific.group(1)}\\times 10^{{{scientific.group(2)}}}"
    with_unit = _NUMBER_WITH_UNIT.fullmatch(text)
    if with_unit:
        unit = with_unit.group("unit")
        single_letter_glued = len(unit) == 1 and not with_unit.group("space")
        if unit.lower() not in _MATH_WORDS and not single_letter_glued:
            text = with_unit.group("number")
    if "\\" not in text:
        text = text.replace("**", "^")
        text = re.sub(r"(?<![A-Za-z\\])pi(?![A-Za-z])", r"\\pi", text)
        text = re.sub(r"(?<![A-Za-z])(?:infinity|inf)(?![A-Za-z])", r"\\infty", text)
    return text


def _brace_depth(text: str) -> int:
    depth = deepest = 0
    for char in text:
        if char in "{([":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "})]":
            depth -= 1
    return deepest


# ---------------------------------------------------------------------------------------------
# Parsing and size caps


class TooLarge(ValueError):
    """The answer would evaluate to a number too large to compare safely."""


def _step_timeout() -> int | None:
    """math-verify's alarm works only in the main thread; elsewhere the caller's timeout applies."""
    return STEP_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


_MATH_DELIMITERS = (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_DECIMAL_COMMA = re.compile(r"[-+]?\d+,\d+%?")  # read once thousands separators are gone


def in_math_mode(text: str) -> bool:
    """Whether an answer is written inside LaTeX math ($...$, \\(...\\), \\[...\\], \\boxed{...}).

    It decides how a comma between digits reads: "1000,99" in plain text is a decimal comma (as
    math-verify reads plain text), "$2,3$" or "\\boxed{2,3}" is a list of two answers (as it reads LaTeX).
    """
    text = text.strip()
    if text.startswith(("\\boxed", "\\fbox")):
        return True
    return any(
        len(text) > 1 and text.startswith(opener) and text.endswith(closer) for opener, closer in _MATH_DELIMITERS
    )


@lru_cache(maxsize=4096)
def _parse_cached(text: str, in_latex: bool, timeout: int | None) -> Any:
    if not in_latex and _DECIMAL_COMMA.fullmatch(text):
        text = text.replace(",", ".")
    for candidate in (f"${text}$", text):
        parsed = parse(candidate, extraction_config=_LATEX_AND_EXPR, parsing_timeout=timeout, raise_on_error=True)
        for item in parsed:
            if _is_value(item):
                return _as_value(item)
    return None


def parse_answer(text: str, in_latex: bool = True) -> Any:
    """The value of a normalised answer (sympy, or a matrix), or None when math-verify finds nothing.

    The reference and marked answers both come here: the text is read as LaTeX, so a bare
    `x^2+2x+1`, `[0,1)` or `x \\geq 5` is an expression, an interval or an inequality, not the number
    math-verify's plain-text extraction would pick out of it. `in_latex`: see `in_math_mode`.
    """
    return _parse_cached(text, in_latex, _step_timeout())


def _int_value_bound(expr: sympy.Basic) -> float:
    """Upper bound on |expr| for a small numeric expr (used for exponents and factorial arguments)."""
    if _digit_bound(expr) > 7:
        return math.inf
    try:
        return abs(complex(expr.evalf(15)))
    except (TypeError, ValueError):
        return 0.0  # symbolic: evaluation cannot blow up on a value it does not have


def _digit_bound(expr: sympy.Basic) -> float:
    """Upper bound on the decimal digits of any number in `expr` once evaluated (inf if unbounded)."""
    if isinstance(expr, sympy.Integer):
        return int(expr).bit_length() * 0.302 + 1
    if isinstance(expr, sympy.Rational):
        return max(int(expr.p).bit_length(), int(expr.q).bit_length()) * 0.302 + 1
    if isinstance(expr, sympy.Float):
        return abs(int(expr._mpf_[2])) * 0.302 + 20
    if isinstance(expr, sympy.Pow):
        base, exponent = expr.args
        base_digits = max(_digit_bound(base), 1.0)
        if not exponent.free_symbols:
            return _int_value_bound(exponent) * base_digits
        return base_digits
    if isinstance(expr, (sympy.factorial, sympy.gamma)):
        n = _int_value_bound(expr.args[0])
        return n * math.log10(n + 1) + 1
    if isinstance(expr, sympy.factorial2):
        n = _int_value_bound(expr.args[0])
        return n * math.log10(n + 1) / 2 + 1
    if isinstance(expr, sympy.binomial):
        n = _int_value_bound(expr.args[0])
        return n * 0.302 + 1
    child_bounds = [_digit_bound(arg) for arg in expr.args if isinstance(arg, sympy.Basic)]
    if not child_bounds:
        return 1.0
    if isinstance(expr, sympy.Add):
        return max(child_bounds) + 1
    return sum(child_bounds)


def check_size(expr: sympy.Basic, what: str) -> None:
    bound = _digit_bound(expr)
    if bound > MAX_DIGITS:
        size = "an unbounded number of" if math.isinf(bound) else f"about {bound:.0f}"
        raise TooLarge(f"{what} would evaluate to {size} digits (limit {MAX_DIGITS})")


# ---------------------------------------------------------------------------------------------
# Confirmation of math-verify's verdict


def _is_scalar_number(expr: Any) -> bool:
    return (
        isinstance(expr, sympy.Expr)
        and not isinstance(expr, (sympy.MatrixBase, sympy.MatrixExpr))
        and not expr.free_symbols
        and bool(expr.is_number)
    )


def _percent_value(expr: sympy.Expr) -> sympy.Expr | None:
    """X for an answer written "X%" (latex2sympy keeps it as X * UnevaluatedExpr(1/100))."""
    marker = sympy.UnevaluatedExpr(sympy.Rational(1, 100))
    if isinstance(expr, sympy.Mul) and len(expr.args) == 2 and expr.args[1] == marker:
        return expr.args[0]
    return None


def _readings(expr: sympy.Expr) -> list[sympy.Expr]:
    """The values an answer may mean: "50%" is 1/2 or, as graders of percent questions accept, 50."""
    percent = _percent_value(expr)
    if percent is None:
        return [expr.doit()]
    return [percent / 100, percent]


def _numbers_equal(a: sympy.Expr, b: sympy.Expr) -> bool:
    if a.has(sympy.Float) or b.has(sympy.Float):
        va = complex(a.evalf(30))
        vb = complex(b.evalf(30))
        scale = max(abs(va), abs(vb))
        return scale == 0 or abs(va - vb) <= DECIMAL_REL_TOL * scale
    if a.is_infinite or b.is_infinite or a.is_infinite is None or b.is_infinite is None:
        return a == b
    if isinstance(a, sympy.Rational) and isinstance(b, sympy.Rational):
        return a == b
    difference = a - b
    if difference == 0:
        return True
    value = abs(difference.evalf(EXACT_DIGITS))
    scale = max(abs(a.evalf(EXACT_DIGITS)), abs(b.evalf(EXACT_DIGITS)))
    if scale == 0:
        return value == 0
    return bool(value <= EXACT_REL_TOL * scale)


def _equation_side(expr: sympy.Basic) -> sympy.Basic:
    """`x = 5` compared with `5`: math-verify compares the right-hand side; so do we."""
    while isinstance(expr, sympy.Eq):
        expr = expr.rhs
    return expr


def confirm_equal(gold: sympy.Basic, pred: sympy.Basic) -> bool:
    """Re-check a `True` from math-verify where its numeric comparison can be fooled."""
    if isinstance(gold, sympy.Eq) != isinstance(pred, sympy.Eq):
        gold, pred = _equation_side(gold), _equation_side(pred)
    if isinstance(gold, sympy.Tuple) and isinstance(pred, sympy.Tuple) and len(gold) == len(pred):
        return all(confirm_equal(g, p) for g, p in zip(gold, pred))
    if isinstance(gold, (sympy.FiniteSet, sympy.Tuple)) and isinstance(pred, (sympy.FiniteSet, sympy.Tuple)):
        gold_items, pred_items = list(gold.args), list(pred.args)
        return all(any(confirm_equal(g, p) for g in gold_items) for p in pred_items) and all(
            any(confirm_equal(g, p) for p in pred_items) for g in gold_items
        )
    if isinstance(gold, sympy.Interval) and isinstance(pred, sympy.Interval):
        return (
            gold.left_open == pred.left_open
            and gold.right_open == pred.right_open
            and confirm_equal(gold.start, pred.start)
            and confirm_equal(gold.end, pred.end)
        )
    if _is_scalar_number(gold) and _is_scalar_number(pred):
        try:
            return any(_numbers_equal(g, p) for g in _readings(gold) for p in _readings(pred))
        except (TypeError, ValueError, ArithmeticError):
            return gold == pred  # values evalf cannot take (e.g. complex infinity): only identity counts
    return True


# ---------------------------------------------------------------------------------------------
# The verifier

_SIMPLE_RATIONAL = re.compile(
    r"(?P<sign>[-+]?)(?:(?P<p>\d{1,1000})(?:/(?P<q>\d{1,1000}))?"
    r"|\\[dt]?frac(?:\{(?P<fp>\d{1,1000})\}\{(?P<fq>\d{1,1000})\}|(?P<dp>\d)(?P<dq>\d)))"
)


def simple_rational(text: str) -> Fraction | None:
    """The value of an integer or fraction literal ("-12", "3/4", "\\frac{3}{4}"), else None.

    Two such answers are equal exactly when their values are: the same verdict math-verify and
    `confirm_equal` reach, without the parser. Decimals are left to math-verify (it rounds them).
    """
    match = _SIMPLE_RATIONAL.fullmatch(text)
    if match is None:
        return None
    numerator = match.group("p") or match.group("fp") or match.group("dp")
    denominator = match.group("q") or match.group("fq") or match.group("dq") or "1"
    if int(denominator) == 0:
        return None
    value = Fraction(int(numerator), int(denominator))
    return -value if match.group("sign") == "-" else value


def _reference_text(reference: Any) -> str | None:
    if isinstance(reference, bool) or reference is None:
        return None
    if isinstance(reference, (int, float)):
        return repr(reference) if isinstance(reference, float) else str(reference)
    if isinstance(reference, str) and reference.strip():
        return reference
    return None


def _same_text(a: str, b: str) -> bool:
    return re.sub(r"\s+", "", a) == re.sub(r"\s+", "", b)


class _Settled(Exception):
    """A verdict reached before the comparison (no answer, an unparseable answer, a bad reference)."""

    def __init__(self, status: str, extracted: str | None, reason: str) -> None:
        super().__init__(reason)
        self.score = Score(0.0, status, {"correct": 0.0}, extracted, reason)  # type: ignore[arg-type]


def _gold(reference_text: str) -> tuple[str, bool, Any]:
    """(normalised reference, whether it is LaTeX, its value if already parsed).

    A boxed reference is unboxed. A long reference in prose is a worked solution: its answer is
    found the way a response's is. Anything else is read whole, as LaTeX (see `parse_answer`).
    """
    boxed = _reference_boxed(reference_text)
    if boxed is not None:
        return normalize_answer(boxed), True, None
    if len(reference_text) > BARE_ANSWER_CHARS and _has_prose(reference_text):
        try:
            found = extract_answer(reference_text)
        except TimeoutException:
            raise _Settled("timeout", None, "finding the answer in the reference timed out") from None
        except Exception as exc:
            raise _Settled("error", None, f"reference: no answer found in it ({type(exc).__name__})") from None
        if found is not None and found.parsed:
            if found.value is not None:
                return found.text, True, found.value
            return normalize_answer(found.text), found.rule == "boxed" or in_math_mode(found.text), None
    return normalize_answer(reference_text), in_math_mode(reference_text), None


def _find(response: str) -> Extraction:
    try:
        found = extract_answer(response)
    except TimeoutException:
        raise _Settled("timeout", None, "math-verify: extracting the answer timed out") from None
    except Exception as exc:
        raise _Settled("unparseable", None, f"math-verify: extraction failed: {type(exc).__name__}") from None
    if found is None:
        raise _Settled("unparseable", None, "no answer found (no \\boxed, 'answer is', '####', bold, math or number)")
    if not found.parsed:
        raise _Settled("unparseable", found.text[:200], f"{found.rule}: answer {found.text[:60]!r} could not be parsed")
    return found


def _answer_text(found: Extraction) -> str:
    """The normalised text of an answer found by a marker or as a number, refused if too large to parse."""
    answer = normalize_answer(found.text)
    if len(answer) > MAX_ANSWER_CHARS:
        raise _Settled(
            "unparseable", found.text[:200], f"{found.rule}: answer longer than {MAX_ANSWER_CHARS} characters"
        )
    if _brace_depth(answer) > MAX_BRACE_DEPTH:
        raise _Settled(
            "unparseable", found.text[:200], f"{found.rule}: answer nested deeper than {MAX_BRACE_DEPTH} brackets"
        )
    return answer


def _parse_reference(gold_text: str, in_latex: bool, extracted: str) -> Any:
    if len(gold_text) > MAX_ANSWER_CHARS or _brace_depth(gold_text) > MAX_BRACE_DEPTH:
        raise _Settled("error", extracted, "reference is too long or too deeply nested to parse")
    try:
        gold = parse_answer(gold_text, in_latex)
    except TimeoutException:
        raise _Settled("timeout", extracted, "parsing the reference timed out") from None
    except Exception as exc:
        raise _Settled(
            "error", extracted, f"reference could not be parsed: {type(exc).__name__}: {exc}"[:300]
        ) from None
    if gold is None:
        raise _Settled("error", extracted, f"reference {gold_text[:60]!r} could not be parsed")
    return gold


def _parse_marked(answer: str, found: Extraction) -> Any:
    in_latex = found.rule == "boxed" or in_math_mode(found.text)
    try:
        pred = parse_answer(answer, in_latex)
    except TimeoutException:
        raise _Settled("timeout", found.text, f"{found.rule}: parsing the answer timed out") from None
    except Exception as exc:
        raise _Settled(
            "unparseable", found.text, f"{found.rule}: answer could not be parsed: {type(exc).__name__}"
        ) from None
    if pred is None:
        raise _Settled("unparseable", found.text, f"{found.rule}: answer {found.text[:60]!r} could not be parsed")
    return pred


def _compare(gold: Any, pred: Any, found: Extraction) -> bool:
    """math-verify's verdict, each `True` re-checked exactly (see the module docstring)."""
    try:
        check_size(gold, "reference")
        check_size(pred, "answer")
    except TooLarge as exc:
        raise _Settled("error", found.text, f"{found.rule}: {exc}") from None
    try:
        equal = verify(gold, pred, allow_set_relation_comp=True, timeout_seconds=_step_timeout(), raise_on_error=True)
    except TimeoutException:
        raise _Settled("timeout", found.text, f"{found.rule}: comparison timed out") from None
    except Exception as exc:
        raise _Settled(
            "wrong", found.text, f"{found.rule}: not comparable with the reference ({type(exc).__name__})"
        ) from None
    return bool(equal) and confirm_equal(gold, pred)


_DECIMAL_LITERAL = re.compile(r"[-+]?\d{1,1000}\.\d{1,1000}")
DECIMAL_DISTINCT = Fraction(1, 10**6)  # math-verify rounds decimals to 6 places: further apart is unequal


def _exact_number(text: str) -> tuple[Fraction, bool] | None:
    """(exact value, whether it is a decimal) of an integer, fraction or decimal literal."""
    value = simple_rational(text)
    if value is not None:
        return value, False
    return (Fraction(text), True) if _DECIMAL_LITERAL.fullmatch(text) else None


def _exact_verdict(gold_text: str, answer: str | None, pred: Any, text: str) -> bool | None:
    """The verdict on two number literals without parsing them, or None when it needs math-verify.

    Two integers or fractions are equal exactly when their values are: math-verify and
    `confirm_equal` agree on that. With a decimal, equal values are equal, and values more than
    1e-6 apart are unequal (math-verify compares decimals rounded to 6 places); closer ones go to
    math-verify and the tolerance re-check. Most answers in RL are such literals. `answer`: a
    marked answer's normalised text; else `pred` and `text`: what math-verify's extraction found.
    """
    gold = _exact_number(gold_text)
    if gold is None:
        return None
    if answer is not None:
        found = _exact_number(answer)
    elif isinstance(pred, sympy.Rational):
        found = Fraction(int(pred.p), int(pred.q)), False
    elif isinstance(pred, sympy.Float) and _DECIMAL_LITERAL.fullmatch(text) and float(text) == float(pred):
        found = Fraction(text), True  # the literal math-verify read as this float
    else:
        found = None
    if found is None:
        return None
    if found[0] == gold[0] or not (found[1] or gold[1]):
        return found[0] == gold[0]
    return False if abs(found[0] - gold[0]) > DECIMAL_DISTINCT else None


class MathVerifier(Verifier):
    name = "math"
    domain = "math"
    version = "2"

    # CLPO's policy rewriter (docs/methods.md#clpo): easier wording for hard problems, new wording for
    # medium ones; the maths and the final answer stay, and the answer must not appear in the rewrite.
    rewrite_templates: ClassVar[Mapping[str, str]] = {
        "simplify": (
            "Make this problem easier to read without changing it: shorter sentences, each condition stated "
            "explicitly (for example x > 0), no new information. Keep every number, the question asked, the "
            "instruction about the answer's form, and the answer. Never state the answer.\n"
            "Problem: {question}\nAnswer (do not reveal): {answer}\nRewritten problem:"
        ),
        "diversify": (
            "Rephrase this problem: other words, another order of its clauses, another sentence structure. "
            "Add or drop no condition and change no mathematical content; the answer stays the same. Never "
            "state the answer.\nProblem: {question}\nAnswer (do not reveal): {answer}\nRephrased problem:"
        ),
    }

    def score(self, response: str, reference: Any) -> Score:
        reference_text = _reference_text(reference)
        if reference_text is None:
            return Score(
                0.0,
                "error",
                reason=f"math reference must be a non-empty string or a number, got {type(reference).__name__}",
            )
        if (problem := non_text_error(response)) is not None:
            return problem
        try:
            return self._score(response, reference_text)
        except _Settled as settled:
            return settled.score

    def reference_error(self, reference: Any) -> str | None:
        """The reference read as `score` reads it (unboxed, a worked solution's answer found), parsed,
        size-checked and compared with itself. Scoring its text against itself would prove little: an
        identical response is accepted by its text before any parsing (so `\\frac{` would pass), and a
        bare word ("B") is only found in a response inside `$...$` or `\\boxed{}`."""
        if is_missing(reference):
            return MISSING_REFERENCE
        reference_text = _reference_text(reference)
        if reference_text is None:
            return f"math reference must be a non-empty string or a number, got {type(reference).__name__}"
        try:
            gold_text, in_latex, gold = _gold(reference_text)
            if gold is None and _exact_number(gold_text) is not None:
                return None  # a number literal is decided exactly, without math-verify
            if gold is None:
                gold = _parse_reference(gold_text, in_latex, gold_text[:200])
            if not _compare(gold, gold, Extraction(gold_text[:200], "self-comparison")):
                return f"reference {gold_text[:60]!r} does not equal itself under math-verify"
        except _Settled as settled:
            return one_line(settled.score.reason or settled.score.status)
        except Exception as exc:
            return one_line(f"checking the reference raised {type(exc).__name__}: {exc}")
        return None

    def _score(self, response: str, reference_text: str) -> Score:
        gold_text, gold_in_latex, gold = _gold(reference_text)
        found = _find(response)
        pred, answer = found.value, None
        if pred is None:
            answer = _answer_text(found)
            if gold is None and _same_text(answer, gold_text):
                return self._verdict(True, found)
        if gold is None and (exact := _exact_verdict(gold_text, answer, pred, found.text)) is not None:
            return self._verdict(exact, found)
        if gold is None:
            gold = _parse_reference(gold_text, gold_in_latex, found.text)
        if pred is None:
            pred = _parse_marked(answer or "", found)
        return self._verdict(_compare(gold, pred, found), found)

    @staticmethod
    def _verdict(equal: bool, found: Extraction) -> Score:
        if equal:
            return Score(1.0, "ok", {"correct": 1.0}, found.text, f"{found.rule}: equivalent to the reference")
        return Score(0.0, "wrong", {"correct": 0.0}, found.text, f"{found.rule}: not equivalent to the reference")
