"""The run configuration, assembled from the stages: one typed section per stage config, plus the run's id,
seed and flow settings; YAML plus --set overrides, with one-line errors.

Every module in tasks/ declares its stages (`Stage` objects at module level); each stage names its
config section and type. So a new stage is one module in tasks/ (its section appears here) and one line
in the flow. Sections chosen by `type` (select, allocate, rollout, synthesize.source) are unions over
what is registered when the config is loaded, so a strategy registered by a plugin is configurable too.
Every run commits its resolved config as the `config` artifact, the root of its lineage.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

import rlvr.tasks
from rlvr import plugins
from rlvr.environments.registry import EnvConfig, check_environment
from rlvr.errors import ConfigError, UserError
from rlvr.flows.compatibility import refuse_incompatible
from rlvr.flows.executors import ExecutorConfig
from rlvr.flows.openlineage_events import OpenLineageConfig
from rlvr.storage.ids import canonical_json
from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table, run_stage
from rlvr.storage.store import Store
from rlvr.verifiers.model_rewards import RewardConfig
from rlvr.verifiers.outcomes import DEFAULT_MAX_ERROR_RATE

if TYPE_CHECKING:
    from rlvr.curricula.base import AllocateConfig, SelectConfig
    from rlvr.curricula.clpo import RestructureConfig
    from rlvr.curricula.filtering import DynamicSamplingConfig
    from rlvr.tasks.checkpoint import CheckpointConfig
    from rlvr.tasks.difficulty import DifficultyConfig
    from rlvr.tasks.evaluate import EvaluateConfig
    from rlvr.tasks.synthesize import SynthesizeConfig
    from rlvr.tasks.train import TrainConfig
    from rlvr.tasks.warmstart import WarmstartConfig
    from rlvr.trainer.engine_base import EngineConfig
    from rlvr.trainer.policy import PolicyConfig
    from rlvr.verifiers.cache import VerifierConfig

# The order sections are shown in (model_dump, --help): the order of the pipeline.
SECTION_ORDER = (
    "policy",
    "synthesize",
    "warmstart",
    "difficulty",
    "select",
    "allocate",
    "rollout",
    "label",
    "train",
    "evaluate",
    "checkpoint",
)


class FlowConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps_per_subflow: int = Field(
        50, ge=1, description="RL steps grouped in one Prefect subflow (a subflow costs ~1 s to start)"
    )
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    async_level: int = Field(
        0,
        ge=0,
        exclude_if=lambda value: value == 0,  # left out of dumps at its default, so ids from before it stay
        description=(
            "0: steps in order. k > 0: the rollouts of step s are sampled by the policy of step s - k (of step 1 "
            "early on), beside the trainer, which trains on them with their stored log-probs"
        ),
    )
    sampler: Literal["process", "thread"] = Field(
        "process",
        exclude_if=lambda value: value == "process",  # how sampling runs, not what it computes: same ids
        description=(
            "with async_level > 0, where sampling runs: its own process (its own interpreter, so neither side "
            "waits on the other's Python; needs a store another process can open) or a thread of the run's"
        ),
    )


class RunConfigBase(BaseModel):
    """What every run config has besides the stage sections; the sections are added by `run_config_type`."""

    model_config = ConfigDict(extra="forbid")

    run_id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    seed: int = 0
    data: str | None = Field(None, description="train on the problems of this data run (`rlvr data`) instead")
    flow: FlowConfig = Field(default_factory=FlowConfig)
    openlineage: OpenLineageConfig = Field(default_factory=OpenLineageConfig)
    env: EnvConfig = Field(
        default_factory=EnvConfig,
        exclude_if=lambda value: not value.multi_turn,  # the one-turn default: left out of dumps, so ids stay
        description="the environment a rollout is an episode of (docs/environments.md); default: one turn",
    )
    reward: RewardConfig = Field(
        default_factory=RewardConfig,
        # without a model-given reward and at the default threshold: left out of dumps, so ids stay
        exclude_if=lambda value: not value.given and value.max_error_rate == DEFAULT_MAX_ERROR_RATE,
        description="model-given rewards: the judge's endpoint, the failed share a step bears (docs/rewards.md)",
    )

    @model_validator(mode="after")
    def _judge_where_answers_are_scored(self) -> RunConfigBase:
        """reward.judge and reward.model are given to the label section, which every stage that scores answers
        reads (label, difficulty, evaluation, CLPO); they are left out of that section's dump, so ids change only
        through their identities (`verifier_identity`)."""
        label = getattr(self, "label", None)
        endpoints = {"judge": self.reward.judge, "reward_model": self.reward.model}
        if label is not None and (label.judge, label.reward_model) != tuple(endpoints.values()):
            self.label = label.model_copy(update=endpoints)
        return self

    @model_validator(mode="after")
    def _transcripts_open_as_rollouts_do(self) -> RunConfigBase:
        """A warm start on calculator transcripts trains on the openings the environment makes from its options;
        with the calculator environment in the run, they must be the rollouts' own."""
        warmstart = getattr(self, "warmstart", None)
        if warmstart is None or warmstart.data != "tool_transcripts" or self.env.type != "calculator":
            return self
        if warmstart.env_options != self.env.options:
            raise ValueError(
                f"warmstart.env_options {warmstart.env_options} differ from env.options {self.env.options}: the warm "
                "start would train on openings the rollouts never see; give both the same options"
            )
        return self

    @model_validator(mode="after")
    def _ranks_sample_row_seeded(self) -> RunConfigBase:
        """Data-parallel ranks each sample their share of a step's prompts, so with train.data_parallel > 1 every
        sample draws from its own seed: `rollout.seeding` is `row` unless set (`batch` set is refused by
        flows/compatibility.py)."""
        train, rollout = getattr(self, "train", None), getattr(self, "rollout", None)
        if train is None or train.data_parallel == 1 or getattr(rollout, "seeding", "row") == "row":
            return self
        if "seeding" not in rollout.model_fields_set:  # type: ignore[union-attr]  # set: refused (compatibility.py)
            self.rollout = rollout.model_copy(update={"seeding": "row"})  # type: ignore[union-attr]
        return self

    if TYPE_CHECKING:
        # The stage sections are added at run time (`run_config_type`), where the sections chosen by `type` are
        # unions over what is registered (plugins included); the type checker sees each as its base class, so
        # `cfg.train.grpo.kl_beta` is checked and a misspelt key is an error (tests/test_config_typing.py).
        policy: PolicyConfig
        synthesize: SynthesizeConfig
        warmstart: WarmstartConfig
        difficulty: DifficultyConfig
        select: SelectConfig
        allocate: AllocateConfig
        rollout: EngineConfig
        label: VerifierConfig
        filter: DynamicSamplingConfig
        restructure: RestructureConfig
        train: TrainConfig
        evaluate: EvaluateConfig
        checkpoint: CheckpointConfig


def discover_stages() -> list[Stage[Any]]:
    """Every `Stage` declared at module level in the modules of rlvr.tasks (in module order)."""
    found: list[Stage[Any]] = []
    for info in sorted(pkgutil.iter_modules(rlvr.tasks.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"rlvr.tasks.{info.name}")
        found += [value for value in vars(module).values() if isinstance(value, Stage) and value not in found]
    return found


def _section_fields(stages: list[Stage[Any]]) -> dict[str, tuple[Any, Any]]:
    fields: dict[str, tuple[Any, Any]] = {}
    owner: dict[str, str] = {}
    for stage in stages:
        if stage.section is None:
            continue
        annotation = stage.config_type()
        factory = stage.default or annotation
        if stage.section in fields:
            if fields[stage.section][0] != annotation:
                raise TypeError(
                    f"stages {owner[stage.section]!r} and {stage.name!r} share section "
                    f"{stage.section!r} with different config types"
                )
            continue
        fields[stage.section] = (annotation, Field(default_factory=factory))
        owner[stage.section] = stage.name
    rank = {name: i for i, name in enumerate(SECTION_ORDER)}
    return dict(sorted(fields.items(), key=lambda item: rank.get(item[0], len(rank))))


_cached: tuple[int, type[RunConfigBase]] | None = None


def run_config_type() -> type[RunConfigBase]:
    """The RunConfig model for the stages and plugins known now (rebuilt after a new registration)."""
    global _cached
    if _cached is None or _cached[0] != plugins.generation():
        model = create_model("RunConfig", __base__=RunConfigBase, **_section_fields(discover_stages()))  # type: ignore[call-overload]
        _cached = (plugins.generation(), model)
    return _cached[1]


def __getattr__(name: str) -> Any:
    if name == "RunConfig":  # `from rlvr.flows.config import RunConfig`: the current model
        return run_config_type()
    raise AttributeError(name)


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {dotted!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`key.path=value` -> (key path, value parsed as YAML, so numbers, booleans and lists get their types)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"bad --set {text!r}: expected key=value, e.g. --set train.steps=200")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _user_path(loc: tuple[Any, ...], tree: Any) -> list[str]:
    """The config keys of an error location, without the union tags pydantic adds (select.sec.alpha -> select.alpha)."""
    path: list[str] = []
    node = tree
    for part in loc:
        if isinstance(node, list) and isinstance(part, int):
            path.append(str(part))
            node = node[part] if part < len(node) else None
            continue
        if isinstance(node, dict) and part not in node and node.get("type", part) == part and path:
            continue  # a union tag, not a key the user wrote
        path.append(str(part))
        node = node.get(part) if isinstance(node, dict) else None
    return path


def _describe(error: ValidationError, tree: dict[str, Any]) -> str:
    first = error.errors()[0]
    where = ".".join(_user_path(tuple(first["loc"]), tree)) or "(top level)"
    if first["type"] == "extra_forbidden":
        return f"unknown config key {where!r}; see docs/training.md (Configuration) for the keys"
    if first["type"] == "union_tag_invalid":
        expected = first.get("ctx", {}).get("expected_tags", "")
        return f"unknown {where}.type {first['ctx'].get('tag')!r}; registered: {expected}"
    return f"config key {where!r}: {first['msg']} (got {first.get('input')!r})"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Any:
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
    _one_source_as_list(tree)
    try:
        cfg = run_config_type().model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, tree)) from None
    refuse_incompatible(cfg)
    try:
        check_environment(cfg.env)  # keys its type would ignore, its options, its package: before any work
    except ConfigError:
        raise
    except UserError as refused:
        raise ConfigError(str(refused)) from None
    return cfg


# Keys that say where a run's work happens, not what it computes: no artifact id depends on them, so a resume may
# change them (another machine, another number of GPUs).
PLACEMENT_KEYS = (
    "policy.device",
    "train.data_parallel",
    "train.sharding",
    "flow.executor.type",
    "flow.executor.address",
    "flow.executor.workers",
)


def with_placement(cfg: Any, overrides: list[str]) -> Any:
    """`cfg` with `key=value` overrides of its placement keys (`PLACEMENT_KEYS`) applied; a one-line ConfigError
    for any other key."""
    if not overrides:
        return cfg
    tree = json.loads(cfg.model_dump_json())
    for text in overrides:
        key, value = parse_override(text)
        if key not in PLACEMENT_KEYS:
            raise ConfigError(
                f"a resume may change only where the run works ({', '.join(PLACEMENT_KEYS)}), not {key!r}: "
                "that would change what it computes"
            )
        _set_path(tree, key, value)
    try:
        moved = run_config_type().model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, tree)) from None
    refuse_incompatible(moved)
    return moved


def _one_source_as_list(tree: dict[str, Any]) -> None:
    """`synthesize.source` (one source) is shorthand for `synthesize.sources: [it]`; rewritten before
    validation so an error names the key as it is stored (synthesize.sources.0.digits)."""
    section = tree.get("synthesize")
    if isinstance(section, dict) and "source" in section:
        if "sources" in section:
            raise ConfigError("give either synthesize.source (one) or synthesize.sources (a list), not both")
        section["sources"] = [section.pop("source")]


def engine_param(cfg: RunConfigBase) -> dict[str, Any]:
    """`{"rollout": cfg.rollout}` when the run samples through another engine than transformers, for the
    stages that sample besides rollout (evaluate, difficulty); nothing otherwise, so their ids stay those of
    runs from before they took it."""
    return {} if getattr(cfg.rollout, "type", "transformers") == "transformers" else {"rollout": cfg.rollout}


def config_from_json(text: str) -> Any:
    return run_config_type().model_validate(json.loads(text))


def _config_build(inputs: Inputs, cfg: RunConfigBase, ctx: StageContext) -> Built:
    settings = json.loads(canonical_json(cfg.model_dump(mode="json")))
    row = {"run_id": ctx.run_id, "seed": ctx.seed, "config_json": canonical_json(settings)}
    return Built(rows_to_table("config", [row]))


def _config_identity(cfg: RunConfigBase, params: Any) -> dict[str, Any]:
    # Where lineage events go, where units run (flow.executor), where sampling runs (flow.sampler), where models
    # run (policy.device) and over how many data-parallel ranks (train.data_parallel, train.sharding: like a
    # device, they move float sums) are part of no id, so a resume may change them; nor is policy.dtype when it
    # is float32, so that ids of runs from before it existed stay what they were. Keys added since leave
    # every dump at their default (`exclude_if`).
    policy = {"device"} | ({"dtype"} if cfg.policy.dtype == "float32" else set())
    left_out: dict[str, Any] = {"openlineage": True, "flow": {"executor", "sampler"}, "policy": policy}
    left_out["train"] = {"sharding"}
    identity = json.loads(canonical_json(cfg.model_dump(mode="json", exclude=left_out)))
    identity["train"]["data_parallel"] = 1  # every dump had the key at 1 before it stopped mattering to ids
    return identity


# The run's resolved config as an artifact: the root of every run's lineage (not a section of itself).
CONFIG: Stage[RunConfigBase] = Stage(
    name="config",
    code_version="1",
    section=None,
    config=RunConfigBase,
    inputs=(),
    outputs={"config": Output("config")},
    build=_config_build,
    identity=_config_identity,
)


def data_run_problems(store: Store, run_id: str) -> str:
    """The problems artifact the synthesize stage of run `run_id` committed (a one-line error if there is
    none, or if it holds no problem)."""
    found = [m for m in store.manifests(kind="problems", run_id=run_id) if m.stage == "synthesize"]
    if not found:
        runs = ", ".join(sorted(r["run_id"] for r in store.list_runs())) or "none"
        raise UserError(f"run {run_id!r} has no synthesized problems in {store.root}; runs there: {runs}")
    return require_problems(store, found[0].artifact_id, run_id)


def require_problems(store: Store, problems_id: str, run_id: str) -> str:
    """`problems_id` when it holds at least one problem; else a one-line UserError saying what became of
    the rows read and where to look (the quarantine)."""
    manifest = store.manifest(problems_id)
    if manifest.rows:
        return problems_id
    counts = manifest.extra.get("counts", {})
    read, quarantined, duplicates = (sum(c.get(k, 0) for c in counts.values()) for k in SKIPPED_COUNTS)
    if not read:
        raise UserError(f"run {run_id!r} has no problems to train on: its sources gave no rows; check the input")
    sql = f"SELECT source, failed_check, reason FROM quarantine WHERE run_id = '{run_id}'"
    raise UserError(
        f"run {run_id!r} has no problems to train on: of {read} rows read, {quarantined} were quarantined and "
        f'{duplicates} were duplicates; why: rlvr query "{sql}" --store {store.root}'
    )


SKIPPED_COUNTS = ("read", "quarantined", "duplicates")


def commit_config(store: Store, cfg: RunConfigBase) -> str:
    """Commit the resolved config as the run's `config` artifact (the root of its lineage)."""
    assert cfg.run_id is not None, "the run id is resolved before the config is committed"
    return run_stage(store, CONFIG, cfg, run_id=cfg.run_id, seed=cfg.seed).id
