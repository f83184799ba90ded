"""bf16 autocast and gradient checkpointing: switches of the GRPO step that leave the update (nearly) as it was."""

import pytest
import torch
from transformers import modeling_utils

from rlvr.trainer.generation import Sample
from rlvr.trainer.grpo import GRPOConfig, RolloutBatch, grpo_step
from rlvr.trainer.policy import PolicyConfig, init_policy, make_optimizer
from tests.test_grpo_memory import peak_allocated, qwen_policy

COMPLETIONS = [[11, 2], [9, 2], [13, 12, 2], [9]]  # "7</s>", "5</s>", "91</s>", "5" (cut)


def batch() -> RolloutBatch:
    samples = [
        Sample(prompt_index=group, sample_index=k, completion_ids=ids, text="", n_tokens=len(ids), finish_reason="stop")
        for group in (0, 1)
        for k, ids in enumerate(COMPLETIONS)
    ]
    return RolloutBatch(prompts=["3+4=", "12+9="], samples=samples, rewards=[1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])


def updated(cfg: GRPOConfig, attention_dropout: float = 0.0) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
    """Stats, the weights before and the weights after two steps from the seed-0 tiny model."""
    policy = init_policy(PolicyConfig(), seed=0)
    for module in policy.model.modules():
        if hasattr(module, "attention_dropout"):  # what a pretrained model's config may set; off in eval mode
            module.attention_dropout = attention_dropout
    before = torch.cat([p.detach().flatten().clone() for p in policy.model.parameters()])
    optimizer = make_optimizer(policy, cfg.lr, cfg.weight_decay)
    for _ in range(2):
        stats = grpo_step(policy, optimizer, batch(), cfg)
    checkpointing = any(getattr(module, "gradient_checkpointing", False) for module in policy.model.modules())
    assert not policy.model.training and not checkpointing  # both undone after the step
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())
    return stats, before, torch.cat([p.detach().flatten() for p in policy.model.parameters()])


@pytest.mark.parametrize("attention_dropout", [0.0, 0.5])
def test_gradient_checkpointing_gives_the_same_update(monkeypatch, attention_dropout):
    """Also with attention dropout in the config: checkpointing must not switch it on for the loss."""
    plain_stats, before, plain = updated(GRPOConfig(minibatches=2), attention_dropout)
    calls = []
    real_checkpoint = modeling_utils.checkpoint

    def counted(*args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(modeling_utils, "checkpoint", counted)  # what enabling checkpointing binds
    stats, _, checkpointed = updated(GRPOConfig(minibatches=2, gradient_checkpointing=True), attention_dropout)
    assert calls and set(calls) == {False}  # every decoder layer of every update went through checkpointing
    assert not torch.equal(plain, before)
    torch.testing.assert_close(checkpointed, plain, rtol=0, atol=1e-6)
    assert stats["loss"] == pytest.approx(plain_stats["loss"], abs=1e-6)


def test_bf16_autocast_runs_in_bf16_and_moves_the_weights_the_same_way():
    plain_stats, before, plain = updated(GRPOConfig())
    stats, _, bf16 = updated(GRPOConfig(autocast="bf16"))
    assert stats["grad_norm"] != plain_stats["grad_norm"]  # the forward really ran in bf16
    assert stats["grad_norm"] == pytest.approx(plain_stats["grad_norm"], rel=0.1)
    cosine = torch.nn.functional.cosine_similarity(bf16 - before, plain - before, dim=0)
    assert cosine > 0.95


def test_bf16_autocast_updates_after_the_first_see_the_updated_weights():
    """Autocast's cast cache is keyed by the weight, not its version: one cache over the step would hand the second
    update the bf16 copies made before the first optimizer step, so its π_θ would be π_old (KL exactly 0)."""
    plain_stats = updated(GRPOConfig(minibatches=2))[0]
    stats = updated(GRPOConfig(minibatches=2, autocast="bf16"))[0]
    assert plain_stats["kl"] > 0
    assert stats["kl"] == pytest.approx(plain_stats["kl"], rel=0.5)  # mean of the updates' KL: 0, then > 0


def test_a_bf16_autocast_step_holds_no_bf16_copy_of_the_weights():
    """The step's peak above its start is the gradients (1x the float32 weights) and a micro-batch's
    activations; with autocast's cast cache it also held a bf16 copy of every weight to the end (2.06x here)."""
    shape = {"hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4, "num_key_value_heads": 2}
    policy = qwen_policy(0, vocab_size=64, num_hidden_layers=4, **shape)  # 4M parameters, nearly all in Linear layers
    weight_bytes = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    optimizer = make_optimizer(policy, 1e-3, 0.0)
    cfg = GRPOConfig(autocast="bf16", gradient_checkpointing=True, micro_batch_tokens=4 * 6)
    grpo_step(policy, optimizer, batch(), cfg)  # AdamW's moments are allocated here, before the measured step
    peak = peak_allocated(lambda: grpo_step(policy, optimizer, batch(), cfg))
    print(f"peak above the step's start: {peak / weight_bytes:.2f}x the float32 weights")
    assert weight_bytes < peak < 1.5 * weight_bytes
