"""The rules of what a run config refuses to combine (flows/compatibility.py): each refuses its example in one line
before any work, docs/compatibility.md is generated from them and current, and the loaded config of every
combination a rule does not name passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlvr.errors import ConfigError
from rlvr.flows.compatibility import EXAMPLES, RULES, applying
from rlvr.flows.compatibility_page import compatibility_markdown
from rlvr.flows.config import load_config, with_placement

PAGE = Path(__file__).resolve().parent.parent / "docs" / "compatibility.md"


def test_every_rule_has_an_example_and_refuses_it_in_one_line_naming_its_keys():
    assert set(EXAMPLES) == {rule.name for rule in RULES}
    for rule in RULES:
        with pytest.raises(ConfigError) as refused:
            load_config(None, EXAMPLES[rule.name])
        message = str(refused.value)
        assert message == rule.message(_unchecked(EXAMPLES[rule.name])), rule.name
        assert "\n" not in message and any(key.split(".")[0] in message for key in rule.keys), rule.name


def _unchecked(overrides: list[str]):
    """The config of `overrides` as validated, before the rules (to read what a rule says of it)."""
    from rlvr.flows.config import _one_source_as_list, _set_path, parse_override, run_config_type

    tree: dict = {}
    for text in overrides:
        _set_path(tree, *parse_override(text))
    _one_source_as_list(tree)
    return run_config_type().model_validate(tree)


def test_each_example_breaks_its_own_rule_first():
    for rule in RULES:
        assert applying(_unchecked(EXAMPLES[rule.name]))[0] is rule


def test_the_page_is_generated_from_the_rules():
    assert PAGE.read_text() == compatibility_markdown(), (
        "docs/compatibility.md is stale: python -m rlvr.flows.compatibility_page > docs/compatibility.md"
    )


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["env.type=calculator"],
        # retry shows the problem's prompt: hints reach it (in a template the tiny model reads)
        ["env.type=retry", "select.hints.enabled=true", "select.hints.template={prompt}{hint}"],
        ["synthesize.source.verifier=judge"],  # a judge on one-turn rollouts
        ["label.reward=rlpr", "flow.async_level=1"],
        ["train.data_parallel=2", "env.type=calculator", "allocate.type=knapsack"],
        ["rollout.type=openai", "rollout.prompt_as=text"],  # one turn: text prompts are allowed
    ],
)
def test_what_no_rule_names_loads(overrides):
    assert applying(load_config(None, overrides)) == []


def test_a_resume_that_moves_a_run_onto_ranks_is_refused_by_the_same_rules():
    cfg = load_config(None, ["run_id=a", "flow.async_level=1"])
    with pytest.raises(ConfigError, match="flow.async_level > 0 needs train.data_parallel = 1"):
        with_placement(cfg, ["train.data_parallel=2"])
