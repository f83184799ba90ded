"""bf16 autocast and gradient checkpointing: switches of the GRPO step that leave the update (nearly) as it was."""

import pytest
import torch
from transformers import modeling_utils

from rlvr.trainer.generation import Sample
from rlvr.trainer.grpo import GRPOConfig, RolloutBatch, grpo_step
from rlvr.trainer.policy import PolicyConfig, init_policy, make_optimizer

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
