"""Math verifier: finds the final answer in a response and decides whether it equals the reference.

The extraction rules live in verifiers/math_extraction.py, the reading (normalisation, parsing, size caps) in
verifiers/math_reading.py; the confirmation of math-verify's verdict and the verifier itself here.

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

import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, ClassVar

import sympy
from math_verify import verify
from math_verify.errors import TimeoutException

from rlvr.verifiers.base import MISSING_REFERENCE, Score, Verifier, is_missing, non_text_error, one_line
from rlvr.verifiers.math_extraction import (
    BARE_ANSWER_CHARS,
    MAX_ANSWER_CHARS,
    Extraction,
    extract_answer,
    has_prose,
    reference_boxed,
)
from rlvr.verifiers.math_reading import (
    MAX_BRACE_DEPTH,
    TooLarge,
    brace_depth,
    check_size,
    in_math_mode,
    normalize_answer,
    parse_answer,
    simple_rational,
    step_timeout,
)

DECIMAL_REL_TOL = 1e-5  # relative agreement required when either side is a decimal


EXACT_DIGITS = 60  # precision of the confirmation of exact irrational values


EXACT_REL_TOL = 1e-50


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
    boxed = reference_boxed(reference_text)
    if boxed is not None:
        return normalize_answer(boxed), True, None
    if len(reference_text) > BARE_ANSWER_CHARS and has_prose(reference_text):
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
    if brace_depth(answer) > MAX_BRACE_DEPTH:
        raise _Settled(
            "unparseable", found.text[:200], f"{found.rule}: answer nested deeper than {MAX_BRACE_DEPTH} brackets"
        )
    return answer


def _parse_reference(gold_text: str, in_latex: bool, extracted: str) -> Any:
    if len(gold_text) > MAX_ANSWER_CHARS or brace_depth(gold_text) > MAX_BRACE_DEPTH:
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
        equal = verify(gold, pred, allow_set_relation_comp=True, timeout_seconds=step_timeout(), raise_on_error=True)
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
