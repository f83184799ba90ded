"""`rlvr plan` (trainer/memory_plan.py): what each rank holds, counted on the real model built on the meta device and
sharded over a fake group of N ranks; the stages that hold the whole model on rank 0; the fit against a device."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rlvr.errors import UserError
from rlvr.flows.cli import app
from rlvr.flows.config import load_config
from rlvr.trainer.memory_plan import (
    DTYPE_BYTES,
    kv_cache_bytes,
    make_plan,
    meta_model,
    model_config,
    saved_bytes,
    shape_of,
    state_bytes,
)
from rlvr.trainer.tiny_model import TinyModelConfig, tiny_config


def run_cli(args: list[str]):
    return CliRunner().invoke(app, args)


QWEN_7B = Path(__file__).parents[1] / "examples" / "models" / "qwen2.5-7b-instruct.json"


def padded_shard_bytes(model: torch.nn.Module, ranks: int) -> int:
    """FSDP2 splits each parameter along dim 0 into `ranks` equal (padded) parts: ceil(rows / N) rows a rank."""
    return sum(math.ceil(p.shape[0] / ranks) * math.prod(p.shape[1:]) * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("ranks", [2, 7])
def test_fsdp_shards_are_counted_as_fsdp2_pads_them(ranks):
    config = tiny_config(TinyModelConfig(hidden_size=36, intermediate_size=100, num_heads=3, num_kv_heads=1))
    expected = padded_shard_bytes(meta_model(config, torch.float32), ranks)
    counted = state_bytes(meta_model(config, torch.float32), ranks, "fsdp")
    assert counted == {"weights": expected, "gradients": expected, "optimizer": 2 * expected}
    whole = sum(p.numel() * 4 for p in meta_model(config, torch.float32).parameters())
    assert expected > whole / ranks if ranks == 7 else expected == whole / 2  # 7 splits 100 and 36 rows unevenly
    assert state_bytes(meta_model(config, torch.float32), ranks, "replicate")["weights"] == whole


def test_the_7b_example_has_the_model_cards_parameters_and_an_eighth_a_rank():
    cfg = load_config(Path(__file__).parents[1] / "examples" / "qwen2.5-7b-8gpu.yaml")
    config = model_config(cfg.policy, QWEN_7B)
    model = meta_model(config, torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 7_615_616_512  # docs/scale-out.md's count by hand
    weights = state_bytes(model, 8, "fsdp")["weights"]
    assert weights == padded_shard_bytes(meta_model(config, torch.float32), 8)
    assert round(weights / 1e9, 2) == 3.81
    shape = shape_of(config)
    # 2 (keys, values) x 28 layers x 4 KV heads x 128 x 2 bytes = 57,344 bytes a token a row, plus a step's logits
    assert kv_cache_bytes(shape, 64, 1280, torch.bfloat16) == 64 * 1280 * 57_344 + 2 * 64 * 152_064 * 4


def test_saved_activations_grow_with_rows_and_checkpointing_keeps_less():
    from rlvr.trainer.grpo import set_activation_checkpointing

    model = meta_model(tiny_config(TinyModelConfig()), torch.float32)
    two, three, four = (saved_bytes(model, rows, 24, 9) for rows in (2, 3, 4))
    # affine in rows: each row saves the same, beside what rows share (one row's tensors are partly views)
    assert four - three == three - two > 0
    set_activation_checkpointing(model, True)
    checkpointed = saved_bytes(model, 2, 24, 9)
    assert 0 < checkpointed < two / 2
    # with checkpointing, each decoder layer keeps its input alone: 2 rows x 24 tokens x 64 wide, float32, a layer
    assert checkpointed >= 2 * (2 * 24 * 64 * DTYPE_BYTES[torch.float32])


def test_a_sharded_run_holds_the_whole_model_on_rank_0_only_for_the_initial_checkpoint():
    """The warm start (on by default) trains on the ranks too: each holds its shards, their gradients and the SFT
    optimizer's moments over them."""
    cfg = load_config(
        None, ["train.data_parallel=2", "synthesize.source.type=arithmetic", "synthesize.source.count=50"]
    )
    plan = make_plan(cfg, 2, "cpu")
    whole = sum(p.numel() * 4 for p in meta_model(tiny_config(cfg.policy.tiny), torch.float32).parameters())
    holding_whole = [
        (s.stage, s.rank) for s in plan.stages if s.terms.get("weights") == whole or "whole weights" in s.terms
    ]
    assert holding_whole == [("initialize", "0")]
    warm = [s for s in plan.stages if s.stage == "warm start"]
    adopted = next(s for s in plan.stages if s.stage == "adopt" and s.rank == "0")
    assert [s.rank for s in warm] == ["0", "1"]
    for stage in warm:
        assert stage.terms["weights"] == adopted.terms["weights"] < 0.55 * whole
        assert stage.terms["SFT optimizer"] == 2 * stage.terms["weights"] and "optimizer" not in stage.terms
    checkpoint = next(s for s in plan.stages if s.stage == "checkpoint" and s.rank == "0")
    largest = max(p.numel() * 4 for p in meta_model(tiny_config(cfg.policy.tiny), torch.float32).parameters())
    assert checkpoint.terms["gathered tensor"] == largest  # streamed: one tensor whole at a time
    assert plan.peak("1").total <= plan.peak("0").total  # rank 0 also runs the flow (and writes the first checkpoint)
    evaluate = next(s for s in plan.stages if s.stage == "evaluate (later)" and s.rank == "1")
    shape = shape_of(tiny_config(cfg.policy.tiny))
    assert evaluate.terms["KV cache"] == kv_cache_bytes(shape, 5, 128 + cfg.evaluate.max_new_tokens, torch.float32)
    assert not any("gathered weights" in s.terms for s in plan.stages)  # decoding gathers a unit at a time
    faster = make_plan(
        cfg.model_copy(update={"train": cfg.train.model_copy(update={"decode_weights": "whole"})}), 2, "cpu"
    )
    decoding_whole = {s.stage for s in faster.stages if s.terms.get("gathered weights") == whole}
    assert decoding_whole == {"evaluate (first)", "difficulty", "rollout", "evaluate (later)"}


def test_a_model_directory_is_never_whole_on_the_ranks(tmp_path):
    """From a model directory the first checkpoint is copied a tensor at a time (trainer/directory_weights.py):
    with the warm start and the KL reference read by slices too, no stage on any rank holds the whole model."""
    from rlvr.trainer.policy import PolicyConfig, init_policy, policy_files

    four_layers = TinyModelConfig(num_layers=4)
    for name, data in policy_files(init_policy(PolicyConfig(tiny=four_layers), seed=0)).items():
        (tmp_path / name).write_bytes(data)
    overrides = ["train.data_parallel=2", f"policy.model={tmp_path}", "train.grpo.kl_beta=0.1"]
    plan = make_plan(load_config(None, [*overrides, "synthesize.source.type=arithmetic"]), 2, "cpu")
    model = meta_model(tiny_config(four_layers), torch.float32)
    whole, largest = (f(p.numel() * 4 for p in model.parameters()) for f in (sum, max))
    initialize = next(s for s in plan.stages if s.stage == "initialize")
    assert initialize.rank == "0" and "weights" not in initialize.terms
    assert initialize.terms["file chunk"] == largest
    for stage in plan.stages:
        assert stage.terms.get("weights", 0) < 0.55 * whole and "gathered weights" not in stage.terms, stage
        assert stage.terms.get("KL reference", 0) in (0, stage.terms.get("weights")), stage  # its shards only


def test_plan_says_whether_a_device_fits_and_exits_1_when_not(tmp_path):
    fits = run_cli(["plan", "--set", "train.data_parallel=2", "--device", "cpu", "--device-gb", "1000"])
    assert fits.exit_code == 0, fits.output
    assert "peak on rank 0:" in fits.output and "fits 1000 GB: every stage on every rank" in fits.output
    shown = " ".join(fits.output.replace("│", " ").split())  # the table's cells wrap over lines
    for term in ("SFT optimizer", "gradient reduction", "gathered units", "activations"):  # every term is shown
        assert f"{term} " in shown, term
    tight = run_cli(["plan", "--set", "train.data_parallel=2", "--device", "cpu", "--device-gb", "0.1"])
    assert tight.exit_code == 1
    assert "does not fit 0.1 GB: initialize on rank 0 needs" in tight.output


def test_a_model_not_on_this_machine_asks_for_its_config_in_one_line():
    cfg = load_config(None, ["policy.model=/nowhere/Qwen2.5-7B-Instruct"])
    with pytest.raises(UserError, match="give the model's config.json with --model-config"):
        model_config(cfg.policy)
    with pytest.raises(UserError, match="is not a file"):
        model_config(cfg.policy, Path("/nowhere/config.json"))
