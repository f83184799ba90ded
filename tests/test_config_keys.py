"""No key is silently ignored (issue 51): every key of the run config, set to a value other than its default, either
reaches the config the run stores (its `config` artifact, what `rlvr run` computes from) with that value, or is
refused when the config is loaded, in one line that names it. The walk covers every section, every variant of the
sections chosen by `type` and every optional sub-section."""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal, get_args, get_origin

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from rlvr.errors import ConfigError
from rlvr.flows.config import load_config, run_config_type

# What a key needs beside it to be set at all: the required fields of an optional sub-section, or the keys that
# make a key meaningful (an environment's keys need an environment; RLPR's need RLPR).
CONTEXT: dict[str, list[str]] = {
    "reward.judge": ["reward.judge.base_url=http://127.0.0.1:9/v1", "reward.judge.model=m"],
    "reward.model": ["reward.model.urls=[http://127.0.0.1:9]", "reward.model.name=rm"],
    "label.judge": ["label.judge.base_url=http://127.0.0.1:9/v1", "label.judge.model=m"],
    "label.reward_model": ["label.reward_model.urls=[http://127.0.0.1:9]", "label.reward_model.name=rm"],
    "filter.std": ["filter.enabled=true"],
}
# Values the walk cannot make up from a key's type (a free-form string, a mapping, a list).
VALUES: dict[str, str] = {
    "run_id": "walked",
    "data": "another-run",
    "flow.executor.address": "tcp://127.0.0.1:8786",
    "openlineage.transport": "{type: console}",
    "openlineage.namespace": "walk",
    "env.type": "retry",
    "env.verifier": "final_number",
    "env.options": "{feedback: Again.}",
    "reward.judge.base_url": "http://127.0.0.1:10/v1",
    "reward.judge.model": "other",
    "reward.judge.api_key_env": "RLVR_WALK_KEY",
    "reward.judge.template": "Q {question} R {reference} A {response}",
    "reward.model.urls": "[http://127.0.0.1:10]",
    "reward.model.model": "other",
    "reward.model.api_key_env": "RLVR_WALK_KEY",
    "reward.model.name": "other",
    "policy.model": "smollm2-135m-instruct",
    "policy.checkpoint": "checkpoints-abc",
    "policy.lora.target_modules": "[q_proj]",
    "policy.device": "cpu",
    "synthesize.sources": "[{type: arithmetic}]",
    "synthesize.decontaminate.eval_sets": "[{type: arithmetic, count: 5}]",
    "warmstart.split": "train",
    "warmstart.env_options": "{python: true}",
    "difficulty.splits": "[train]",
    "label.verifier": "final_number",
    "label.rlpr.debias_prefix": "Answer:",
    "evaluate.split": "warmup",
    "train.grpo.advantage_components": "{correct: 1.0}",
    "rollout.base_url": "http://127.0.0.1:11/v1",
    "rollout.model": "served",
    "rollout.api_key_env": "RLVR_WALK_KEY",
    "rollout.dtype": "float16",
    "rollout.llm_args": "{max_model_len: 512}",
    "rollout.sync_dir": "/tmp/rlvr-walk-sync",
    "rollout.sync_path": "/reload",
    "rollout.sync_payload": "{lora: true}",
    "select.arms": "difficulty_label",
    "select.splits": "[train]",
    "select.hints.template": "{prompt} Hint: {hint}",
}
# Keys the walk reaches that a user cannot set on their own, with why.
NOT_USER_KEYS = {
    "label.judge": "a copy of reward.judge, which every stage that scores answers reads (flows/config.py)",
    "label.reward_model": "a copy of reward.model, as above",
}


def _leaves(model: type[BaseModel], prefix: str, needs: list[str]) -> Iterator[tuple[str, FieldInfo, list[str]]]:
    """Every leaf key of `model` under `prefix`, with the overrides it needs beside it (a variant's `type`, an
    optional section's required fields)."""
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        if any(path == key or path.startswith(key + ".") for key in NOT_USER_KEYS):
            continue
        if name == "type" and any(need.startswith(f"{path}=") for need in needs):
            continue  # a variant's tag, set by the walk itself
        variants = _models(info.annotation)
        if not variants:
            yield path, info, needs
            continue
        for variant in variants:
            extra = list(needs) + CONTEXT.get(path, [])
            if len(variants) > 1 and "type" in variant.model_fields:
                extra.append(f"{path}.type={variant.model_fields['type'].default}")
            yield from _leaves(variant, path + ".", extra)


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field holds (one, a union's variants, an optional one), or none for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is typing.Annotated:
        return _models(args[0])
    if origin in (typing.Union, types.UnionType):
        found = [m for a in args for m in _models(a)]
        plain = [a for a in args if a is not type(None) and not _models(a)]
        return found if found and not plain else []
    return []


def _candidates(path: str, info: FieldInfo) -> list[Any]:
    """Values other than the default to try, the first valid one used."""
    if path in VALUES:
        return [VALUES[path]]
    default = info.get_default(call_default_factory=True)
    annotation = info.annotation
    optional = get_origin(annotation) in (typing.Union, types.UnionType)
    kind = next(a for a in get_args(annotation) if a is not type(None)) if optional else annotation
    if get_origin(kind) is Literal:
        return [v for v in get_args(kind) if v != default]
    if kind is bool:
        return [not default]
    if kind is int:
        base = default if isinstance(default, int) else 1
        return [base + 1, base * 2, base - 1, 1, 2]
    if kind is float:
        base = default if isinstance(default, float | int) else 0.5
        return [base * 2 if base else 0.5, base + 0.5, base / 2, 0.5, 0.1, 0.9]
    if get_origin(kind) is tuple:
        return ["[0.2, 0.8]", "[0.1, 0.5, 0.9]"]
    raise AssertionError(f"no value to try for {path} ({annotation}): add one to VALUES")


def _dumped(cfg: Any, path: str) -> Any:
    node = json.loads(cfg.model_dump_json())
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return "<absent>"
        node = node[part]
    return node


def _walk() -> list[tuple[str, FieldInfo, list[str]]]:
    return list(_leaves(run_config_type(), "", []))


def test_the_walk_reaches_every_section_and_variant():
    paths = {path for path, _, _ in _walk()}
    assert len(paths) > 150
    for key in ("env.solved_at", "select.alpha", "allocate.unknown", "rollout.base_url", "filter.std.beta"):
        assert key in paths, key


@pytest.mark.parametrize(("path", "info", "needs"), _walk(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_key_set_takes_effect_or_is_refused_in_one_line_naming_it(path, info, needs):
    tried = []
    for value in _candidates(path, info):
        text = value if isinstance(value, str) else json.dumps(value)
        try:
            cfg = load_config(None, [*needs, f"{path}={text}"])
        except ConfigError as refused:
            message = str(refused)
            tried.append(message)
            if "\n" in message:
                pytest.fail(f"{path}: a refusal of more than one line: {message!r}")
            if _names(message, path):
                return  # refused, naming the key
            continue  # the value was bad (a bound), not the key: try another
        found, before = _dumped(cfg, path), _dumped(load_config(None, needs), path)
        assert found != "<absent>", f"{path}={text} is accepted but is not in the config the run stores"
        if found == before and _same(found, value):
            continue  # the value tried is the run's own default (e.g. the run's minibatches): try another
        assert found != before, f"{path}={text} is accepted but the stored config keeps {before!r}"
        return
    pytest.fail(f"{path}: no value tried was accepted or refused by name: {tried}")


def _same(found: Any, value: Any) -> bool:
    """Whether a stored value is the value tried (given as YAML text or as a number)."""
    import yaml

    tried = yaml.safe_load(value) if isinstance(value, str) else value
    return found == tried or (isinstance(tried, list) and found == list(tried))


def _names(message: str, path: str) -> bool:
    """Whether a refusal names the key: its full path, or (for a key in a variant) its section and its name."""
    parts = path.split(".")
    return path in message or (parts[0] in message and parts[-1] in message)
