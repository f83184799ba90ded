"""The run config: defaults, YAML, --set overrides, and one-line errors."""

from __future__ import annotations

import pytest

from rlvr.errors import ConfigError
from rlvr.flows.config import RunConfig, load_config, parse_override


def test_defaults_are_the_embedded_default():
    cfg = load_config()
    assert cfg.policy.model == "tiny"
    assert [source.type for source in cfg.synthesize.sources] == ["skills"]
    assert cfg.select.type == "uniform" and cfg.allocate.type == "uniform" and cfg.rollout.type == "transformers"
    assert cfg.label.verifier is None  # each problem's own verifier
    assert cfg.run_id is None


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 7\ntrain:\n  steps: 12\n  grpo:\n    lr: 0.002\n")
    cfg = load_config(path, ["train.steps=30", "select.splits=[train]", "run_id=abc"])
    assert (cfg.seed, cfg.train.steps, cfg.train.grpo.lr) == (7, 30, 0.002)
    assert cfg.select.splits == ["train"]
    assert cfg.run_id == "abc"


def test_override_values_get_yaml_types():
    assert parse_override("a.b=3") == ("a.b", 3)
    assert parse_override("a.b=0.5") == ("a.b", 0.5)
    assert parse_override("a=true") == ("a", True)
    assert parse_override("a=x y") == ("a", "x y")


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lrr=1", "unknown config key 'train.lrr'"),
        ("trian.steps=1", "unknown config key 'trian'"),
        ("train.steps=many", "config key 'train.steps': Input should be a valid integer"),
        ("select.batch_size=0", "config key 'select.batch_size': Input should be greater than or equal to 1"),
        ("novalue", "bad --set 'novalue'"),
        ("run_id=has space", "config key 'run_id'"),
        ("select.type=nope", "unknown select.type 'nope'; registered: 'uniform'"),
        ("select.alpha=0.5", "unknown config key 'select.alpha'"),
        ("rollout.temperature=hot", "config key 'rollout.temperature': Input should be a valid number"),
        (
            "synthesize.source.digits=0",
            "config key 'synthesize.sources.0.digits': Input should be greater than or equal to 1",
        ),
        (
            "synthesize.source.categories=[copy,divide]",
            "config key 'synthesize.sources.0.categories': Value error, unknown categories ['divide']",
        ),
    ],
)
def test_bad_config_is_one_clear_line(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)


def test_config_round_trips_through_json():
    cfg = load_config(None, ["seed=3", "train.steps=5"])
    assert RunConfig.model_validate_json(cfg.model_dump_json()) == cfg


def test_keys_added_later_leave_the_ids_of_earlier_runs_as_they_were():
    """The default config's id is the one runs had before train.state_every, filter.band, SEED-GRPO's, GHPO's
    and CLPO's join keys existed (config-0789b2d3512a8a667779, computed with the code of 2026-11-23); each key changes the id only
    when it is set to something other than its old meaning."""
    from rlvr.flows.config import CONFIG

    def config_id(*overrides: str) -> str:
        return CONFIG.output_ids("r", None, load_config(None, ["run_id=r", *overrides]), {}, {})["config"]

    assert config_id() == "config-0789b2d3512a8a667779"
    assert config_id("train.state_every=1", "filter.band=null") == config_id()
    grpo = ["train.grpo.minibatches=2"]  # the run's default; a train.grpo given in part keeps it
    assert config_id("train.grpo.lr=0.001") == config_id()  # lr 1e-3 is the default: minibatches stays 2
    assert config_id(*grpo, "train.grpo.semantic_entropy=null", "train.grpo.semantic_entropy_weighting=linear") == (
        config_id(*grpo)
    )
    changed = {config_id("train.state_every=5"), config_id("filter.band=[0.2, 0.8]")}
    changed |= {config_id("train.grpo.semantic_entropy=0.5"), config_id("policy.dtype=bfloat16")}
    assert len(changed) == 4 and config_id() not in changed
    # allocate.unknown's default moved from prior to the paper's uniform (2026-11-26): a behaviour change, so the
    # key is in every Knapsack dump and neither reading reuses the ids of Knapsack runs from before
    knapsack = config_id("allocate.type=knapsack")
    assert (
        config_id("allocate.type=knapsack", "allocate.unknown=uniform")
        == knapsack
        != config_id("allocate.type=knapsack", "allocate.unknown=prior")
    )
    # GHPO's hints and CLPO's same-step join are left out of dumps while off / at the old meaning
    assert config_id("select.hints.enabled=false") == config_id()
    assert config_id("restructure.join=next_step", "restructure.share=0.25") == config_id()
    assert config_id("select.hints.enabled=true", "select.hints.template={prompt}{hint}") != config_id()
    # how many data-parallel ranks share an update, and how, is placement (a resume may change it); with ranks,
    # rollouts are row-seeded, which is what changes the id
    ranks = {config_id("train.data_parallel=2"), config_id("train.data_parallel=4", "train.sharding=replicate")}
    assert ranks == {config_id("rollout.seeding=row")} and config_id() not in ranks


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.seeding=batch"], "rollout.seeding=batch cannot be split over train.data_parallel ranks"),
        (["rollout.type=vllm"], "rollout.type=vllm is not split over train.data_parallel ranks yet"),
    ],
)
def test_what_data_parallel_ranks_do_not_combine_with_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["train.data_parallel=2", *overrides])


def test_an_environment_changes_the_config_id_and_the_one_turn_default_does_not():
    from rlvr.flows.config import CONFIG

    def config_id(*overrides: str) -> str:
        return CONFIG.output_ids("r", None, load_config(None, ["run_id=r", *overrides]), {}, {})["config"]

    assert config_id("env.type=one_turn") == config_id() == "config-0789b2d3512a8a667779"
    with pytest.raises(ConfigError, match="env.max_turns does nothing with env.type=one_turn"):  # never dropped
        config_id("env.type=one_turn", "env.max_turns=3")
    assert config_id("env.type=retry") != config_id()
    assert config_id("env.type=retry", "env.max_turns=3") != config_id("env.type=retry")


def test_environments_run_on_every_built_in_engine_and_an_openai_one_must_send_token_ids():
    for engine in ("transformers", "vllm", "openai"):
        assert load_config(None, ["env.type=calculator", f"rollout.type={engine}"]).rollout.type == engine
    load_config(None, ["rollout.type=openai", "rollout.prompt_as=text"])  # one turn: text prompts are allowed
    with pytest.raises(ConfigError) as info:
        load_config(None, ["env.type=retry", "rollout.type=openai", "rollout.prompt_as=text"])
    message = str(info.value).strip()
    assert "env.type=retry sends each conversation as token ids; rollout.prompt_as=text would" in message
    assert "set rollout.prompt_as=token_ids" in message and "\n" not in message


def test_a_warm_start_on_calculator_transcripts_must_open_as_the_calculator_rollouts_do():
    same = ["env.type=calculator", "warmstart.data=tool_transcripts", "env.options={tool_format: prompt}"]
    cfg = load_config(None, [*same, "warmstart.env_options={tool_format: prompt}"])
    assert cfg.warmstart.env_options == cfg.env.options == {"tool_format": "prompt"}
    with pytest.raises(ConfigError, match=r"warmstart.env_options \{'python': True\} differ from env.options"):
        load_config(None, [*same, "warmstart.env_options={python: true}"])
    load_config(None, ["env.type=retry", "warmstart.data=tool_transcripts"])  # another environment: not compared
