"""LoRA (peft): only the adapters train, checkpoints load as plain models, and the adapters round-trip exactly."""

import tempfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlvr.errors import UserError
from rlvr.trainer.generation import Sample
from rlvr.trainer.grpo import GRPOConfig, RolloutBatch, grpo_step
from rlvr.trainer.lora import ADAPTER_FILE, SETTINGS_FILE, LoraSettings
from rlvr.trainer.policy import (
    PolicyConfig,
    init_policy,
    make_optimizer,
    plain_state,
    policy_files,
    policy_from_files,
    stored_state,
)

INPUT = torch.tensor([[1, 7, 14, 8, 17]])  # "<s>3+4="


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=INPUT).logits


def train(policy, steps: int = 3) -> None:
    samples = [Sample(0, k, ids, "", len(ids), "stop") for k, ids in enumerate([[11, 2], [9, 2], [13, 2]])]
    batch = RolloutBatch(prompts=["3+4="], samples=samples, rewards=[1.0, 0.0, 0.0])
    cfg = GRPOConfig(lr=1e-2)
    optimizer = make_optimizer(policy, cfg.lr, cfg.weight_decay)
    for _ in range(steps):
        grpo_step(policy, optimizer, batch, cfg)


def test_adapters_start_as_a_no_op_and_only_they_train():
    base = init_policy(PolicyConfig(), seed=0)
    policy = init_policy(PolicyConfig(lora=LoraSettings(r=4, target_modules=["q_proj", "v_proj"])), seed=0)
    assert torch.equal(logits(policy.model), logits(base.model))  # B = 0 at the start
    trainable = {name for name, p in policy.model.named_parameters() if p.requires_grad}
    # 2 layers x {q_proj, v_proj} x {A, B}; q_proj is 64 -> 64, v_proj 64 -> 32 (2 kv heads of 16)
    assert len(trainable) == 8 and all(".lora_" in name for name in trainable)
    assert sum(p.numel() for p in policy.model.parameters() if p.requires_grad) == 2 * (
        4 * 64 + 64 * 4 + 4 * 64 + 32 * 4
    )
    frozen = {name: p.detach().clone() for name, p in policy.model.named_parameters() if not p.requires_grad}
    train(policy)
    assert not torch.equal(logits(policy.model), logits(base.model))
    for name, p in policy.model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name


def test_files_hold_merged_weights_and_restore_the_adapters_exactly():
    policy = init_policy(PolicyConfig(lora=LoraSettings(r=4)), seed=1)
    train(policy)
    files = policy_files(policy)
    assert ADAPTER_FILE in files and SETTINGS_FILE in files
    restored = policy_from_files(files)
    assert torch.equal(logits(restored.model), logits(policy.model))
    assert {n for n, p in restored.model.named_parameters() if p.requires_grad} == {
        n for n, p in policy.model.named_parameters() if p.requires_grad
    }
    with tempfile.TemporaryDirectory() as tmp:  # the merged weights alone: a plain model for vLLM or a user
        for name, data in files.items():
            if name not in (ADAPTER_FILE, SETTINGS_FILE):
                (Path(tmp) / name).write_bytes(data)
        plain = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    torch.testing.assert_close(logits(plain), logits(policy.model), rtol=0, atol=1e-5)


def test_plain_state_names_what_a_plain_model_has_with_the_adapters_merged():
    """What vLLM's weight sync receives: no peft names (`base_layer`, `lora_A`), values the merged weights."""
    plain_model = init_policy(PolicyConfig(), seed=1).model
    policy = init_policy(PolicyConfig(lora=LoraSettings(r=4)), seed=1)
    train(policy)
    state = plain_state(policy.model)
    assert list(state) == list(plain_model.state_dict())  # the tied lm_head too, as vLLM's reload needs
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    assert list(stored_state(policy.model)) == list(stored_state(plain_model)) == list(state)[:-1]  # tied once
    merged = AutoModelForCausalLM.from_config(plain_model.config)
    merged.load_state_dict(state)
    torch.testing.assert_close(logits(merged), logits(policy.model), rtol=0, atol=1e-5)


def test_unknown_target_module_is_a_user_error():
    with pytest.raises(UserError, match="policy.lora.target_modules"):
        init_policy(PolicyConfig(lora=LoraSettings(target_modules=["no_such_proj"])), seed=0)


@pytest.mark.slow
def test_a_lora_run_trains_only_the_adapters_and_checkpoints_them(tmp_path, prefect_api, tiny_config):
    from rlvr.flows.runs import execute
    from rlvr.storage.store import Store
    from rlvr.storage.views import query

    # Adapters go on a trained model, as LoRA is meant: on the random tiny model they learn too slowly for a
    # warm start to give any reward. A plain run warm-starts a base on one-digit sums; the LoRA run starts from
    # its checkpoint, where some groups' rewards differ, so GRPO really updates the adapters.
    common = ["synthesize.source={type: arithmetic, digits: 1}", "allocate.n=8"]
    execute(str(tmp_path / "store"), tiny_config("base", *common, "train.steps=0", "warmstart.steps=30"))
    store = Store.open(str(tmp_path / "store"))
    base = query(store, "SELECT artifact_id FROM artifacts WHERE kind = 'checkpoints' AND stage = 'warmstart'")
    lora = ["policy.lora={r: 4}", f"policy.checkpoint={base.column('artifact_id')[0].as_py()}", "warmstart.steps=0"]
    summary = execute(str(tmp_path / "store"), tiny_config("lora", *common, *lora, "train.steps=3", "evaluate.every=3"))
    steps = query(store, "SELECT step, updates, grad_norm FROM train_steps WHERE run_id = 'lora' ORDER BY step")
    assert steps.column("step").to_pylist() == [1, 2, 3]
    assert sum(steps.column("updates").to_pylist()) >= 1 and max(steps.column("grad_norm").to_pylist()) > 0
    final = policy_from_files(
        {
            f["path"].removeprefix("files/"): store.read_file(
                summary["final_checkpoint"], f["path"].removeprefix("files/")
            )
            for f in store.manifest(summary["final_checkpoint"]).binary_files
        }
    )
    assert all(".lora_" in n for n, p in final.model.named_parameters() if p.requires_grad)
    trained = [p for n, p in final.model.named_parameters() if ".lora_B" in n]
    assert trained and all(p.abs().sum() > 0 for p in trained)  # B starts at zero
