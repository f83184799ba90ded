"""GRPO (docs/methods.md#grpo) with the DAPO and Dr. GRPO variants chosen by config: group advantages, the
clipped surrogate, and one RL step over a batch of rollouts.

Variants: clip-higher = `clip_high > clip_low`; Dr. GRPO's advantages = `advantage_scale="none"`;
DAPO's token-level loss = `aggregation="token-mean"`. The KL-to-reference term (k3, per-sample weights,
docs/methods.md#kl-to-the-reference) is off by default (`kl_beta` 0, as DAPO uses for verifiable rewards);
CLPO turns it on. Groups whose rewards are all equal have zero advantage and are left out of the update;
dynamic sampling's refills are the filter stage's.
"""

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from rlvr.trainer.generation import Sample
from rlvr.trainer.policy import Policy


def group_advantages(
    rewards: Tensor,
    group_index: Tensor,
    *,
    scale: Literal["std", "none"] = "std",
    eps: float = 1e-6,
) -> Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) for the group g of sample i (scale="none": r_i - mean_g).

    std_g is the population std (divide by the group size, not size - 1): every group's advantages
    then have unit variance whatever its size, which keeps ragged groups on one scale; a group of one
    gets 0. Groups are identified by any non-negative ids, in any order.
    """
    rewards = rewards.to(torch.float64)
    n_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    sizes = torch.bincount(group_index, minlength=n_groups).to(torch.float64)
    sums = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, rewards)
    means = sums / sizes.clamp(min=1)
    centered = rewards - means[group_index]
    if scale == "none":
        return centered.to(torch.float32)
    variances = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, centered**2) / sizes.clamp(min=1)
    return (centered / (variances.sqrt()[group_index] + eps)).to(torch.float32)


def effective_ratio(rewards: Tensor, group_index: Tensor) -> float:
    """Share of groups whose rewards are not all equal: the groups that carry a learning signal."""
    if rewards.numel() == 0:
        return 0.0
    n_groups = int(group_index.max()) + 1
    rewards = rewards.to(torch.float64)
    highest = torch.full((n_groups,), float("-inf"), dtype=torch.float64).scatter_reduce(
        0, group_index, rewards, "amax"
    )
    lowest = torch.full((n_groups,), float("inf"), dtype=torch.float64).scatter_reduce(0, group_index, rewards, "amin")
    present = torch.bincount(group_index, minlength=n_groups) > 0
    return float(((highest > lowest) & present).sum() / present.sum())


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    completion_ids: Tensor,
    pad_id: int,
    completion_mask: Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """log π(completion token | prompt, earlier tokens) per position, and which positions are real.

    `prompt_ids` [R, P] are left-padded with `pad_id` (as the tokenizer pads for generation) and
    `completion_ids` [R, T] right-padded. Logits are divided by `temperature` first. Position ids restart
    at 0 on each row's first real prompt token, as `generate` numbers them, so these logprobs match the
    sampler's. The mask defaults to
    `completion_ids != pad_id`; pass `completion_mask` when a pad id can be a real token (a model whose
    pad token is its eos, or a sampled pad), as `grpo_step` does.
    """
    if completion_mask is None:
        completion_mask = completion_ids != pad_id
    prompt_attention = (prompt_ids != pad_id).long()
    attention = torch.cat([prompt_attention, torch.ones_like(completion_ids)], dim=1)
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids).logits
    prompt_length, completion_length = prompt_ids.shape[1], completion_ids.shape[1]
    next_token_logits = logits[:, prompt_length - 1 : prompt_length - 1 + completion_length].float() / temperature
    logp = torch.log_softmax(next_token_logits, dim=-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    return logp, completion_mask.to(logp.dtype)


def clipped_surrogate_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    aggregation: Literal["seq-mean-token-mean", "token-mean"],
) -> tuple[Tensor, dict[str, float]]:
    """PPO/GRPO loss = -min(ρ A, clip(ρ, 1 - clip_low, 1 + clip_high) A), ρ = exp(logp - old_logp).

    aggregation: "seq-mean-token-mean" averages tokens within each sequence, then sequences (GRPO's
    1/G Σ 1/|o_i|); "token-mean" averages all tokens of the batch (DAPO; long answers weigh per token).
    stats: clip_fraction = share of tokens where the clipped term is the one taken (no gradient there);
    approx_kl = token mean of (ρ - 1) - log ρ, the k3 estimate of KL(π_old ‖ π_θ).
    """
    mask = mask.to(logp.dtype)
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    advantage = advantages.to(logp.dtype).unsqueeze(-1)
    unclipped = ratio * advantage
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantage
    per_token = -torch.minimum(unclipped, clipped)
    loss = aggregate(per_token, mask, aggregation)
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1)
        clip_fraction = ((clipped < unclipped).to(mask.dtype) * mask).sum() / tokens
        approx_kl = (((ratio - 1) - log_ratio) * mask).sum() / tokens
    return loss, {"clip_fraction": float(clip_fraction), "approx_kl": float(approx_kl)}


def aggregate(per_token: Tensor, mask: Tensor, aggregation: Literal["seq-mean-token-mean", "token-mean"]) -> Tensor:
    """A per-token loss [R, T] to a scalar: mean over each sequence's tokens then over sequences, or over
    every token of the batch."""
    if aggregation == "seq-mean-token-mean":
        return ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if aggregation == "token-mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    raise ValueError(f"unknown aggregation '{aggregation}'; expected seq-mean-token-mean or token-mean")


def reference_kl(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    weights: Tensor,
    aggregation: Literal["seq-mean-token-mean", "token-mean"],
) -> Tensor:
    """The KL-to-reference term: per token the k3 estimator D = π_ref/π_θ - log(π_ref/π_θ) - 1 (unbiased,
    never negative), times each sample's weight (CLPO's difficulty-aware s(label)), aggregated like the loss."""
    log_ratio = ref_logp - logp
    per_token = (torch.exp(log_ratio) - log_ratio - 1) * weights.to(logp.dtype).unsqueeze(-1)
    return aggregate(per_token, mask.to(logp.dtype), aggregation)


class GRPOConfig(BaseModel):
    """One RL step's optimisation settings.

    `lr` and `weight_decay` are for `make_optimizer` (grpo_step uses the optimizer it is given).
    `minibatches`: gradient updates per RL step, each on a contiguous slice of the step's groups, all
    against the same old logprobs; more than one reuses each generation for several updates.
    `temperature`: logits are divided by it before the log-softmax of the loss. 1.0 (default) trains
    the untempered policy even when rollouts were sampled hotter (exploration); setting it to the
    sampling temperature makes the ratio exact against the sampled distribution (TRL/verl do this).
    On the earlier addition task 1.0 did as well or better with rollouts at temperature 2.5.
    """

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(default=1e-3, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    clip_high: float = Field(default=0.2, ge=0)
    minibatches: int = Field(default=1, ge=1)
    max_grad_norm: float = Field(default=1.0, gt=0)
    advantage_scale: Literal["std", "none"] = "std"
    aggregation: Literal["seq-mean-token-mean", "token-mean"] = "seq-mean-token-mean"
    temperature: float = Field(default=1.0, gt=0)
    kl_beta: float = Field(
        default=0.0, ge=0, description="β of the KL-to-reference term (k3); 0 leaves it out (no reference model)"
    )


@dataclass
class RolloutBatch:
    """The rollouts of one RL step: `samples[k].prompt_index` indexes `prompts` (= the group), and
    `rewards[k]` is the reward of `samples[k]`."""

    prompts: list[str]
    samples: list[Sample]
    rewards: list[float]
    kl_weights: list[float] | None = None  # per prompt (group): the factor on β for its samples


def _padded(rows: list[list[int]], pad_id: int, side: Literal["left", "right"]) -> Tensor:
    width = max(len(row) for row in rows)
    if side == "left":
        return torch.tensor([[pad_id] * (width - len(row)) + row for row in rows], dtype=torch.long)
    return torch.tensor([row + [pad_id] * (width - len(row)) for row in rows], dtype=torch.long)


@dataclass
class TrainingRows:
    """The samples of the groups that carry signal, as padded tensors (one row per sample)."""

    prompt_ids: Tensor  # [R, P] left-padded
    completion_ids: Tensor  # [R, T] right-padded
    mask: Tensor  # [R, T] True on real completion tokens
    advantages: Tensor  # [R]
    groups: Tensor  # [R] group (prompt) index of each row
    active_groups: Tensor  # the groups with a non-zero advantage
    kl_weights: Tensor  # [R] the factor on β of each row (1 unless the batch gives weights)


def batch_stats(rewards: Tensor, group_index: Tensor) -> dict[str, float]:
    """The metrics of a step before any update (the update metrics start at 0)."""
    return {
        "loss": 0.0,
        "clip_fraction": 0.0,
        "kl": 0.0,
        "ref_kl": 0.0,
        "grad_norm": 0.0,
        "updates": 0.0,
        "mean_reward": float(rewards.mean()) if rewards.numel() else 0.0,
        "reward_std": float(rewards.std(correction=0)) if rewards.numel() else 0.0,
        "effective_ratio": effective_ratio(rewards, group_index),
    }


def training_rows(policy: Policy, batch: RolloutBatch, advantages: Tensor, group_index: Tensor) -> TrainingRows | None:
    """The rows of the groups whose advantages are not all zero, or None when there is none."""
    active_groups = torch.unique(group_index[advantages != 0])
    if active_groups.numel() == 0:
        return None
    rows = torch.isin(group_index, active_groups).nonzero().squeeze(1).tolist()
    pad_id = policy.tokenizer.pad_token_id
    prompt_tokens = policy.tokenizer(batch.prompts)["input_ids"]
    prompt_ids = _padded([prompt_tokens[batch.samples[k].prompt_index] for k in rows], pad_id, "left")
    completion_ids = _padded([batch.samples[k].completion_ids for k in rows], pad_id, "right")
    lengths = torch.tensor([batch.samples[k].n_tokens for k in rows])
    mask = torch.arange(completion_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    per_group = batch.kl_weights or [1.0] * len(batch.prompts)
    kl_weights = torch.tensor([per_group[batch.samples[k].prompt_index] for k in rows], dtype=torch.float32)
    return TrainingRows(
        prompt_ids, completion_ids, mask, advantages[rows], group_index[rows], active_groups, kl_weights
    )


def grpo_step(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    cfg: GRPOConfig,
    reference: Policy | None = None,
) -> dict[str, float]:
    """One RL step: advantages per group, old logprobs once (no grad), then `cfg.minibatches` clipped
    updates over the groups that carry signal; with `cfg.kl_beta` > 0, plus β x the KL to `reference`.

    Returns loss, clip_fraction, kl (k3 estimate of KL(π_old ‖ π_θ)), ref_kl (the reference term before
    β), grad_norm (means over the updates; grad_norm before clipping), updates (0 when every group is
    uniform), mean_reward, reward_std (population, over all samples) and effective_ratio.
    """
    if cfg.kl_beta > 0 and reference is None:
        raise ValueError("kl_beta > 0 needs the reference policy")
    if len(batch.samples) != len(batch.rewards):
        raise ValueError(f"{len(batch.samples)} samples but {len(batch.rewards)} rewards")
    rewards = torch.tensor(batch.rewards, dtype=torch.float32)
    group_index = torch.tensor([s.prompt_index for s in batch.samples], dtype=torch.long)
    stats = batch_stats(rewards, group_index)
    if not batch.samples:
        return stats
    advantages = group_advantages(rewards, group_index, scale=cfg.advantage_scale)
    rows = training_rows(policy, batch, advantages, group_index)
    if rows is None:
        return stats
    stats.update(_clipped_updates(policy, optimizer, rows, cfg, reference if cfg.kl_beta > 0 else None))
    return stats


def _clipped_updates(
    policy: Policy, optimizer: torch.optim.Optimizer, rows: TrainingRows, cfg: GRPOConfig, reference: Policy | None
) -> dict[str, float]:
    """`cfg.minibatches` updates, each on a contiguous slice of the active groups, against one set of
    old logprobs (and reference logprobs when there is a KL term); returns the mean loss, clip fraction,
    KL estimates and grad norm, and the update count."""
    model, pad_id = policy.model, policy.tokenizer.pad_token_id
    everything = (rows.prompt_ids, rows.completion_ids, pad_id, rows.mask, cfg.temperature)
    with torch.no_grad():
        old_logp, _ = completion_logprobs(model, *everything)
        ref_logp = completion_logprobs(reference.model, *everything)[0] if reference is not None else None
    slices = torch.tensor_split(rows.active_groups, min(cfg.minibatches, rows.active_groups.numel()))
    totals = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "ref_kl": 0.0, "grad_norm": 0.0}
    for groups in slices:
        selected = torch.isin(rows.groups, groups)
        logp, token_mask = completion_logprobs(
            model,
            rows.prompt_ids[selected],
            rows.completion_ids[selected],
            pad_id,
            rows.mask[selected],
            cfg.temperature,
        )
        loss, loss_stats = clipped_surrogate_loss(
            logp,
            old_logp[selected],
            rows.advantages[selected],
            token_mask,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            aggregation=cfg.aggregation,
        )
        if ref_logp is not None:
            ref_kl = reference_kl(logp, ref_logp[selected], token_mask, rows.kl_weights[selected], cfg.aggregation)
            loss = loss + cfg.kl_beta * ref_kl
            totals["ref_kl"] += ref_kl.item()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        totals["loss"] += loss.item()
        totals["clip_fraction"] += loss_stats["clip_fraction"]
        totals["kl"] += loss_stats["approx_kl"]
        totals["grad_norm"] += grad_norm.item()
    optimizer.zero_grad(set_to_none=True)
    return {**{name: value / len(slices) for name, value in totals.items()}, "updates": float(len(slices))}
