"""Arithmetic asked in words, for chat models: the question-style source and the final_number verifier, which
reads the answer's last number and so cannot be gamed by repeating the question (math evaluates it)."""

from __future__ import annotations

import json

import pytest

from rlvr.data.sources import ArithmeticSource, ArithmeticSourceConfig, expression_of, question_of
from rlvr.verifiers.arithmetic import FinalNumberVerifier, final_number
from rlvr.verifiers.registry import get_verifier


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("34 + 6 = 40.", "40"),
        ("7 - 12 = -5", "-5"),
        ("7-12=-5", "-5"),
        ("91 - 39", "39"),  # the question repeated: its last number is an operand
        ("91-39", "39"),  # a minus between digits is not the number's sign
        ("The answer is 1,234.", "1234"),
        ("It is (-3).", "-3"),
        ("+7", "7"),
        ("3.5 apples", "3.5"),
        ("no digits here", None),
    ],
)
def test_final_number_is_the_last_number_written(text: str, number: str | None) -> None:
    assert final_number(text) == number


def test_repeating_the_question_scores_wrong_under_final_number_and_ok_under_math() -> None:
    final, math = get_verifier("final_number"), get_verifier("math")
    assert isinstance(final, FinalNumberVerifier)
    assert math.score("91 - 39", "52").status == "ok"  # the hack a policy found against math
    echoed = final.score("91 - 39", "52")
    assert (echoed.status, echoed.value, echoed.extracted) == ("wrong", 0.0, "39")
    right = final.score("91 - 39 = 52.", "52")
    assert (right.status, right.value, right.extracted) == ("ok", 1.0, "52")
    silent = final.score("I cannot say.", "52")
    assert (silent.status, silent.reason) == ("unparseable", "response writes no number")
    assert final.score("52", "fifty").status == "error"


def test_question_style_prompts_round_trip_and_name_final_number() -> None:
    assert question_of("34+6*2=") == "What is 34 + 6 times 2? Answer with just the number."
    assert question_of("-3-6=") == "What is -3 - 6? Answer with just the number."
    assert expression_of(question_of("-3-6*2=")) == "-3-6*2="
    cfg = ArithmeticSourceConfig(style="question", digits=2, ops="+", count=3)
    source = ArithmeticSource(cfg)
    rows = list(source.rows(0))
    plain = list(ArithmeticSource(ArithmeticSourceConfig(digits=2, ops="+", count=3)).rows(0))
    assert [r["prompt"] for r in rows] == [question_of(p["prompt"]) for p in plain]  # same problems, in words
    assert [r["answer"] for r in rows] == [p["answer"] for p in plain]
    assert {r["category"] for r in rows} == {"d2t2+"} and {p["category"] for p in plain} == {"d2t2"}
    assert json.loads(rows[0]["params"])["style"] == "question" and "style" not in json.loads(plain[0]["params"])
    assert source.verifier == "final_number" and ArithmeticSource(ArithmeticSourceConfig()).verifier == "arithmetic"
    assert source.rewrite(question_of("2+3*4="), "14", "simplify") == (question_of("2+12="), "14")


def test_working_style_asks_for_the_working_and_keeps_its_style_through_rewrites() -> None:
    asked = question_of("34+6*2=", "working")
    assert asked == "What is 34 + 6 times 2? Show your working, then give the final answer as 'Answer: <number>'."
    assert expression_of(asked) == "34+6*2=" and expression_of(question_of("-3-6=")) == "-3-6="
    cfg = ArithmeticSourceConfig(style="working", digits=2, ops="+", count=3)
    source = ArithmeticSource(cfg)
    rows = list(source.rows(0))
    asked_plainly = list(ArithmeticSource(ArithmeticSourceConfig(style="question", digits=2, ops="+", count=3)).rows(0))
    assert [expression_of(r["prompt"]) for r in rows] == [expression_of(p["prompt"]) for p in asked_plainly]
    assert {r["category"] for r in rows} == {"d2t2+w"} and json.loads(rows[0]["params"])["style"] == "working"
    assert source.verifier == "final_number"
    assert source.rewrite(question_of("2+3*4=", "working"), "14", "simplify") == (question_of("2+12=", "working"), "14")
