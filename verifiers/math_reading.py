"""Reading a math answer (verifiers/math.py's docstring, "Reading"): an answer string normalised, a response's
or a reference's alike; its value parsed by math-verify (memoised per process: a pure function of the text);
the size caps that refuse an answer too large to evaluate safely; the exact value of a plain integer or
fraction literal."""

from __future__ import annotations

import logging
import math
import re
import threading
from fractions import Fraction
from functools import lru_cache
from typing import Any

import sympy
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

# We report timeouts and failures as statuses; math-verify's log lines would only repeat them.
logging.getLogger("math_verify").setLevel(logging.ERROR)


MAX_BRACE_DEPTH = 40  # deeper LaTeX nesting is refused before the LaTeX parser recurses on it


MAX_DIGITS = 20_000  # numbers that would evaluate to more digits are refused (2006! has 5,700)


STEP_TIMEOUT_S = 3  # math-verify's alarm per parse / compare, in whole seconds (main thread only)


LATEX_AND_EXPR = (LatexExtractionConfig(), ExprExtractionConfig())


def is_value(item: Any) -> bool:
    return isinstance(item, (sympy.Basic, sympy.MatrixBase))


def as_value(item: Any) -> Any:
    """Matrices come back mutable; an immutable one is a sympy.Basic, safe to cache and to size."""
    return sympy.ImmutableMatrix(item) if isinstance(item, sympy.MatrixBase) else item


_SYMBOL_COMMAND = r"\\(?:pi|tau|infty|alpha|beta|gamma|delta|theta|lambda|mu|sigma|phi|omega)(?![A-Za-z])"


UNBRACED_FRAC = re.compile(rf"\\([dtc]?frac)\s*({_SYMBOL_COMMAND}|[A-Za-z0-9])\s*({_SYMBOL_COMMAND}|[A-Za-z0-9])")


# ---------------------------------------------------------------------------------------------
# Normalisation of an answer string (response or reference)


_WRAPPERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("**", "**"))


_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


THOUSANDS = re.compile(r"[-+]?[1-9]\d{0,2}(?:(?:,|\{,\}|\\,| )\d{3})+(?:\.\d+)?%?")


_SCIENTIFIC = re.compile(r"([-+]?\d+(?:\.\d+)?)[eE]([-+]?\d+)")


# LaTeX's parser reads 2(3) as the mixed number 2+3; it is a product
_NUMBER_TIMES_PARENTHESIS = re.compile(r"(?<=[\d)])\s*\((?=[-+]?\d+(?:\.\d+)?\))")


MATH_WORDS = {"pi", "e", "i", "sqrt", "infty", "inf", "infinity", "ln", "log", "sin", "cos", "tan"}


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
    text = UNBRACED_FRAC.sub(r"\\\1{\2}{\3}", text)
    text = _NUMBER_TIMES_PARENTHESIS.sub(r"\\cdot(", text)
    if THOUSANDS.fullmatch(text):
        text = re.sub(r",|\{,\}|\\,| ", "", text)
    scientific = _SCIENTIFIC.fullmatch(text)
    if scientific:
        text = f"{scientific.group(1)}\\times 10^{{{scientific.group(2)}}}"
    with_unit = _NUMBER_WITH_UNIT.fullmatch(text)
    if with_unit:
        unit = with_unit.group("unit")
        single_letter_glued = len(unit) == 1 and not with_unit.group("space")
        if unit.lower() not in MATH_WORDS and not single_letter_glued:
            text = with_unit.group("number")
    if "\\" not in text:
        text = text.replace("**", "^")
        text = re.sub(r"(?<![A-Za-z\\])pi(?![A-Za-z])", r"\\pi", text)
        text = re.sub(r"(?<![A-Za-z])(?:infinity|inf)(?![A-Za-z])", r"\\infty", text)
    return text


def brace_depth(text: str) -> int:
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


def step_timeout() -> int | None:
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
        parsed = parse(candidate, extraction_config=LATEX_AND_EXPR, parsing_timeout=timeout, raise_on_error=True)
        for item in parsed:
            if is_value(item):
                return as_value(item)
    return None


def parse_answer(text: str, in_latex: bool = True) -> Any:
    """The value of a normalised answer (sympy, or a matrix), or None when math-verify finds nothing.

    The reference and marked answers both come here: the text is read as LaTeX, so a bare
    `x^2+2x+1`, `[0,1)` or `x \\geq 5` is an expression, an interval or an inequality, not the number
    math-verify's plain-text extraction would pick out of it. `in_latex`: see `in_math_mode`.
    """
    return _parse_cached(text, in_latex, step_timeout())


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
