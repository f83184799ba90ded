"""The skills generator (verifiers/skills.py): seeded and deterministic, distinct prompts, category
labels, every answer verified by the arithmetic verifier, and rows a problem source can hand on."""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter, ValidationError

from rlvr.data.sources import SOURCES, SkillsSource, SkillsSourceConfig
from rlvr.trainer.tiny_model import VOCAB
from rlvr.verifiers.arithmetic import ArithmeticVerifier
from rlvr.verifiers.skills import CATEGORIES, DEFAULT_CATEGORIES, SkillsSpec, category_space, generate, rewrite

ALL = SkillsSpec(categories=list(CATEGORIES), per_category=60)


def test_same_seed_same_rows_other_seed_other_draw():
    assert generate(ALL, 3) == generate(ALL, 3)
    assert [r["prompt"] for r in generate(ALL, 3)] != [r["prompt"] for r in generate(ALL, 4)]


def test_prompts_are_distinct_across_categories():
    rows = generate(SkillsSpec(categories=list(CATEGORIES), per_category=1000), 0)
    prompts = [r["prompt"] for r in rows]
    assert len(prompts) == len(set(prompts))


def test_every_answer_verifies_and_is_canonical():
    verifier = ArithmeticVerifier()
    for row in generate(SkillsSpec(categories=list(CATEGORIES), per_category=1000), 0):
        assert verifier.score(row["answer"], row["answer"]).status == "ok"
        assert row["answer"] == str(int(row["answer"])) and int(row["answer"]) >= 0


@pytest.mark.parametrize("category", sorted(CATEGORIES))
def test_each_category_computes_its_rule(category):
    """The answer is what the prompt's expression evaluates to (Python's precedence is the generator's)."""
    for prompt, answer in category_space(category, 2):
        assert prompt.endswith("=")
        assert eval(prompt[:-1]) == int(answer)  # our own digit-and-operator strings


def test_rows_carry_category_and_source_fields():
    spec = SkillsSpec(categories=["zero", "copy", "add"], per_category=20)
    rows = generate(spec, 1)
    assert [r["source_index"] for r in rows] == list(range(len(rows)))
    assert {r["category"] for r in rows} == {"zero", "copy", "add"}
    assert all(r["domain"] == "arithmetic" and json.loads(r["params"]) == spec.model_dump() for r in rows)
    counts = {c: sum(r["category"] == c for r in rows) for c in spec.categories}
    assert counts == {"zero": 20, "copy": 20, "add": 20}
    # Round-robin: every prefix is balanced across categories.
    assert [r["category"] for r in rows[:3]] == ["zero", "copy", "add"]


def test_prompts_use_only_the_tiny_models_characters():
    tokens = set(VOCAB)
    for row in generate(SkillsSpec(categories=list(CATEGORIES), per_category=1000, digits=3), 0):
        assert set(row["prompt"]) <= tokens and set(row["answer"]) <= tokens


def test_a_small_category_gives_all_it_has_and_shared_prompts_go_to_the_first_category():
    rows = generate(SkillsSpec(categories=["succ", "add"], per_category=1000), 0)
    add_prompts = {r["prompt"] for r in rows if r["category"] == "add"}
    assert "3+1=" not in add_prompts and "3+2=" in add_prompts
    assert len(add_prompts) == 100 - 10  # a+1 for a in 0..9 belongs to succ


def test_unknown_or_repeated_categories_are_refused():
    with pytest.raises(ValidationError, match="unknown categories"):
        SkillsSpec(categories=["zero", "divide"])
    with pytest.raises(ValidationError, match="repeat"):
        SkillsSpec(categories=["zero", "zero"])


def test_the_source_rows_pass_the_synthesize_checks():
    """What the pipeline's synthesize stage would do with the default source: nothing quarantined."""
    from rlvr.data.validate import validate

    source = SkillsSource(SkillsSourceConfig())
    rows = list(source.rows(0))
    assert rows == list(source.rows(0))
    assert [{k: v for k, v in r.items() if k != "solution"} for r in rows] == generate(SkillsSpec(), 0)
    assert rows[0]["prompt"] == "89*0=" and rows[0]["solution"] == "89 * 0 = 0. The answer is 0."  # GHPO's hints
    assert {r["category"] for r in rows} == set(DEFAULT_CATEGORIES)
    accepted, rejected, _ = validate(rows, "skills", "arithmetic", max_prompt_chars=48)
    assert rejected == [] and len(accepted) == len(rows) > 700
    assert SkillsSourceConfig(categories=["copy"], per_category=5).type == "skills"


def test_the_source_is_registered_and_chosen_by_type():
    cfg = TypeAdapter(SOURCES.config_type()).validate_python(
        {"type": "skills", "categories": ["succ"], "per_category": 3}
    )
    source = SOURCES.make(cfg)
    assert isinstance(source, SkillsSource)
    assert [r["category"] for r in source.rows(0)] == ["succ"] * 3


@pytest.mark.parametrize(
    ("prompt", "mode", "expected"),
    [
        ("57+1=", "simplify", ("7+1=", "8")),
        ("57*10=", "simplify", ("7*10=", "70")),
        ("57-10=", "simplify", None),  # 7-10 would be negative
        ("7+1=", "simplify", None),  # nothing smaller
        ("12+12=", "simplify", None),  # double keeps its two equal operands
        ("57+1=", "diversify", ("75+1=", "76")),
        ("91-1=", "diversify", ("19-1=", "18")),
        ("50*1=", "diversify", None),  # 05 has a leading zero
        ("3+5=", "diversify", ("5+3=", "8")),
        ("3*5=", "diversify", ("5*3=", "15")),
        ("5-3=", "diversify", None),  # not commutative
        ("4+4=", "diversify", None),
        ("x+1=", "simplify", None),
    ],
)
def test_rewrites_keep_the_rule_and_compute_the_new_answer(prompt, mode, expected):
    assert rewrite(prompt, mode) == expected
    assert SkillsSource(SkillsSourceConfig()).rewrite(prompt, "", mode) == expected


def test_an_unknown_rewrite_mode_is_refused():
    with pytest.raises(ValueError, match="unknown rewrite mode 'harder'"):
        rewrite("57+1=", "harder")
