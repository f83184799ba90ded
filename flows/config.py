"""The run configuration: one typed section per stage, defined next to the stage; YAML plus --set overrides.

The defaults are the embedded default: the built-in arithmetic generator, the tiny model on CPU,
a short warm start, uniform selection and budgets, GRPO. Every run commits its resolved config as
the `config` artifact, the root of its lineage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlvr.storage.errors import ConfigError
from rlvr.storage.ids import canonical_json
from rlvr.storage.stage import Built, StageOutput, commit_stage, rows_to_table
from rlvr.storage.store import Store
from rlvr.tasks.allocate import AllocateConfig
from rlvr.tasks.checkpoint import CheckpointConfig
from rlvr.tasks.difficulty import DifficultyConfig
from rlvr.tasks.evaluate import EvaluateConfig
from rlvr.tasks.label import LabelConfig
from rlvr.tasks.rollout import RolloutConfig
from rlvr.tasks.select import SelectConfig
from rlvr.tasks.synthesize import SynthesizeConfig
from rlvr.tasks.train import TrainConfig
from rlvr.tasks.warmstart import WarmstartConfig
from rlvr.trainer.policy import PolicyConfig

CONFIG_CODE_VERSION = "1"


class FlowConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps_per_subflow: int = Field(
        50, ge=1, description="RL steps grouped in one Prefect subflow (a subflow costs ~1 s to start)"
    )


class RunConfig(BaseModel):
    """Everything that determines a run's results (the store location does not)."""

    model_config = ConfigDict(extra="forbid")

    run_id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    seed: int = 0
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    synthesize: SynthesizeConfig = Field(default_factory=SynthesizeConfig)
    warmstart: WarmstartConfig = Field(default_factory=WarmstartConfig)
    difficulty: DifficultyConfig = Field(default_factory=DifficultyConfig)
    select: SelectConfig = Field(default_factory=SelectConfig)
    allocate: AllocateConfig = Field(default_factory=AllocateConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    label: LabelConfig = Field(default_factory=LabelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    flow: FlowConfig = Field(default_factory=FlowConfig)


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {dotted!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=c` -> ("a.b", c parsed as YAML, so numbers, booleans and lists get their types)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"bad --set {text!r}: expected key=value, e.g. --set train.steps=200")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    if first["type"] == "extra_forbidden":
        return f"unknown config key {where!r}; see `rlvr run --help` or README for the keys"
    return f"config key {where!r}: {first['msg']} (got {first.get('input')!r})"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults, then the YAML file, then each `key=value` override; validated, with one-line errors."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {str(exc).splitlines()[0]}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, not {type(loaded).__name__}")
        tree = loaded
    for text in overrides or []:
        key, value = parse_override(text)
        _set_path(tree, key, value)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def config_from_json(text: str) -> RunConfig:
    return RunConfig.model_validate(json.loads(text))


def commit_config(store: Store, cfg: RunConfig) -> str:
    """Commit the resolved config as the run's `config` artifact (the root of its lineage)."""
    assert cfg.run_id is not None, "the run id is resolved before the config is committed"
    settings = json.loads(canonical_json(cfg.model_dump(mode="json")))
    out = StageOutput("config", "config", CONFIG_CODE_VERSION, cfg.run_id, (), settings)
    row = {"run_id": cfg.run_id, "seed": cfg.seed, "config_json": canonical_json(settings)}
    return commit_stage(store, out, lambda: Built(rows_to_table("config", [row])))
