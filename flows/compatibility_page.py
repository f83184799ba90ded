"""docs/compatibility.md, generated from the rules of flows/compatibility.py: each rule with its keys and the line a
user reads for its example config (`python -m rlvr.flows.compatibility_page > docs/compatibility.md`)."""

from __future__ import annotations

from rlvr.errors import ConfigError
from rlvr.flows.compatibility import EXAMPLES, RULES, Rule
from rlvr.flows.config import load_config

__all__ = ["compatibility_markdown"]


def compatibility_markdown() -> str:
    """docs/compatibility.md: every rule with its keys and its message as a user reads it, from `RULES`."""
    lines = [
        "# What does not combine",
        "",
        "Generated from `flows/compatibility.py` (`python -m rlvr.flows.compatibility_page > docs/compatibility.md`);",
        "tests/test_compatibility.py fails when this page and the code differ. Every combination not listed here",
        "runs; tests/test_combinations.py runs a covering array of all pairs of the main factors (environment,",
        "reward, selection, allocation, filter, hints, GRPO variant, async sampling, ranks, engine) and checks that",
        "every pair is either run or refused by one of these rules. A refusal is one line before any work.",
        "",
        "| rule | keys | what a user reads |",
        "|---|---|---|",
    ]
    for rule in RULES:
        keys = ", ".join(f"`{key}`" for key in rule.keys)
        lines.append(f"| {rule.name} | {keys} | {_example_message(rule)} |")
    return "\n".join(lines) + "\n"


def _example_message(rule: Rule) -> str:
    """The rule's message for the config of its example (EXAMPLES), as the user reads it."""
    try:
        load_config(None, EXAMPLES[rule.name])
    except ConfigError as refused:
        return str(refused).replace("|", "\\|")
    raise AssertionError(f"the example of rule {rule.name!r} is not refused")  # tests/test_compatibility.py


if __name__ == "__main__":
    print(compatibility_markdown(), end="")
