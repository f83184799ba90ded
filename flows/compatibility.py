"""What a run config refuses to combine, in one place: each rule names the keys it involves, when it applies and
why, and `refuse_incompatible` turns the first that applies into one line before any work (flows/config.py calls it
whenever a run's config is loaded or a resume moves it). docs/compatibility.md is generated from `RULES`
(flows/compatibility_page.py; tests/test_compatibility.py checks the page is current), and the covering array of
combinations in tests/test_combinations.py expects exactly these refusals.

A rule is for a combination that cannot be right: one whose run would train on a wrong signal, ignore a key, or
fail halfway. A value that is wrong on its own belongs to its section's pydantic validator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlvr.errors import ConfigError

__all__ = ["EXAMPLES", "RULES", "Rule", "applying", "refuse_incompatible"]

# Verifiers whose verdicts a model gives (the label stage asks it, with failures kept out of the update); an
# environment scores its answers in its own process, so it cannot ask them (verifiers/cache.py MODEL_VERIFIERS).
MODEL_VERIFIERS = ("judge", "reward_model")
# Environments that show the model the problem's own prompt (so GHPO's hints and CLPO's rewrites reach it).
PROMPT_ENVIRONMENTS = ("one_turn", "calculator", "retry")


@dataclass(frozen=True)
class Rule:
    """A combination refused: `keys` it involves, `when` it applies (to a validated run config), and the one line
    `message` a user reads (what is refused, why, what to do)."""

    name: str
    keys: tuple[str, ...]
    when: Callable[[Any], bool]
    message: Callable[[Any], str]


def _model_reward(cfg: Any) -> str | None:
    """The model-given reward the config asks for (`label.reward=rlpr`, `label.verifier`, a source's verifier), or
    None. Problems of a data run (`rlvr run --data`) name their verifier themselves: the label stage checks those."""
    if cfg.label.reward == "rlpr":
        return "label.reward=rlpr"
    if cfg.label.verifier in MODEL_VERIFIERS:
        return f"label.verifier={cfg.label.verifier}"
    for i, source in enumerate(cfg.synthesize.sources):
        if getattr(source, "verifier", None) in MODEL_VERIFIERS:
            key = "synthesize.source" if len(cfg.synthesize.sources) == 1 else f"synthesize.sources.{i}"
            return f"{key}.verifier={source.verifier}"
    return None


def _unreadable_by_tiny(template: str) -> bool:
    """Whether a hint template's own text (its fields aside) has characters outside the tiny model's vocabulary."""
    from rlvr.trainer.tiny_model import VOCAB

    text = template.replace("{prompt}", "").replace("{hint}", "")
    return any(char not in VOCAB for char in text)


def _rlpr(cfg: Any) -> bool:
    return bool(cfg.label.reward == "rlpr")


def _unbounded_reward(cfg: Any) -> str | None:
    """What makes the config's rewards leave [0, 1] (a game's payoffs, DAPO's overlong penalty), or None."""
    if cfg.env.type in ("gym", "textarena"):
        return f"env.type={cfg.env.type} (a game's payoffs: -0.1 for an unreadable move, -1 for a lost game)"
    if cfg.train.grpo.overlong == "penalty":
        return "train.grpo.overlong=penalty (down to -1 at the length limit)"
    return None


def _ranks(cfg: Any) -> bool:
    return bool(cfg.train.data_parallel > 1)


RULES: tuple[Rule, ...] = (
    Rule(
        "environment with a model-given reward",
        ("env.type", "label.reward", "label.verifier", "synthesize.sources.*.verifier"),
        lambda cfg: cfg.env.multi_turn and _model_reward(cfg) is not None,
        lambda cfg: (
            f"env.type={cfg.env.type} scores its episodes itself, in process; {_model_reward(cfg)} is a model's "
            "reward, which the label stage gives to one-turn rollouts only: use env.type=one_turn or a verifier"
        ),
    ),
    Rule(
        "environment verifier asked of a model",
        ("env.verifier",),
        lambda cfg: cfg.env.verifier in MODEL_VERIFIERS,
        lambda cfg: (
            f"env.verifier={cfg.env.verifier} is a model's verdict, which an environment cannot ask in process (a "
            "failed call would be scored); the label stage asks models for one-turn rollouts (docs/rewards.md)"
        ),
    ),
    Rule(
        "hints or rewrites on an environment that hides the prompt",
        ("select.hints.enabled", "restructure.enabled", "env.type"),
        lambda cfg: (cfg.select.hints.enabled or cfg.restructure.enabled) and cfg.env.type not in PROMPT_ENVIRONMENTS,
        lambda cfg: (
            f"{'select.hints.enabled (GHPO)' if cfg.select.hints.enabled else 'restructure.enabled (CLPO)'} changes "
            f"the problem's prompt, which env.type={cfg.env.type} does not show the model (it opens with its own "
            f"observation); use one of {', '.join(PROMPT_ENVIRONMENTS)}, or set it off"
        ),
    ),
    Rule(
        "RLPR with CLPO",
        ("label.reward", "restructure.enabled"),
        lambda cfg: _rlpr(cfg) and cfg.restructure.enabled,
        lambda cfg: (
            "label.reward=rlpr does not combine with restructure.enabled: CLPO reads each group's accuracy, which "
            "RLPR does not give; set one of them off"
        ),
    ),
    Rule(
        "RLPR with GHPO",
        ("label.reward", "select.hints.enabled"),
        lambda cfg: _rlpr(cfg) and cfg.select.hints.enabled,
        lambda cfg: (
            "label.reward=rlpr does not combine with select.hints: GHPO changes prompts, whose debiasing terms RLPR "
            "keeps per problem; set one of them off"
        ),
    ),
    Rule(
        "async sampling with CLPO",
        ("flow.async_level", "restructure.enabled"),
        lambda cfg: cfg.flow.async_level > 0 and cfg.restructure.enabled,
        lambda cfg: (
            "flow.async_level > 0 does not combine with restructure.enabled (CLPO adds the problems the next step "
            "samples from, so sampling cannot run ahead of it); set one of them off"
        ),
    ),
    Rule(
        "async sampling on ranks",
        ("flow.async_level", "train.data_parallel"),
        lambda cfg: cfg.flow.async_level > 0 and _ranks(cfg),
        lambda cfg: "flow.async_level > 0 needs train.data_parallel = 1 (the ranks recompute π_old)",
    ),
    Rule(
        "episodes sent as text",
        ("env.type", "rollout.prompt_as"),
        lambda cfg: cfg.env.multi_turn and getattr(cfg.rollout, "prompt_as", "token_ids") == "text",
        lambda cfg: (
            f"env.type={cfg.env.type} sends each conversation as token ids; rollout.prompt_as=text would tokenize "
            "earlier turns again: set rollout.prompt_as=token_ids"
        ),
    ),
    Rule(
        "vLLM on ranks",
        ("rollout.type", "train.data_parallel"),
        lambda cfg: _ranks(cfg) and cfg.rollout.type == "vllm",
        lambda cfg: (
            "rollout.type=vllm is not split over train.data_parallel ranks yet (each rank would need an engine of "
            "its own); use the transformers engine, which samples on every rank"
        ),
    ),
    Rule(
        "batch seeding on ranks",
        ("rollout.seeding", "train.data_parallel"),
        lambda cfg: _ranks(cfg) and getattr(cfg.rollout, "seeding", "row") == "batch",
        lambda cfg: (
            "rollout.seeding=batch cannot be split over train.data_parallel ranks (a row's tokens would depend on the "
            "rows beside it); leave rollout.seeding unset or set it to row"
        ),
    ),
    Rule(
        "DisCO on ranks",
        ("train.grpo.objective", "train.data_parallel"),
        lambda cfg: _ranks(cfg) and cfg.train.grpo.objective == "disco",
        lambda cfg: (
            "train.grpo.objective=disco couples a group's rows and the minibatch's KL, which ranks holding parts of a "
            "minibatch cannot: use train.data_parallel=1 with it"
        ),
    ),
    Rule(
        "mismatch correction on ranks",
        ("train.grpo.correction", "train.data_parallel"),
        lambda cfg: _ranks(cfg) and cfg.train.grpo.correction != "none",
        lambda cfg: (
            f"train.grpo.correction={cfg.train.grpo.correction} weighs the sampler's log-probs against the trainer's, "
            "which the ranks recompute for themselves: use train.data_parallel=1 with it"
        ),
    ),
    Rule(
        "BNPO on rewards outside [0, 1]",
        ("train.grpo.advantage_scale", "env.type", "train.grpo.overlong"),
        lambda cfg: cfg.train.grpo.advantage_scale == "beta" and _unbounded_reward(cfg) is not None,
        lambda cfg: (
            f"train.grpo.advantage_scale=beta (BNPO) reads each group's mean reward as a pass rate in [0, 1], and "
            f"{_unbounded_reward(cfg)} pays outside it; use another advantage_scale"
        ),
    ),
    Rule(
        "hints the tiny model cannot read",
        ("select.hints.template", "policy.model"),
        lambda cfg: (
            cfg.select.hints.enabled and cfg.policy.model == "tiny" and _unreadable_by_tiny(cfg.select.hints.template)
        ),
        lambda cfg: (
            "select.hints.enabled with policy.model=tiny: the hint template's text is unknown to the tiny model (its "
            "vocabulary is digits and + - * =), so its hinted prompts would be mostly unknown tokens; set "
            "select.hints.template='{prompt}{hint}' or a policy.model that reads text"
        ),
    ),
)


def applying(cfg: Any) -> list[Rule]:
    """The rules a validated run config breaks, in `RULES` order."""
    return [rule for rule in RULES if rule.when(cfg)]


def refuse_incompatible(cfg: Any) -> None:
    """A one-line ConfigError for the first rule `cfg` breaks; nothing when it breaks none."""
    broken = applying(cfg)
    if broken:
        raise ConfigError(broken[0].message(cfg))


# One config each rule refuses (overrides of the defaults): the page's messages, and a test that each rule fires.
EXAMPLES: dict[str, list[str]] = {
    "environment with a model-given reward": ["env.type=calculator", "synthesize.source.verifier=judge"],
    "environment verifier asked of a model": ["env.type=calculator", "env.verifier=judge"],
    "hints or rewrites on an environment that hides the prompt": [
        "env.type=gym",
        "env.options={make: gem, id: 'game:GuessTheNumber-v0-easy'}",
        "select.hints.enabled=true",
    ],
    "hints the tiny model cannot read": ["select.hints.enabled=true"],
    "RLPR with CLPO": ["label.reward=rlpr", "restructure.enabled=true"],
    "RLPR with GHPO": ["label.reward=rlpr", "select.hints.enabled=true"],
    "async sampling with CLPO": ["flow.async_level=1", "restructure.enabled=true"],
    "async sampling on ranks": ["flow.async_level=1", "train.data_parallel=2"],
    "episodes sent as text": ["env.type=retry", "rollout.type=openai", "rollout.prompt_as=text"],
    "vLLM on ranks": ["rollout.type=vllm", "train.data_parallel=2"],
    "DisCO on ranks": ["train.grpo.objective=disco", "train.data_parallel=2"],
    "mismatch correction on ranks": ["train.grpo.correction=tis", "train.data_parallel=2"],
    "BNPO on rewards outside [0, 1]": [
        "train.grpo.advantage_scale=beta",
        "train.grpo.overlong=penalty",
        "train.grpo.overlong_buffer=1",
    ],
    "batch seeding on ranks": ["rollout.seeding=batch", "train.data_parallel=2"],
}
