"""GRPO (docs/methods.md#grpo) and its variants, each chosen by `GRPOConfig`: group advantages, the clipped
surrogate, the loss aggregations, and one RL step over a batch of rollouts.

Variants: clip-higher = `clip_high > clip_low`; Dr. GRPO = `advantage_scale="none"` with
`aggregation="token-sum"`; DAPO = `aggregation="token-mean"`, clip-higher and `overlong` shaping; Lite PPO's
group-mean batch-std advantages = `advantage_scale="batch"`; GDPO = `advantage_components`; dual-clip PPO =
`dual_clip`; a truncated importance weight = `ratio_cap`; `advantage_clip` bounds |A|. The KL-to-reference
term (k3, per-sample weights, docs/methods.md#kl-to-the-reference) is off by default (`kl_beta` 0, as DAPO
uses for verifiable rewards); CLPO turns it on. Groups whose advantages are all zero are left out of the
update; dynamic sampling's refills are the filter stage's. Every default reproduces plain GRPO.

This module runs a step on the model (`grpo_step`: π_old's pass, the clipped updates, gradient accumulation); the
pieces it uses live by concern and are importable from here too: trainer/advantages.py and trainer/grpo_loss.py
(the math, plain functions on tensors), trainer/grpo_batch.py (`GRPOConfig`, `RolloutBatch`, the rows a step trains
on) and trainer/micro_batches.py (micro-batches and their memory budget).
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from rlvr.trainer.advantages import AdvantageScale as AdvantageScale
from rlvr.trainer.advantages import effective_ratio as effective_ratio
from rlvr.trainer.advantages import gdpo_advantages as gdpo_advantages
from rlvr.trainer.advantages import group_advantages as group_advantages
from rlvr.trainer.advantages import overlong_penalty as overlong_penalty
from rlvr.trainer.advantages import semantic_entropy_scale as semantic_entropy_scale
from rlvr.trainer.generation import Sample
from rlvr.trainer.grpo_batch import GRPOConfig as GRPOConfig
from rlvr.trainer.grpo_batch import Overlong as Overlong
from rlvr.trainer.grpo_batch import RolloutBatch as RolloutBatch
from rlvr.trainer.grpo_batch import TrainingRows as TrainingRows
from rlvr.trainer.grpo_batch import batch_stats as batch_stats
from rlvr.trainer.grpo_batch import component_matrix as component_matrix
from rlvr.trainer.grpo_batch import episode_turn_advantages as episode_turn_advantages
from rlvr.trainer.grpo_batch import overlong_lengths as overlong_lengths
from rlvr.trainer.grpo_batch import step_advantages as step_advantages
from rlvr.trainer.grpo_batch import step_rows as step_rows
from rlvr.trainer.grpo_batch import training_rows as training_rows
from rlvr.trainer.grpo_loss import Aggregation as Aggregation
from rlvr.trainer.grpo_loss import aggregate as aggregate
from rlvr.trainer.grpo_loss import behaviour_weights as behaviour_weights
from rlvr.trainer.grpo_loss import clipped_surrogate_loss as clipped_surrogate_loss
from rlvr.trainer.grpo_loss import loss_share as loss_share
from rlvr.trainer.grpo_loss import reference_kl as reference_kl
from rlvr.trainer.logprobs import completion_logprobs as completion_logprobs  # re-exported: sft, distributed
from rlvr.trainer.logprobs import completion_logprobs_and_entropy as completion_logprobs_and_entropy
from rlvr.trainer.micro_batches import MEMORY_SHARE as MEMORY_SHARE
from rlvr.trainer.micro_batches import cuda_free_bytes as cuda_free_bytes
from rlvr.trainer.micro_batches import micro_batch_budget as micro_batch_budget
from rlvr.trainer.micro_batches import micro_batches as micro_batches
from rlvr.trainer.micro_batches import token_bytes as token_bytes
from rlvr.trainer.micro_batches import tokens_that_fit as tokens_that_fit
from rlvr.trainer.micro_batches import unallocated_update_bytes as unallocated_update_bytes
from rlvr.trainer.mismatch import correction_weights, mismatch_stats
from rlvr.trainer.objectives import cispo_loss, disco_loss, sequence_surrogate_loss
from rlvr.trainer.policy import Policy


def set_activation_checkpointing(model: PreTrainedModel, enabled: bool) -> None:
    """Non-reentrant activation checkpointing of the model's decoder layers on or off, through the API this
    transformers has: `activation_checkpointing_enable`/`_disable` in recent 5.x releases (which keep
    `gradient_checkpointing_*` as deprecated aliases), `gradient_checkpointing_enable`/`_disable` in earlier ones
    (5.17 has only those). Both set the same `gradient_checkpointing` flags on the same layers."""
    if enabled and hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif enabled:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


@contextmanager
def training_precision(policy: Policy, cfg: GRPOConfig) -> Iterator[None]:
    """The step's forward and backward passes under `cfg.autocast` and `cfg.gradient_checkpointing`.

    A layer checkpoints only in training mode, so the checkpointed layers alone are flagged as training, not
    what they hold: `model.train()` would also switch on dropout, in `nn.Dropout` modules and in attention
    (which reads its own `training` flag), and the loss must see the same network the sampler did (the policy
    stays in eval mode otherwise, see trainer/policy.py). Both are undone on exit, also after an error.

    Autocast runs without its cast cache. The cache keys a weight's bf16 copy by the tensor, not its version,
    and lives until the context exits: over a step of several updates every update after the first read the
    copies made before the first optimizer step (its π_θ was π_old's Linear layers), and the copies of every
    weight (0.92 GiB at 0.5B parameters) stayed through the backward passes and the optimizer step. Each forward
    and each checkpointed recompute now casts again, as TRL's does (accelerate enters autocast per forward call).
    """
    model = policy.model
    if cfg.gradient_checkpointing:
        set_activation_checkpointing(model, True)
        for module in model.modules():
            if isinstance(module, GradientCheckpointingLayer):
                module.training = True  # this module only; `.train()` would recurse into attention and dropout
    device_type = next(model.parameters()).device.type
    try:
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=cfg.autocast == "bf16", cache_enabled=False):
            yield
    finally:
        if cfg.gradient_checkpointing:
            set_activation_checkpointing(model, False)
            model.eval()


def grpo_step(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    cfg: GRPOConfig,
    reference: Policy | None = None,
) -> dict[str, float]:
    """One RL step: advantages (`step_advantages`), old logprobs once (no grad), then `cfg.minibatches`
    clipped updates over the groups that carry signal; with `cfg.kl_beta` > 0, plus β x the KL to `reference`.

    Returns loss, clip_fraction, kl (k3 estimate of KL(π_old ‖ π_θ)), ref_kl (the reference term before
    β), grad_norm (means over the updates; grad_norm before clipping), entropy (token mean of π_old's
    entropy on the trained tokens), updates (0 when every group is uniform), mean_reward, reward_std
    (population, over all samples, of the verifier's rewards before any overlong penalty) and effective_ratio.
    """
    stats, rows = step_rows(policy, batch, cfg, reference)
    if rows is None:
        return stats
    reference = reference if cfg.kl_beta > 0 else None
    budget = micro_batch_budget(policy.model, cfg, optimizer)  # once: every pass of the step splits alike
    cfg = cfg.model_copy(update={"micro_batch_tokens": budget})
    with training_precision(policy, cfg):
        stats.update(_clipped_updates(policy, optimizer, rows, cfg, reference, batch.token_sum_length))
    return stats


def _clipped_updates(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    rows: TrainingRows,
    cfg: GRPOConfig,
    reference: Policy | None,
    max_length: int | None,
) -> dict[str, float]:
    """`cfg.minibatches` updates, each on a contiguous slice of the active groups, against one set of old
    logprobs (and reference logprobs when there is a KL term); returns the mean loss, clip fraction, KL estimates
    and grad norm, the token-mean entropy, and the update count.

    π_old: the rows' stored log-probs when an earlier policy sampled them (flow.async_level; the entropy is then
    π_θ's, from the loss passes). With one update, π_old is π_θ before it, the policy that sampled, so the loss
    pass's own log-probs, detached, are π_old's (ρ = 1) and its entropy π_old's: no separate pass, the same
    weights bit for bit on the CPU (tests/test_grpo_memory.py), as TRL does when it generates once per optimizer
    step. Otherwise a no-grad pass over every row before the first update gives π_old's log-probs and entropy.
    With `decoupled` and stale rows that pass gives π_prox, the clip's centre, and the stored log-probs only the
    per-token weight π_prox / π_behaviour."""
    updates = min(cfg.minibatches, rows.active_groups.numel())
    entropy: Tensor | None = None
    old_logp: Tensor | None
    measured: dict[str, float] = {}
    if rows.old_logp is not None:  # the sampler's log-probs: the trainer's own π_old beside them, and the mismatch
        trainer_logp, entropy, ref_logp = rollout_logprobs(policy, rows, cfg, reference)
        measured = mismatch_stats(trainer_logp, rows.old_logp, rows.mask)
        rows, old_logp, measured["corrected_share"] = corrected_rows(rows, trainer_logp, cfg)
    elif rows.old_logp is None and updates > 1:
        old_logp, entropy, ref_logp = rollout_logprobs(policy, rows, cfg, reference)
    else:
        old_logp = rows.old_logp  # None: the loss pass's own
        ref_logp = reference_logprobs(policy, rows, cfg, reference) if reference is not None else None
    totals: dict[str, float] = {}
    for groups in torch.tensor_split(rows.active_groups, updates):
        selected = torch.isin(rows.groups, groups)
        stats = _update(policy, optimizer, rows, selected, old_logp, ref_logp, cfg, max_length, entropy is None)
        for name, value in stats.items():
            totals[name] = totals.get(name, 0.0) + value
    optimizer.zero_grad(set_to_none=True)
    averages = {name: value / updates for name, value in totals.items()}
    if entropy is not None:
        averages["entropy"] = float((entropy * rows.mask).sum() / rows.mask.sum().clamp(min=1))
    return {**averages, **measured, "updates": float(updates)}


def corrected_rows(rows: TrainingRows, trainer_logp: Tensor, cfg: GRPOConfig) -> tuple[TrainingRows, Tensor, float]:
    """The rows, π_old and the share of tokens a correction changed, for rows that carry their sampler's log-probs
    (`rows.old_logp`) beside the trainer's (`trainer_logp`). `decoupled`: π_old is the trainer's (π_prox) and each
    token weighs π_prox / π_behaviour, capped at ratio_cap; `correction`: the same centre, the weight and kept tokens
    of trainer/mismatch.py; neither: π_old stays the sampler's, unchanged."""
    assert rows.old_logp is not None
    if cfg.decoupled:
        weight = behaviour_weights(trainer_logp, rows.old_logp, rows.mask, cfg.ratio_cap)
        cut = rows.mask & (torch.exp(trainer_logp - rows.old_logp) > (cfg.ratio_cap or math.inf))
        share = float(cut.sum() / rows.mask.sum().clamp(min=1))
        return replace(rows, behaviour_weight=weight), trainer_logp, share
    if cfg.correction == "none":
        return rows, rows.old_logp, 0.0
    weight, kept, share = correction_weights(
        trainer_logp, rows.old_logp, rows.mask, cfg.correction, cfg.correction_level, cfg.correction_bounds
    )
    return replace(rows, behaviour_weight=weight, mask=kept), trainer_logp, share


def behaviour_logprobs(
    policy: Policy,
    prompts: list[str],
    samples: list[Sample],
    cfg: GRPOConfig,
    prompt_token_ids: list[list[int] | None] | None = None,
) -> list[list[float]]:
    """Each sample's token log-probs under `policy`, the one that sampled them, as the train stage computes π_old
    (`cfg`'s temperature, autocast and micro-batches; no gradient). Stored with rollouts that a later policy
    trains on (flow.async_level), where π_old can no longer be recomputed from the trained model.
    `prompt_token_ids`: each sample's own prompt ids (an episode's opening), else its group's prompt tokenized."""
    if not samples:
        return []
    batch = RolloutBatch(prompts, samples, [0.0] * len(samples), prompt_token_ids=prompt_token_ids)
    group_index = torch.tensor([sample.prompt_index for sample in samples], dtype=torch.long)
    rows = training_rows(policy, batch, torch.ones(len(samples)), group_index)
    assert rows is not None  # every advantage is 1: every sample is a row, in order
    with training_precision(policy, cfg.model_copy(update={"gradient_checkpointing": False})):
        old_logp = rollout_logprobs(policy, rows, cfg, None)[0]
    return [old_logp[i, : sample.n_tokens].tolist() for i, sample in enumerate(samples)]


def reference_logprobs(policy: Policy, rows: TrainingRows, cfg: GRPOConfig, reference: Policy) -> Tensor:
    """The reference's logprobs [R, T] on every row, without gradients, one micro-batch at a time."""
    ref_logp = torch.empty(rows.mask.shape, dtype=torch.float32, device=rows.mask.device)
    everything = torch.ones(rows.mask.shape[0], dtype=torch.bool, device=rows.mask.device)
    with torch.no_grad():
        for part in micro_batches(rows, everything, micro_batch_budget(policy.model, cfg)):
            ref_logp[part] = completion_logprobs(
                reference.model,
                rows.prompt_ids[part],
                rows.completion_ids[part],
                policy.tokenizer.pad_token_id,
                rows.mask[part],
                cfg.temperature,
                cfg.fused_head,
                cfg.fp32_head,
            )[0]
    return ref_logp


def rollout_logprobs(
    policy: Policy, rows: TrainingRows, cfg: GRPOConfig, reference: Policy | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """π_old's logprobs and entropy [R, T] on every row, and the reference's logprobs (None without a
    reference), without gradients and one micro-batch at a time (`micro_batches` under `micro_batch_budget`, as
    the loss pass splits): each row's inputs keep the step's padding, so its numbers are the unsplit ones."""
    pad_id = policy.tokenizer.pad_token_id
    old_logp = torch.empty(rows.mask.shape, dtype=torch.float32, device=rows.mask.device)
    entropy = torch.empty_like(old_logp)
    everything = torch.ones(rows.mask.shape[0], dtype=torch.bool, device=rows.mask.device)
    with torch.no_grad():
        for part in micro_batches(rows, everything, micro_batch_budget(policy.model, cfg)):
            old_logp[part], entropy[part] = completion_logprobs_and_entropy(
                policy.model,
                rows.prompt_ids[part],
                rows.completion_ids[part],
                pad_id,
                cfg.temperature,
                cfg.fused_head,
                cfg.fp32_head,
            )
    ref_logp = reference_logprobs(policy, rows, cfg, reference) if reference is not None else None
    return old_logp, entropy, ref_logp


def minibatch_loss(
    policy: Policy,
    rows: TrainingRows,
    selected: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    cfg: GRPOConfig,
    max_length: int | None,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None, dict[str, float]]:
    """The loss of the `selected` rows (the clipped surrogate plus β x the reference KL when there is a
    reference), the KL term alone (before β; None without a reference) and the surrogate's stats.
    `old_logp` None: π_old is the policy being trained (one update), so the old log-probs are these ones,
    detached. `with_entropy`: the stats add `entropy_sum`, π_θ's entropy over the rows' real tokens, from the
    same blocks (else 0). Shared by the single-process update and the data-parallel one (trainer/distributed.py)."""
    prompt_ids, completion_ids = rows.prompt_ids[selected], rows.completion_ids[selected]
    token_mask = rows.mask[selected].to(torch.float32)
    pad_id, model, temperature = policy.tokenizer.pad_token_id, policy.model, cfg.temperature
    entropy_sum = 0.0
    if with_entropy:
        logp, entropy = completion_logprobs_and_entropy(
            model, prompt_ids, completion_ids, pad_id, temperature, cfg.fused_head, cfg.fp32_head
        )
        entropy_sum = float((entropy * token_mask).sum())
    else:
        logp = completion_logprobs(
            model, prompt_ids, completion_ids, pad_id, token_mask, temperature, cfg.fused_head, cfg.fp32_head
        )[0]
    old = logp.detach() if old_logp is None else old_logp[selected]
    loss, loss_stats = policy_loss(cfg, rows, selected, logp, old, token_mask, max_length)
    loss_stats["entropy_sum"] = entropy_sum
    if ref_logp is None:
        return loss, None, loss_stats
    kl_term = reference_kl(logp, ref_logp[selected], token_mask, rows.kl_weights[selected], cfg.aggregation, max_length)
    return loss + cfg.kl_beta * kl_term, kl_term, loss_stats


def policy_loss(
    cfg: GRPOConfig,
    rows: TrainingRows,
    selected: Tensor,
    logp: Tensor,
    old: Tensor,
    token_mask: Tensor,
    max_length: int | None,
) -> tuple[Tensor, dict[str, float]]:
    """The `selected` rows' policy loss under `cfg.objective` (trainer/objectives.py) and its stats; a per-token
    weight (decoupled PPO's) applies where the objective has tokens to weigh."""
    advantages = rows.advantages[selected]
    token_weight = None if rows.behaviour_weight is None else rows.behaviour_weight[selected]
    if cfg.objective == "disco":
        d, groups = cfg.disco, rows.groups[selected]
        return disco_loss(
            logp, old, advantages, token_mask, groups, score=d.score, tau=d.tau, delta=d.delta, beta=d.beta
        )
    shared: dict[str, Any] = dict(aggregation=cfg.aggregation, max_length=max_length, token_weight=token_weight)
    if cfg.objective == "cispo":
        return cispo_loss(logp, old, advantages, token_mask, clip_high=cfg.clip_high, **shared)
    clips: dict[str, Any] = dict(clip_low=cfg.clip_low, clip_high=cfg.clip_high)
    if cfg.objective == "gspo":
        return sequence_surrogate_loss(logp, old, advantages, token_mask, **clips, **shared)
    # decoupled PPO caps its behaviour weight with ratio_cap instead of the unclipped term
    cap = None if cfg.decoupled else cfg.ratio_cap
    return clipped_surrogate_loss(
        logp, old, advantages, token_mask, dual_clip=cfg.dual_clip, ratio_cap=cap, **clips, **shared
    )


def accumulate_gradients(
    policy: Policy,
    rows: TrainingRows,
    selected: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    cfg: GRPOConfig,
    max_length: int | None,
    whole: tuple[float, float],
    with_entropy: bool = False,
) -> Tensor:
    """Backward of the `selected` rows' loss, one micro-batch at a time (gradients add up), each weighted by its
    `loss_share` of the `whole` minibatch's (sequences, tokens), which the data-parallel ranks (trainer/
    distributed.py) count over all ranks. Returns float64 sums to add over parts and ranks (`STAT_SUMS`: loss,
    reference KL, clip fraction x tokens, approx KL x tokens, and with `with_entropy` entropy x tokens, else 0);
    `minibatch_stats` turns them into the minibatch's stats."""
    sums = torch.zeros(STAT_SUMS, dtype=torch.float64)
    for part in micro_batches(rows, selected, micro_batch_budget(policy.model, cfg)):
        loss, kl_term, loss_stats = minibatch_loss(
            policy, rows, part, old_logp, ref_logp, cfg, max_length, with_entropy
        )
        share = loss_share(rows.mask[part], *whole, cfg.aggregation)
        (share * loss).backward()
        tokens = float(rows.mask[part].sum())
        ref_kl = share * kl_term.item() if kl_term is not None else 0.0
        parts = [
            share * loss.item(),
            ref_kl,
            loss_stats["clip_fraction"] * tokens,
            loss_stats["approx_kl"] * tokens,
            loss_stats["entropy_sum"],
        ]
        sums += torch.tensor(parts, dtype=torch.float64)
    return sums


STAT_SUMS = 5  # the sums `accumulate_gradients` returns


def minibatch_stats(sums: Tensor, whole_tokens: float) -> dict[str, float]:
    """`accumulate_gradients`' sums (over all parts, and ranks) as the minibatch's loss, reference KL and
    token-mean clip fraction and KL. With one micro-batch these are exactly the unsplit numbers."""
    tokens = max(whole_tokens, 1.0)
    return {
        "loss": float(sums[0]),
        "ref_kl": float(sums[1]),
        "clip_fraction": float(sums[2]) / tokens,
        "kl": float(sums[3]) / tokens,
    }


def _update(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    rows: TrainingRows,
    selected: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    cfg: GRPOConfig,
    max_length: int | None,
    with_entropy: bool,
) -> dict[str, float]:
    """One gradient update on the `selected` rows (accumulated over micro-batches when `cfg.micro_batch_tokens`
    is set); returns its loss, clip fraction, KL estimates and grad norm, and with `with_entropy` π_θ's token-mean
    entropy before it (`old_logp` None: the old log-probs are the loss pass's own)."""
    optimizer.zero_grad(set_to_none=True)
    whole = (float(selected.sum()), float(rows.mask[selected].sum()))
    sums = accumulate_gradients(policy, rows, selected, old_logp, ref_logp, cfg, max_length, whole, with_entropy)
    stats = minibatch_stats(sums, whole[1])
    if with_entropy:
        stats["entropy"] = float(sums[4]) / max(whole[1], 1.0)
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.model.parameters(), cfg.max_grad_norm)
    optimizer.step()
    return {**stats, "grad_norm": grad_norm.item()}
