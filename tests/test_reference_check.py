"""`Verifier.reference_error`: the self-check the data stage quarantines on. For every built-in verifier a
usable reference gives None and a broken one the exact one-line reason; no reference ever makes it raise."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

import pytest

from rlvr.verifiers.base import MISSING_REFERENCE, Score, Verifier
from rlvr.verifiers.registry import get_verifier, registered

# ----------------------------------------------------------------------------------------------
# The default: the reference's text scored against itself


class ExactText(Verifier):
    """Rewards exactly the reference's text; "boom" makes it raise, "err" makes it report an error."""

    name = "exact_text"
    domain = "test"
    version = "1"

    def score(self, response: str, reference: Any) -> Score:
        if reference == "boom":
            raise RuntimeError("kaput")
        if reference == "err":
            return Score(0.0, "error", reason="reference is broken")
        if isinstance(reference, dict):
            return Score(
                float(response == json.dumps(reference)), "ok" if response == json.dumps(reference) else "wrong"
            )
        return Score(0.0, "wrong", reason="never right") if reference == "never" else Score(1.0, "ok")


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        ("42", None),
        ({"a": [1, 2]}, None),
        (None, MISSING_REFERENCE),
        ("  ", MISSING_REFERENCE),
        ("never", "the reference does not verify against itself (wrong: never right)"),
        ("err", "reference is broken"),
        ("boom", "scoring the reference against itself raised RuntimeError: kaput"),
        ({"a": {1, 2}}, "reference is not JSON-serialisable: Object of type set is not JSON serializable"),
    ],
)
def test_default_scores_the_reference_against_itself(reference, expected):
    assert ExactText().reference_error(reference) == expected


# ----------------------------------------------------------------------------------------------
# arithmetic and math


@pytest.mark.parametrize("reference", ["7", 7, "-12", "+3", "1.50", " 8 "])
def test_arithmetic_accepts_plain_numbers(reference):
    assert get_verifier("arithmetic").reference_error(reference) is None


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        ("", MISSING_REFERENCE),
        (None, MISSING_REFERENCE),
        ("x+1", "reference 'x+1' is not a plain number"),
        ("1e5", "reference '1e5' is not a plain number"),
        (True, "reference 'True' is not a plain number"),
    ],
)
def test_arithmetic_rejects_what_is_not_a_number(reference, expected):
    assert get_verifier("arithmetic").reference_error(reference) == expected


@pytest.mark.parametrize(
    "reference",
    ["\\frac{1}{2}", "x^2+1", "[0, 1)", "3.5", "\\text{(B)}", "B", 12, 2.5, "\\boxed{5}", "2006!", "12 cm"],
)
def test_math_accepts_parseable_references(reference):
    """ "B" earns ok only inside `$...$` or `\\boxed{}` in a response: parsed, not self-scored, it passes."""
    assert get_verifier("math").reference_error(reference) is None


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        ("", MISSING_REFERENCE),
        (None, MISSING_REFERENCE),
        ("\\frac{", "reference '\\\\frac{' could not be parsed"),
        ("x^", "reference 'x^' could not be parsed"),
        ("\\boxed{}", "reference '\\\\boxed{}' could not be parsed"),
        ("\\frac{1}{0}", "self-comparison: not comparable with the reference (ValueError)"),
        ("3^{1000000}", "self-comparison: reference would evaluate to an unbounded number of digits (limit 20000)"),
        (True, "math reference must be a non-empty string or a number, got bool"),
        (["1"], "math reference must be a non-empty string or a number, got list"),
    ],
)
def test_math_rejects_references_it_cannot_use(reference, expected):
    assert get_verifier("math").reference_error(reference) == expected


# ----------------------------------------------------------------------------------------------
# reasoning_gym


@pytest.fixture(scope="module")
def gcd_references() -> list[dict[str, Any]]:
    import reasoning_gym  # here, not at collection: every xdist worker collects this file

    dataset = reasoning_gym.create_dataset("gcd", size=3, seed=1)
    return [{"dataset": "gcd", "entry": json.loads(json.dumps(entry, default=str))} for entry in dataset]


def test_reasoning_gym_accepts_real_entries_as_dict_or_json(gcd_references):
    verifier = get_verifier("reasoning_gym")
    for reference in gcd_references:
        assert verifier.reference_error(reference) is None
        assert verifier.reference_error(json.dumps(reference)) is None


def test_reasoning_gym_accepts_entries_without_an_answer(gcd_references):
    """Datasets scored on metadata (rush_hour, graph_color, ...) store no answer: nothing to check."""
    entry = {**gcd_references[0]["entry"], "answer": None}
    assert get_verifier("reasoning_gym").reference_error({"dataset": "gcd", "entry": entry}) is None


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        (None, MISSING_REFERENCE),
        ("not json", "reference is not JSON"),
        (
            {"dataset": "gcd"},
            'reasoning_gym reference must be {"dataset": NAME, "entry": {question, answer, metadata}}',
        ),
        ({"dataset": "no_such_dataset", "entry": {"answer": "1"}}, "unknown reasoning-gym dataset 'no_such_dataset'"),
    ],
)
def test_reasoning_gym_rejects_bad_references(reference, expected):
    assert get_verifier("reasoning_gym").reference_error(reference) == expected


def test_reasoning_gym_flags_an_entry_its_scorer_rejects(gcd_references):
    """rearc compares the answer's grid with metadata tuples, which a JSON round trip turns into lists."""
    import reasoning_gym

    entry = json.loads(json.dumps(reasoning_gym.create_dataset("rearc", size=1, seed=1)[0], default=str))
    assert get_verifier("reasoning_gym").reference_error({"dataset": "rearc", "entry": entry}) == (
        "the entry's own answer is not rewarded (wrong: rearc: scorer gave 0.05; only 1.0 is rewarded)"
    )
    empty = {**gcd_references[0]["entry"], "answer": ""}
    assert get_verifier("reasoning_gym").reference_error({"dataset": "gcd", "entry": empty}) == (
        "the entry's own answer is not rewarded (unparseable: no answer (empty response or empty <answer> tag))"
    )


# ----------------------------------------------------------------------------------------------
# sql


@pytest.fixture(scope="module")
def shop_db(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("sql") / "shop.sqlite"
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE users (id INTEGER, name TEXT)")
    connection.executemany("INSERT INTO users VALUES (?, ?)", [(1, "ann"), (2, "bob")])
    connection.commit()
    connection.close()
    return str(path)


def test_sql_accepts_a_gold_query_that_runs(shop_db):
    reference = {"db": shop_db, "sql": "SELECT name FROM users ORDER BY id"}
    assert get_verifier("sql").reference_error(reference) is None
    assert get_verifier("sql").reference_error(json.dumps(reference)) is None


def test_sql_names_what_is_wrong_with_the_reference(shop_db, tmp_path):
    check = get_verifier("sql").reference_error
    missing = str(tmp_path / "gone.sqlite")
    assert check({"db": missing, "sql": "SELECT 1"}) == f"database file {missing!r} not found"
    assert (
        check({"db": shop_db, "sql": "SELECT age FROM users"})
        == "gold SQL failed: OperationalError: no such column: age"
    )
    assert check({"db": shop_db, "sql": "DROP TABLE users"}) == (
        "gold SQL refused: DROP statement refused; only one SELECT or WITH query is run"
    )
    assert check({"db": shop_db}) == 'sql reference needs a "db" path and a non-empty "sql" string'
    assert check("") == MISSING_REFERENCE


# ----------------------------------------------------------------------------------------------
# tool_call


@pytest.mark.parametrize(
    "reference",
    [
        [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}],
        '{"function": {"name": "f", "arguments": "{\\"flag\\": true}"}}',
        [],
    ],
)
def test_tool_call_accepts_calls_it_can_render(reference):
    assert get_verifier("tool_call").reference_error(reference) is None


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        (None, MISSING_REFERENCE),
        (
            [{"name": 3}],
            'tool_call reference must be a list of {"name": ..., "arguments": {...}} calls or its JSON string',
        ),
        ("[{", 'tool_call reference must be a list of {"name": ..., "arguments": {...}} calls or its JSON string'),
        (
            [{"name": "f", "arguments": {"x": {1}}}],
            "reference arguments are not JSON-serialisable: Object of type set is not JSON serializable",
        ),
    ],
)
def test_tool_call_rejects_malformed_calls(reference, expected):
    assert get_verifier("tool_call").reference_error(reference) == expected


# ----------------------------------------------------------------------------------------------
# text, format, math_format, code


@pytest.mark.parametrize(
    "reference",
    [
        "Paris",
        {"mode": "exact", "answer": ["", "Rome"]},
        {"mode": "choice", "answer": "(b)"},
        {"mode": "bleu", "references": ["the cat sat on the mat"], "threshold": 1.0},
        json.dumps({"mode": "choice", "answer": "C"}),
    ],
)
def test_text_accepts_usable_references(reference):
    assert get_verifier("text").reference_error(reference) is None


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        ("", MISSING_REFERENCE),
        ({"mode": "exact", "answer": "the"}, 'exact mode needs "answer": a non-empty string or a list of strings'),
        ({"mode": "choice", "answer": "AB"}, 'choice mode needs "answer": one letter A-Z'),
        ({"mode": "bleu", "references": []}, 'bleu mode needs "references": a non-empty list of strings'),
        ({"mode": "bleu", "references": ["x"], "threshold": 2}, "bleu threshold must be a number in [0, 1]"),
        (
            {"mode": "bleu", "references": [""]},
            "the reference does not verify against itself (unparseable: empty answer)",
        ),
        ({"mode": "regex"}, "unknown text mode 'regex'; known: exact, choice, bleu"),
        ("{oops", "text reference looks like JSON but does not parse"),
    ],
)
def test_text_rejects_bad_references(reference, expected):
    assert get_verifier("text").reference_error(reference) == expected


@pytest.mark.parametrize(
    "reference", [None, "", {"tags": ["answer"], "require_order": False}, '{"exactly_once": false}']
)
def test_format_accepts_options_and_the_defaults(reference):
    assert get_verifier("format").reference_error(reference) is None


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        ({"tags": []}, "format tags must be a non-empty list of tag names"),
        ({"tags": ["a", "a"]}, "format tags must not repeat"),
        ({"colour": "red"}, "unknown format options ['colour']; known: ['exactly_once', 'require_order', 'tags']"),
        ("{x", "format reference is not JSON"),
    ],
)
def test_format_rejects_bad_options(reference, expected):
    assert get_verifier("format").reference_error(reference) == expected


def test_math_format_checks_each_part():
    check = get_verifier("math_format").reference_error
    assert check("42") is None
    assert check({"math": "x^2", "format": {"tags": ["answer"]}}) is None
    assert check(None) == f"math: {MISSING_REFERENCE}"
    assert check({"math": "\\frac{"}) == "math: reference '\\\\frac{' could not be parsed"
    assert check({"math": "1", "format": {"tags": []}}) == "format: format tags must be a non-empty list of tag names"


@pytest.mark.parametrize(
    "reference",
    [{"tests": [{"input": "1\n", "output": "2"}]}, json.dumps({"asserts": ["assert add(1, 2) == 3"], "timeout_s": 1})],
)
def test_code_accepts_references_that_parse(reference):
    assert get_verifier("code").reference_error(reference) is None


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        (None, MISSING_REFERENCE),
        ({"tests": []}, "bad code reference: reference has no tests and no asserts"),
        ({"tests": [{"input": "1"}]}, "bad code reference: test 1 must be an object with a string 'output'"),
        (
            {"asserts": ["assert add(1, 2 == 3"]},
            "bad code reference: assert 1 does not compile: SyntaxError: '(' was never closed (check.py, line 1)",
        ),
        ({"tests": [{"output": "1"}], "solution": "import os"}, "bad code reference: unknown reference keys: solution"),
    ],
)
def test_code_rejects_bad_references_without_running_anything(reference, expected):
    assert get_verifier("code").reference_error(reference) == expected


# ----------------------------------------------------------------------------------------------
# Every registered verifier


@pytest.mark.parametrize("name", sorted(name for name, cls in registered().items() if cls.needs == "nothing"))
@pytest.mark.parametrize("reference", [[1, 2], {"not": "a reference"}, object(), "[" * 100_000, 3.5j])
def test_every_verifier_explains_a_bad_reference_without_raising(name, reference):
    reason = get_verifier(name).reference_error(reference)
    assert isinstance(reason, str) and reason and "\n" not in reason


@pytest.mark.parametrize("reference", [None, "", "[" * 100_000, [1, 2], {"not": "a reference"}])
def test_the_judge_reads_any_text_or_json_reference(reference):
    assert get_verifier("judge").reference_error(reference) is None


@pytest.mark.parametrize("reference", [object(), 3.5j])
def test_the_judge_explains_a_reference_it_cannot_read(reference):
    reason = get_verifier("judge").reference_error(reference)
    assert reason is not None and reason.startswith("a judge's reference must be text or JSON: Object of type")
