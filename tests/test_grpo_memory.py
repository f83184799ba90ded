"""Memory of a GRPO step: every pass (old logprobs, reference logprobs, loss) is cut by `micro_batch_tokens`, the
token log-probabilities come from a blockwise selective log-softmax, and gradient checkpointing goes through the
API that the installed transformers has.

The peak-memory test uses a model with Qwen2.5's 151,936-token vocabulary and a 32-wide single layer, so that the
vocabulary-sized tensors dominate as they do at 0.5B parameters, yet a step takes about a second on a CPU.
"""

import dataclasses
import warnings
from collections.abc import Callable

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM, modeling_utils

from rlvr.trainer.generation import Sample
from rlvr.trainer.grpo import (
    GRPOConfig,
    RolloutBatch,
    TrainingRows,
    accumulate_gradients,
    cuda_free_bytes,
    grpo_step,
    micro_batch_budget,
    rollout_logprobs,
    step_rows,
    token_bytes,
    tokens_that_fit,
    training_precision,
    unallocated_update_bytes,
)
from rlvr.trainer.logprobs import log_probs_and_entropy, selective_log_softmax
from rlvr.trainer.policy import Policy, PolicyConfig, init_policy, make_optimizer
from rlvr.trainer.tiny_model import build_tiny_tokenizer
from tests.test_distributed import ragged_batch

# Groups of 5, 3, 4 and 2 samples (all carry signal), completions of 1-6 tokens.
BATCH = dataclasses.replace(ragged_batch(3, [5, 3, 4, 2]), kl_weights=[0.5, 1.0, 2.0, 1.0])
QWEN_VOCAB = 151_936


def _rows(policy: Policy) -> TrainingRows:
    rows = step_rows(policy, BATCH, GRPOConfig(), None)[1]
    assert rows is not None and rows.mask.shape[0] == 14
    return rows


def _unsplit_log_probs(model: torch.nn.Module, rows: TrainingRows, temperature: float) -> tuple[torch.Tensor, ...]:
    """The whole-batch computation the step used to do: full-vocabulary log_softmax, then gather."""
    prompt_attention = (rows.prompt_ids != 0).long()
    attention = torch.cat([prompt_attention, torch.ones_like(rows.completion_ids)], dim=1)
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    input_ids = torch.cat([rows.prompt_ids, rows.completion_ids], dim=1)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=False).logits
    start, width = rows.prompt_ids.shape[1] - 1, rows.completion_ids.shape[1]
    log_probs = torch.log_softmax(logits[:, start : start + width].float() / temperature, dim=-1)
    logp = log_probs.gather(-1, rows.completion_ids.unsqueeze(-1)).squeeze(-1)
    return logp, -(log_probs.exp() * log_probs).sum(dim=-1)


@pytest.mark.parametrize("rows_per_micro_batch", [None, 1, 2, 4, 7, 14])  # 2, 4, 7: groups straddle micro-batches
def test_micro_batched_old_and_reference_logprobs_are_the_unsplit_ones(rows_per_micro_batch):
    cfg = GRPOConfig(kl_beta=0.1, temperature=0.7)
    policy, reference = init_policy(PolicyConfig(), seed=0), init_policy(PolicyConfig(), seed=1)
    rows = _rows(policy)
    width = rows.prompt_ids.shape[1] + rows.completion_ids.shape[1]
    budget = None if rows_per_micro_batch is None else rows_per_micro_batch * width
    seen: list[int] = []
    for model in (policy.model, reference.model):
        model.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw["input_ids"].shape[0]), with_kwargs=True)
    old_logp, entropy, ref_logp = rollout_logprobs(
        policy, rows, cfg.model_copy(update={"micro_batch_tokens": budget}), reference
    )
    assert max(seen) == (rows_per_micro_batch or 14) and sum(seen) == 2 * 14  # each row once per model
    expected_logp, expected_entropy = _unsplit_log_probs(policy.model, rows, 0.7)
    expected_ref = _unsplit_log_probs(reference.model, rows, 0.7)[0]
    assert ref_logp is not None and not torch.allclose(ref_logp, old_logp)  # two different models
    torch.testing.assert_close(old_logp, expected_logp, rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=1e-6)
    torch.testing.assert_close(ref_logp, expected_ref, rtol=0, atol=1e-6)


def test_every_pass_of_a_step_stays_within_the_budget():
    cfg = GRPOConfig(kl_beta=0.1, minibatches=2)
    policy, reference = init_policy(PolicyConfig(), seed=0), init_policy(PolicyConfig(), seed=1)
    rows = _rows(policy)
    width = rows.prompt_ids.shape[1] + rows.completion_ids.shape[1]
    passes: list[tuple[str, bool, int]] = []
    for name, model in (("policy", policy.model), ("reference", reference.model)):
        model.register_forward_pre_hook(
            lambda _m, _a, kw, name=name: passes.append((name, torch.is_grad_enabled(), kw["input_ids"].shape[0])),
            with_kwargs=True,
        )
    budgeted = cfg.model_copy(update={"micro_batch_tokens": 3 * width})
    grpo_step(policy, make_optimizer(policy, 1e-3, 0.0), BATCH, budgeted, reference)
    # no grad: 14 rows of the policy, then of the reference, 3 at a time; then the loss on 8 + 6 rows
    no_grad = [(name, rows) for name, grad, rows in passes if not grad]
    assert no_grad == [(name, n) for name in ("policy", "reference") for n in (3, 3, 3, 3, 2)]
    assert [rows for name, grad, rows in passes if grad] == [3, 3, 2, 3, 3]


def _recorded_passes(model: torch.nn.Module) -> list[tuple[bool, int]]:
    passes: list[tuple[bool, int]] = []
    model.register_forward_pre_hook(
        lambda _m, _a, kw: passes.append((torch.is_grad_enabled(), kw["input_ids"].shape[0])), with_kwargs=True
    )
    return passes


def test_one_update_takes_old_logprobs_from_the_loss_pass():
    """minibatches=1: no no-grad pass of the policy; the reference's alone, then the loss pass over all 14 rows."""
    cfg = GRPOConfig(kl_beta=0.1, minibatches=1)
    policy, reference = init_policy(PolicyConfig(), seed=0), init_policy(PolicyConfig(), seed=1)
    width = _rows(policy).prompt_ids.shape[1] + _rows(policy).completion_ids.shape[1]
    policy_passes, reference_passes = _recorded_passes(policy.model), _recorded_passes(reference.model)
    budgeted = cfg.model_copy(update={"micro_batch_tokens": 3 * width})
    stats = grpo_step(policy, make_optimizer(policy, 1e-3, 0.0), BATCH, budgeted, reference)
    assert policy_passes == [(True, n) for n in (3, 3, 3, 3, 2)]
    assert reference_passes == [(False, n) for n in (3, 3, 3, 3, 2)]
    assert stats["updates"] == 1.0 and stats["clip_fraction"] == 0.0 and stats["kl"] == 0.0  # ρ = 1 exactly


@pytest.mark.parametrize("kl_beta", [0.0, 0.1])
def test_one_update_is_the_separate_old_logprob_pass_bit_for_bit(kl_beta):
    """The shortcut and the step it replaces (a no-grad pass for π_old, then the update against it) give the same
    weights and loss exactly on the CPU, and the same entropy."""
    cfg = GRPOConfig(kl_beta=kl_beta, temperature=0.7, micro_batch_tokens=40)
    reference = init_policy(PolicyConfig(), seed=1)
    shortcut, separate = init_policy(PolicyConfig(), seed=0), init_policy(PolicyConfig(), seed=0)
    stats = grpo_step(shortcut, make_optimizer(shortcut, 1e-3, 0.0), BATCH, cfg, reference)
    rows = step_rows(separate, BATCH, cfg, reference)[1]
    assert rows is not None
    optimizer = make_optimizer(separate, 1e-3, 0.0)
    with training_precision(separate, cfg):
        old_logp, entropy, ref_logp = rollout_logprobs(separate, rows, cfg, reference if kl_beta else None)
        optimizer.zero_grad(set_to_none=True)
        whole = (float(rows.mask.shape[0]), float(rows.mask.sum()))
        everything = torch.ones(rows.mask.shape[0], dtype=torch.bool)
        sums = accumulate_gradients(separate, rows, everything, old_logp, ref_logp, cfg, BATCH.max_new_tokens, whole)
        torch.nn.utils.clip_grad_norm_(separate.model.parameters(), cfg.max_grad_norm)
        optimizer.step()
    assert stats["loss"] == float(sums[0]) and stats["ref_kl"] == float(sums[1])
    # entropy: summed per micro-batch in float64 here, over the whole batch in float32 there
    assert stats["entropy"] == pytest.approx(float((entropy * rows.mask).sum() / rows.mask.sum()), rel=1e-6)
    for (name, a), b in zip(shortcut.model.state_dict().items(), separate.model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions", [1, 3, 5, 7, 40])  # pieces of a row, whole rows, one block for everything
def test_selective_log_softmax_is_the_full_log_softmax(dtype, positions):
    generator = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 6, 50, generator=generator)).to(dtype).requires_grad_()  # W = T + 1 positions
    tokens = torch.randint(0, 50, (3, 5), generator=generator)
    upstream = torch.randn(3, 5, generator=generator)
    logp = selective_log_softmax(logits, tokens, 0.7, positions)
    (grad,) = torch.autograd.grad((logp * upstream).sum(), logits)
    full = torch.log_softmax(logits[:, :5].float() / 0.7, dim=-1)
    expected = full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    (expected_grad,) = torch.autograd.grad((expected * upstream).sum(), logits)
    assert logp.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(logp, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-6)
    assert not grad[:, 5].any()  # the extra position gets no gradient
    no_grad_logp, entropy = log_probs_and_entropy(logits, tokens, 0.7, positions)
    torch.testing.assert_close(no_grad_logp, expected.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(dim=-1).detach(), rtol=0, atol=1e-6)


def test_token_bytes_follow_the_documented_formula():
    """Qwen2.5-0.5B's shape: V 151,936, 24 layers, H 896, I 4864."""
    config = Qwen2Config(vocab_size=QWEN_VOCAB, hidden_size=896, intermediate_size=4864, num_hidden_layers=24)
    assert token_bytes(config, checkpointing=False) == 4 * (3 * QWEN_VOCAB + 24 * (10 * 896 + 4 * 4864))
    assert token_bytes(config, checkpointing=False) == 4_551_168
    assert token_bytes(config, checkpointing=True) == 4 * (3 * QWEN_VOCAB + 24 * 896 + 10 * 896 + 4 * 4864)


def test_budget_is_the_configured_one_or_none_on_the_cpu():
    policy = init_policy(PolicyConfig(), seed=0)
    assert micro_batch_budget(policy.model, GRPOConfig()) is None  # the CPU keeps the whole minibatch
    assert micro_batch_budget(policy.model, GRPOConfig(micro_batch_tokens=96)) == 96
    param_bytes = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    optimizer = make_optimizer(policy, 1e-3, 0.0)
    assert unallocated_update_bytes(policy.model, optimizer) == 3 * param_bytes  # gradients and two moments
    grpo_step(policy, optimizer, BATCH, GRPOConfig())
    assert unallocated_update_bytes(policy.model, optimizer) == param_bytes  # the moments exist now
    assert unallocated_update_bytes(policy.model, None) == 3 * param_bytes


def test_tokens_that_fit_follow_the_documented_formula():
    """The tiny model: 498,432 bytes of float32 parameters (P), token_bytes 13,528 (7,384 with checkpointing).
    With 1 GiB free and no optimizer state yet, usable = 0.7 x (2^30 - 3P) = 750,572,569.6 bytes."""
    policy = init_policy(PolicyConfig(), seed=0)
    assert (token_bytes(policy.model.config, False), token_bytes(policy.model.config, True)) == (13_528, 7_384)
    assert tokens_that_fit(1 << 30, policy.model, GRPOConfig()) == 55_482
    assert tokens_that_fit(1 << 30, policy.model, GRPOConfig(gradient_checkpointing=True)) == 101_648
    optimizer = make_optimizer(policy, 1e-3, 0.0)
    grpo_step(policy, optimizer, BATCH, GRPOConfig())  # the moments exist now: P still to allocate (gradients)
    assert tokens_that_fit(1 << 30, policy.model, GRPOConfig(), optimizer) == int(0.7 * ((1 << 30) - 498_432) // 13_528)
    assert tokens_that_fit(1_000_000, policy.model, GRPOConfig()) == 1  # less free than the update needs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_budget_on_a_gpu_comes_from_free_memory():
    policy = init_policy(PolicyConfig(), seed=0)
    policy.model.to("cuda")
    device = next(policy.model.parameters()).device
    free, _ = torch.cuda.mem_get_info(device)
    unused_reserve = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    assert cuda_free_bytes(device) == pytest.approx(free + unused_reserve, rel=0.01)  # nothing else runs here
    budget = micro_batch_budget(policy.model, GRPOConfig())
    expected = tokens_that_fit(cuda_free_bytes(device), policy.model, GRPOConfig())
    assert budget == pytest.approx(expected, rel=0.01)
    assert micro_batch_budget(policy.model, GRPOConfig(micro_batch_tokens=96)) == 96  # the configured one wins
    stats = grpo_step(policy, make_optimizer(policy, 1e-3, 0.0), BATCH, GRPOConfig())
    assert stats["updates"] == 1


def _checkpointing_on(model: torch.nn.Module) -> bool:
    return any(getattr(module, "gradient_checkpointing", False) for module in model.modules())


def _gradients(cfg: GRPOConfig) -> torch.Tensor:
    """The first update's gradient (one minibatch, two micro-batches) from the seed-0 tiny model."""
    policy = init_policy(PolicyConfig(), seed=0)
    rows = _rows(policy)
    old_logp, _, _ = rollout_logprobs(policy, rows, cfg, None)
    selected = torch.ones(rows.mask.shape[0], dtype=torch.bool)
    whole = (float(selected.sum()), float(rows.mask.sum()))
    with training_precision(policy, cfg):
        assert _checkpointing_on(policy.model) == cfg.gradient_checkpointing
        accumulate_gradients(policy, rows, selected, old_logp, None, cfg, None, whole)
    assert not _checkpointing_on(policy.model) and not policy.model.training
    return torch.cat([p.grad.flatten() for p in policy.model.parameters()])


def _count_checkpoint_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool | None]:
    """use_reentrant of every checkpointed layer call (transformers binds modeling_utils.checkpoint when enabled)."""
    calls: list[bool | None] = []
    real_checkpoint = modeling_utils.checkpoint

    def counted(*args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(modeling_utils, "checkpoint", counted)
    return calls


def test_checkpointing_gives_the_gradients_without_it(monkeypatch):
    cfg = GRPOConfig(micro_batch_tokens=60)
    plain = _gradients(cfg)
    calls = _count_checkpoint_calls(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the installed transformers' own API, not a deprecated alias
        checkpointed = _gradients(cfg.model_copy(update={"gradient_checkpointing": True}))
    assert len(calls) >= 4 and set(calls) == {False}  # 2 layers x every micro-batch, non-reentrant
    assert plain.abs().max() > 0
    torch.testing.assert_close(checkpointed, plain, rtol=0, atol=1e-6)


def test_checkpointing_uses_gradient_checkpointing_enable_where_that_is_the_only_api(monkeypatch):
    """transformers releases before `activation_checkpointing_enable` (5.17 among them) have only
    `gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)` and its `_disable`."""
    used: list[str] = []
    newer = hasattr(PreTrainedModel, "activation_checkpointing_enable")  # False at the floor (make test-floor)
    real_enable, real_disable = (
        PreTrainedModel.gradient_checkpointing_enable,
        PreTrainedModel.gradient_checkpointing_disable,
    )

    def enable(model: PreTrainedModel, gradient_checkpointing_kwargs: dict | None = None) -> None:
        used.append(f"enable {gradient_checkpointing_kwargs}")
        if newer:  # the deprecated alias would warn: call what it calls
            model._activation_checkpointing_enable(gradient_checkpointing_kwargs)
        else:
            real_enable(model, gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    def disable(model: PreTrainedModel) -> None:
        used.append("disable")
        if newer:
            model._activation_checkpointing_disable()
        else:
            real_disable(model)

    plain = _gradients(GRPOConfig(micro_batch_tokens=60))
    if newer:  # simulate a release that has only gradient_checkpointing_enable
        monkeypatch.delattr(PreTrainedModel, "activation_checkpointing_enable")
        monkeypatch.delattr(PreTrainedModel, "activation_checkpointing_disable")
    monkeypatch.setattr(PreTrainedModel, "gradient_checkpointing_enable", enable)
    monkeypatch.setattr(PreTrainedModel, "gradient_checkpointing_disable", disable)
    calls = _count_checkpoint_calls(monkeypatch)
    checkpointed = _gradients(GRPOConfig(micro_batch_tokens=60, gradient_checkpointing=True))
    assert used == ["enable {'use_reentrant': False}", "disable"]
    assert len(calls) >= 4
    torch.testing.assert_close(checkpointed, plain, rtol=0, atol=1e-6)


def qwen_policy(seed: int, **shape: int) -> Policy:
    """A Qwen2 model of `shape` (Qwen2Config's sizes; tied embeddings) with seed-`seed` random weights, behind the
    tiny tokenizer, whose ids it must cover."""
    config = Qwen2Config(**shape, tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(seed)
    return Policy(model=Qwen2ForCausalLM(config).eval(), tokenizer=build_tiny_tokenizer(), source="test")


def _qwen_vocab_policy(seed: int) -> Policy:
    """One 32-wide layer over Qwen2.5's vocabulary (tied embeddings: 4.9M parameters, 19 MB)."""
    return qwen_policy(
        seed,
        vocab_size=QWEN_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


def _wide_batch(groups: int, completion_tokens: int = 8) -> RolloutBatch:
    """`groups` groups of 8 samples of 6-8 tokens drawn from the whole vocabulary, rewards 0/1."""
    generator = torch.Generator().manual_seed(0)
    samples = []
    for group in range(groups):
        for index in range(8):
            length = completion_tokens - index % 3
            ids = torch.randint(20, QWEN_VOCAB, (length,), generator=generator).tolist()
            samples.append(Sample(group, index, ids, "", length, "stop"))
    rewards = [float(index % 2) for _ in range(groups) for index in range(8)]
    return RolloutBatch(prompts=["3+4="] * groups, samples=samples, rewards=rewards)


def _peak_bytes(groups: int, micro_batch_tokens: int | None) -> int:
    """Highest CPU bytes allocated during one grpo_step with a reference (three passes) (`peak_allocated`)."""
    policy, reference = _qwen_vocab_policy(0), _qwen_vocab_policy(1)
    optimizer = make_optimizer(policy, 1e-3, 0.0)
    cfg = GRPOConfig(kl_beta=0.1, micro_batch_tokens=micro_batch_tokens)
    batch = _wide_batch(groups)
    return peak_allocated(lambda: grpo_step(policy, optimizer, batch, cfg, reference))


def peak_allocated(call: Callable[[], object]) -> int:
    """Highest CPU bytes allocated while `call` runs, above those allocated before it: the running sum of the
    allocations and frees that the profiler records, in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        call()
    events = profiler.profiler.kineto_results.events()
    changes = sorted((event.start_ns(), event.nbytes()) for event in events if event.name() == "[memory]")
    allocated = peak = 0
    for _, change in changes:
        allocated += change
        peak = max(peak, allocated)
    return peak


@pytest.mark.slow
def test_peak_memory_is_flat_in_the_batch_at_qwen_vocabulary():
    width = 5 + 8  # "<s>3+4=" and 8 completion tokens: padded tokens per row
    eight = _peak_bytes(1, 8 * width)
    thirty_two = _peak_bytes(4, 8 * width)
    whole = _peak_bytes(4, None)
    print(f"peak bytes: 8 rows {eight:,}; 32 rows {thirty_two:,}; 32 rows unsplit {whole:,}")
    assert thirty_two < 1.3 * eight  # four micro-batches of 8 rows: the peak of one
    assert whole > 2 * eight  # one pass over all 32 rows, as the old-logprob and reference passes used to do
