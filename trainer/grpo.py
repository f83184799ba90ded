"""GRPO (docs/methods.md#grpo) and its variants, each chosen by `GRPOConfig`: group advantages, the clipped
surrogate, the loss aggregations, and one RL step over a batch of rollouts.

Variants: clip-higher = `clip_high > clip_low`; Dr. GRPO = `advantage_scale="none"` with
`aggregation="token-sum"`; DAPO = `aggregation="token-mean"`, clip-higher and `overlong` shaping; Lite PPO's
group-mean batch-std advantages = `advantage_scale="batch"`; GDPO = `advantage_components`; dual-clip PPO =
`dual_clip`; a truncated importance weight = `ratio_cap`; `advantage_clip` bounds |A|. The KL-to-reference
term (k3, per-sample weights, docs/methods.md#kl-to-the-reference) is off by default (`kl_beta` 0, as DAPO
uses for verifiable rewards); CLPO turns it on. Groups whose advantages are all zero are left out of the
update; dynamic sampling's refills are the filter stage's. Every default reproduces plain GRPO.
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from rlvr.trainer import prompts
from rlvr.trainer.generation import Sample
from rlvr.trainer.logprobs import completion_logprobs as completion_logprobs  # re-exported: sft, distributed
from rlvr.trainer.logprobs import completion_logprobs_and_entropy as completion_logprobs_and_entropy
from rlvr.trainer.policy import Policy
from rlvr.trainer.turn_credit import token_advantages, turn_returns

Aggregation = Literal["seq-mean-token-mean", "token-mean", "token-sum"]
AdvantageScale = Literal["std", "batch", "none"]
Overlong = Literal["none", "mask", "penalty"]


def group_advantages(
    rewards: Tensor,
    group_index: Tensor,
    *,
    scale: AdvantageScale = "std",
    eps: float = 1e-6,
) -> Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) for the group g of sample i; scale="batch": divided by the std
    of every reward of the batch instead (Lite PPO: robust when a group's std is tiny); "none": r_i - mean_g.

    Stds are population stds (divide by the count, not count - 1): every group's advantages then have
    unit variance whatever its size, which keeps ragged groups on one scale; a group of one gets 0. Groups
    are identified by any non-negative ids, in any order.
    """
    rewards = rewards.to(torch.float64)
    n_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    sizes = torch.bincount(group_index, minlength=n_groups).to(torch.float64)
    sums = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, rewards)
    means = sums / sizes.clamp(min=1)
    centered = rewards - means[group_index]
    if scale == "none":
        return centered.to(torch.float32)
    if scale == "batch":
        return (centered / (rewards.std(correction=0) + eps)).to(torch.float32)
    variances = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, centered**2) / sizes.clamp(min=1)
    return (centered / (variances.sqrt()[group_index] + eps)).to(torch.float32)


def semantic_entropy_scale(
    answers: list[str | None], group_index: Tensor, alpha: float, weighting: str = "linear"
) -> Tensor:
    """SEED-GRPO's factor on each sample's advantage (docs/methods.md#seed-grpo): its group's answers are
    clustered by equal meaning (the verifier's `extracted` value; a missing one is a cluster of its own),
    SE = -Σ_k p_k log p_k with p_k = |C_k| / G, and the factor is f(alpha · SE / log G) with f(x) = 1 - x
    ("linear") or exp(-x) ("exponential"): 1 where every answer agrees, smallest where all differ. A group of
    one keeps factor 1. Returns float32 [N]."""
    factors = torch.ones(len(answers), dtype=torch.float64)
    members: dict[int, list[int]] = {}
    for k, group in enumerate(group_index.tolist()):
        members.setdefault(group, []).append(k)
    for rows in members.values():
        if len(rows) < 2:
            continue
        counts: dict[object, int] = {}
        for k in rows:
            key: object = answers[k] if answers[k] is not None else ("missing", k)
            counts[key] = counts.get(key, 0) + 1
        shares = torch.tensor(list(counts.values()), dtype=torch.float64) / len(rows)
        x = alpha * float(-(shares * shares.log()).sum()) / math.log(len(rows))
        factors[rows] = 1.0 - x if weighting == "linear" else math.exp(-x)
    return factors.to(torch.float32)


def gdpo_advantages(
    components: Tensor,
    group_index: Tensor,
    weights: Tensor,
    *,
    scale: AdvantageScale = "std",
    eps: float = 1e-6,
) -> Tensor:
    """GDPO (docs/methods.md#gdpo): each reward component [N, K] normalised within its group on its own
    (`group_advantages` with `scale`), S_i = Σ_k w_k A_i^(k), then A_i = S_i / (std_batch S + eps).

    Normalising each component separately keeps reward combinations apart that one normalised sum would
    map to the same advantages; the batch std makes the scale independent of K. GDPO also subtracts
    mean_batch S, but every A^(k) is centred within its group, so that mean is 0 up to rounding, and
    subtracting the rounding would give groups whose rewards are all equal a spurious non-zero advantage.
    """
    per_component = [
        group_advantages(components[:, k], group_index, scale=scale, eps=eps) for k in range(components.shape[1])
    ]
    combined = (torch.stack(per_component, dim=1).to(torch.float64) * weights.to(torch.float64)).sum(dim=1)
    return (combined / (combined.std(correction=0) + eps)).to(torch.float32)


def overlong_penalty(n_tokens: Tensor, max_length: int, buffer: int) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward: 0 up to max_length - buffer tokens, then
    falling linearly to -1 at max_length (a truncated response gets -1):
    R_len = clamp(((max_length - buffer) - |y|) / buffer, -1, 0).

    It teaches the policy to finish before the limit without the all-or-nothing cliff of rewarding a
    truncated response 0.
    """
    if not 1 <= buffer <= max_length:
        raise ValueError(f"overlong_buffer must be between 1 and the max length {max_length}, got {buffer}")
    start = max_length - buffer
    return ((start - n_tokens.to(torch.float32)) / buffer).clamp(min=-1.0, max=0.0)


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


def clipped_surrogate_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    aggregation: Aggregation,
    dual_clip: float | None = None,
    ratio_cap: float | None = None,
    max_length: int | None = None,
    token_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO/GRPO loss ℓ = -min(ρ A, clip(ρ, 1 - clip_low, 1 + clip_high) A), ρ = exp(logp - old_logp),
    aggregated over the real tokens (`aggregate`; "token-sum" needs `max_length`).

    dual_clip c (> 1): for A < 0 the objective is max(min(...), c A), so a token whose ratio has grown
    far past the clip costs at most c |A| and gives no gradient (dual-clip PPO; without it ρ A is unbounded).
    ratio_cap C (> 1 + clip_high): the unclipped term uses ρ' = ρ · sg(min(ρ, C) / ρ), whose value is
    min(ρ, C) and whose gradient is min(ρ, C) A ∇log π: a truncated importance weight (TIS-style) that
    keeps a bounded gradient where dual clip drops it. With C above the upper clip it only ever acts on A < 0.
    stats: clip_fraction = share of tokens whose gradient a clip removes (the clipped term or the dual-clip
    bound is the one taken); approx_kl = token mean of (ρ - 1) - log ρ, the k3 estimate of KL(π_old ‖ π_θ).
    token_weight [R, T] (detached): each token's objective times it (decoupled PPO's π_prox / π_behaviour).
    advantages: [R], or [R, T] for an advantage per token (an episode's turns under `turn_credit="return_to_go"`).
    """
    if ratio_cap is not None and ratio_cap <= 1.0 + clip_high:
        raise ValueError(f"ratio_cap {ratio_cap} must exceed 1 + clip_high = {1.0 + clip_high}")
    mask = mask.to(logp.dtype)
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    advantage = advantages.to(logp.dtype)
    if advantage.dim() == 1:  # one advantage a row ([R, T]: one a token, `turn_credit`)
        advantage = advantage.unsqueeze(-1)
    weight = ratio if ratio_cap is None else ratio * (ratio.clamp(max=ratio_cap) / ratio).detach()
    unclipped = weight * advantage
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantage
    objective = torch.minimum(unclipped, clipped)
    cut = clipped < unclipped
    if dual_clip is not None:
        bound = dual_clip * advantage
        bounded = (advantage < 0) & (bound > objective)
        objective = torch.where(bounded, bound, objective)
        cut = cut | bounded
    if token_weight is not None:
        objective = objective * token_weight.to(objective.dtype)
    loss = aggregate(-objective, mask, aggregation, max_length)
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1)
        clip_fraction = (cut.to(mask.dtype) * mask).sum() / tokens
        approx_kl = (((ratio - 1) - log_ratio) * mask).sum() / tokens
    return loss, {"clip_fraction": float(clip_fraction), "approx_kl": float(approx_kl)}


def aggregate(per_token: Tensor, mask: Tensor, aggregation: Aggregation, max_length: int | None = None) -> Tensor:
    """A per-token loss [R, T] to a scalar (docs/methods.md#loss-aggregation).

    "seq-mean-token-mean": mean over each sequence's tokens, then over sequences (GRPO);
    "token-mean": mean over every token of the batch (DAPO); "token-sum": the sum over every token divided
    by the constant R x max_length (Dr. GRPO: no length normalisation, so no length bias, and the scale
    does not move with the batch's lengths).
    """
    if aggregation == "seq-mean-token-mean":
        return ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if aggregation == "token-mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if aggregation == "token-sum":
        if max_length is None:
            raise ValueError("aggregation 'token-sum' needs max_length (the rollouts' max_new_tokens)")
        return (per_token * mask).sum() / (per_token.shape[0] * max_length)
    raise ValueError(f"unknown aggregation '{aggregation}'; expected seq-mean-token-mean, token-mean or token-sum")


def reference_kl(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    weights: Tensor,
    aggregation: Aggregation,
    max_length: int | None = None,
) -> Tensor:
    """The KL-to-reference term: per token the k3 estimator D = π_ref/π_θ - log(π_ref/π_θ) - 1 (unbiased,
    never negative), times each sample's weight (CLPO's difficulty-aware s(label)), aggregated like the loss."""
    log_ratio = ref_logp - logp
    per_token = (torch.exp(log_ratio) - log_ratio - 1) * weights.to(logp.dtype).unsqueeze(-1)
    return aggregate(per_token, mask.to(logp.dtype), aggregation, max_length)


class GRPOConfig(BaseModel):
    """One RL step's optimisation settings; every default gives plain GRPO (docs/methods.md#grpo has the table).

    `lr` and `weight_decay` are for `make_optimizer` (grpo_step uses the optimizer it is given).
    `minibatches`: gradient updates per RL step, each on a contiguous slice of the step's groups, all
    against the same old logprobs; more than one reuses each generation for several updates.
    `temperature`: logits are divided by it before the log-softmax of the loss. 1.0 (default) trains
    the untempered policy even when rollouts were sampled hotter (exploration); setting it to the
    sampling temperature makes the ratio exact against the sampled distribution (TRL/verl do this).
    On the earlier addition task 1.0 did as well or better with rollouts at temperature 2.5.
    `autocast` and `gradient_checkpointing` are for large models on a GPU (`training_precision`); both run on
    the CPU too, where bf16 is slower than float32.
    `micro_batch_tokens`: gradient accumulation. Each minibatch's rows go through forward and backward in
    micro-batches of at most this many padded tokens (rows x (prompt width + completion width), the widths
    of the step's padded tensors, which is what the forward pass holds in memory); a row wider than the budget
    is a micro-batch of its own. Rows are split regardless of groups (advantages are already computed), each
    micro-batch's loss is weighted by its share of the minibatch (`loss_share`), and the minibatch still makes
    one clipped optimizer step: the update is the unsplit one up to float summation order. The no-grad passes
    (old logprobs with their entropy, reference logprobs) go through the same micro-batches, so no pass holds
    logits for more rows than one micro-batch. None (default): on a GPU, a budget from its free memory
    (`micro_batch_budget`); elsewhere one forward and backward per minibatch (the CPU's numbers do not depend on
    how much memory is free).
    """

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(default=1e-3, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    clip_high: float = Field(default=0.2, ge=0)
    dual_clip: float | None = Field(default=None, gt=1, description="c of dual-clip PPO: A < 0 costs at most c|A|")
    ratio_cap: float | None = Field(
        default=None, description="truncate the unclipped term's ratio at this value (detached weight); > 1 + clip_high"
    )
    minibatches: int = Field(default=1, ge=1)
    max_grad_norm: float = Field(default=1.0, gt=0)
    advantage_scale: AdvantageScale = "std"
    advantage_components: dict[str, float] | None = Field(
        default=None,
        min_length=1,
        description="GDPO: reward component name -> weight; each is normalised in its group on its own",
    )
    advantage_clip: float | None = Field(default=None, gt=0, description="clamp advantages to [-c, c]")
    semantic_entropy: float | None = Field(
        default=None,
        exclude_if=lambda value: value is None,  # left out of dumps (so of ids) when off: earlier runs keep theirs
        ge=0,
        le=1,
        description=(
            "SEED-GRPO's alpha: scale each group's advantages by f(alpha x SE / log G), SE the entropy of its "
            "answers clustered by the verifier's extracted value; None: off"
        ),
    )
    semantic_entropy_weighting: Literal["linear", "exponential"] = Field(
        default="linear",
        exclude_if=lambda value: value == "linear",
        description="SEED-GRPO's f: 1 - x (linear) or exp(-x)",
    )
    aggregation: Aggregation = "seq-mean-token-mean"
    overlong: Overlong = "none"
    overlong_buffer: int | None = Field(
        default=None, ge=1, description="tokens before the max length where the penalty ramps"
    )
    temperature: float = Field(default=1.0, gt=0)
    kl_beta: float = Field(
        default=0.0, ge=0, description="β of the KL-to-reference term (k3); 0 leaves it out (no reference model)"
    )
    micro_batch_tokens: int | None = Field(
        default=None,
        ge=1,
        description=(
            "padded tokens per forward/backward (every pass). None: on CUDA floor(0.7 x (free GPU memory - gradients"
            " and optimizer moments not yet allocated) / bytes per token), bytes per token = 4 x (3V + L(10H + 4I))"
            " for vocabulary V, L layers, hidden H, MLP width I (checkpointing: 4 x (3V + LH + 10H + 4I)); on the"
            " CPU the whole minibatch at once"
        ),
    )
    autocast: Literal["none", "bf16"] = Field(
        default="none", description="bf16: the step's forward passes under torch.autocast (weights stay float32)"
    )
    gradient_checkpointing: bool = Field(
        default=False, description="recompute activations in backward instead of keeping them (less memory)"
    )
    decoupled: bool = Field(
        default=False,
        exclude_if=lambda value: value is False,  # left out of dumps (so of ids) when off
        description=(
            "for stale samples (flow.async_level > 0): clip around the policy entering the step (π_prox, one "
            "more no-grad pass) and weight each token by π_prox / π_behaviour (capped at ratio_cap when set): "
            "AReaL's decoupled PPO; off: clip around the sampling policy itself"
        ),
    )
    fused_head: bool | None = Field(
        default=None,
        exclude_if=lambda value: value is None,  # left out of dumps (so of ids) at auto
        description=(
            "apply the LM head block by block, never keeping [rows, tokens, vocabulary] logits "
            "(trainer/fused_head.py); None (auto): on CUDA for Llama/Qwen2/Qwen3/Mistral, off on the CPU"
        ),
    )

    turn_credit: Literal["trajectory", "return_to_go"] = Field(
        default="trajectory",
        exclude_if=lambda value: value == "trajectory",  # left out of dumps (so of ids) at the default
        description=(
            "an environment's episodes: every sampled token gets its trajectory's advantage (trajectory), or each "
            "assistant turn the group advantage of the reward still to come from it (return_to_go; "
            "trainer/turn_credit.py, docs/training.md)"
        ),
    )

    @model_validator(mode="after")
    def _consistent(self) -> "GRPOConfig":
        if self.turn_credit != "trajectory" and (self.advantage_components or self.semantic_entropy is not None):
            raise ValueError("turn_credit=return_to_go works on the reward alone, not with GDPO or SEED-GRPO")
        if self.ratio_cap is not None and self.ratio_cap <= 1.0 + self.clip_high:
            raise ValueError(f"ratio_cap must exceed 1 + clip_high = {1.0 + self.clip_high}")
        if self.overlong == "penalty" and self.overlong_buffer is None:
            raise ValueError('overlong="penalty" needs overlong_buffer (tokens of the linear ramp)')
        return self

    @property
    def needs_max_length(self) -> bool:
        """Whether a step needs the rollouts' max_new_tokens (the token-sum constant, the penalty's L_max)."""
        return self.aggregation == "token-sum" or self.overlong == "penalty"


@dataclass
class RolloutBatch:
    """The rollouts of one RL step: `samples[k].prompt_index` indexes `prompts` (= the group), and
    `rewards[k]` is the reward of `samples[k]`; `components[k]` its reward components (GDPO) and
    `max_new_tokens` the sampling limit of one completion (one turn of an episode: the overlong penalty's L_max);
    `max_sampled_tokens`, for an environment's episodes, how many tokens one episode may sample in all (token-sum's
    constant; one-turn rollouts: `max_new_tokens`)."""

    prompts: list[str]
    samples: list[Sample]
    rewards: list[float]
    kl_weights: list[float] | None = None  # per prompt (group): the factor on β for its samples
    components: list[dict[str, float]] | None = None
    max_new_tokens: int | None = None
    answers: list[str | None] | None = None  # per sample: the verifier's extracted answer (SEED-GRPO)
    # Per sample, for an environment's episodes (None: a one-turn rollout): the opening's token ids, which the
    # loss conditions on instead of the tokenized prompt, and the loss mask over completion_ids (0 on the
    # environment's tokens: tool output, a user's follow-up).
    prompt_token_ids: list[list[int] | None] | None = None
    loss_masks: list[list[int] | None] | None = None
    # Per sample, its assistant turns: where each starts in completion_ids and its reward from the environment
    # (None: none given); `turn_credit="return_to_go"` reads them. None: one turn from token 0, without a reward.
    turn_starts: list[list[int] | None] | None = None
    turn_rewards: list[list[float | None] | None] | None = None
    reward_errors: int = 0  # the step's rollouts left out because their verdict failed (status error)
    max_sampled_tokens: int | None = None
    rollout_ids: list[str] | None = None  # per sample: the rollout it is (what the train stage records as trained)

    @property
    def token_sum_length(self) -> int | None:
        """Token-sum's per-sample constant: the most tokens one rollout may sample (environment tokens aside)."""
        return self.max_sampled_tokens or self.max_new_tokens


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
    advantages: Tensor  # [R], or [R, T] one a token (`turn_credit`)
    groups: Tensor  # [R] group (prompt) index of each row
    active_groups: Tensor  # the groups with a non-zero advantage
    kl_weights: Tensor  # [R] the factor on β of each row (1 unless the batch gives weights)
    old_logp: Tensor | None = None  # [R, T] the sampling policy's log-probs, when the samples carry them (stale)
    behaviour_weight: Tensor | None = None  # [R, T] π_prox / π_behaviour per token (decoupled PPO), else None


def batch_stats(rewards: Tensor, group_index: Tensor) -> dict[str, float]:
    """The metrics of a step before any update (the update metrics start at 0)."""
    return {
        "loss": 0.0,
        "clip_fraction": 0.0,
        "kl": 0.0,
        "ref_kl": 0.0,
        "entropy": 0.0,
        "grad_norm": 0.0,
        "updates": 0.0,
        "mean_reward": float(rewards.mean()) if rewards.numel() else 0.0,
        "reward_std": float(rewards.std(correction=0)) if rewards.numel() else 0.0,
        "effective_ratio": effective_ratio(rewards, group_index),
    }


def component_matrix(components: list[dict[str, float]], weights: dict[str, float]) -> tuple[Tensor, Tensor]:
    """The named reward components of every sample [N, K] and their weights [K].

    A sample without a component scores 0 on it (a verdict that errored has no parts and a 0 reward);
    a name that no sample has is a configuration mistake (a typo would otherwise train on zeros).
    """
    names = list(weights)
    missing = [name for name in names if not any(name in parts for parts in components)]
    if missing:
        seen = sorted({name for parts in components for name in parts})
        raise ValueError(f"advantage_components {missing} are in no reward; the rewards have {seen}")
    values = torch.tensor([[parts.get(name, 0.0) for name in names] for parts in components], dtype=torch.float64)
    return values, torch.tensor([weights[name] for name in names], dtype=torch.float64)


def step_advantages(batch: RolloutBatch, rewards: Tensor, group_index: Tensor, cfg: GRPOConfig) -> Tensor:
    """Every sample's advantage under `cfg`: the overlong penalty joins the reward (as one more component
    of weight 1 under GDPO), then group / batch / GDPO normalisation, then the advantage clip. [N], or [N, L]
    (one a completion token) under `turn_credit="return_to_go"`."""
    penalty = None
    if cfg.overlong == "penalty":
        assert batch.max_new_tokens is not None and cfg.overlong_buffer is not None  # checked by grpo_step
        penalty = overlong_penalty(overlong_lengths(batch), batch.max_new_tokens, cfg.overlong_buffer)
    if cfg.advantage_components is not None:
        if batch.components is None or len(batch.components) != len(batch.samples):
            raise ValueError("advantage_components needs the reward components of every sample")
        values, weights = component_matrix(batch.components, cfg.advantage_components)
        if penalty is not None:
            values = torch.cat([values, penalty.unsqueeze(1).to(values.dtype)], dim=1)
            weights = torch.cat([weights, torch.ones(1, dtype=weights.dtype)])
        advantages = gdpo_advantages(values, group_index, weights, scale=cfg.advantage_scale)
    elif cfg.turn_credit == "return_to_go":
        scores = rewards if penalty is None else rewards + penalty
        advantages = episode_turn_advantages(batch, scores, group_index, cfg.advantage_scale)
    else:
        advantages = group_advantages(
            rewards if penalty is None else rewards + penalty, group_index, scale=cfg.advantage_scale
        )
    if cfg.semantic_entropy is not None:
        if batch.answers is None or len(batch.answers) != len(batch.samples):
            raise ValueError("semantic_entropy needs every sample's extracted answer (RolloutBatch.answers)")
        scale = semantic_entropy_scale(batch.answers, group_index, cfg.semantic_entropy, cfg.semantic_entropy_weighting)
        advantages = advantages * scale
    if cfg.advantage_clip is not None:
        advantages = advantages.clamp(-cfg.advantage_clip, cfg.advantage_clip)
    return advantages


def overlong_lengths(batch: RolloutBatch) -> Tensor:
    """[N] the length each sample's overlong penalty reads: a one-turn rollout's completion; an environment's
    episode's longest assistant turn in sampled tokens (each turn samples at most max_new_tokens; the environment's
    tokens between turns are not the model's and never count)."""
    masks = batch.loss_masks or [None] * len(batch.samples)
    starts = batch.turn_starts or [None] * len(batch.samples)
    lengths = []
    for sample, mask, turn_starts in zip(batch.samples, masks, starts):
        if mask is None:
            lengths.append(sample.n_tokens)
            continue
        bounds = [*(turn_starts or [0]), len(mask)]
        lengths.append(max(sum(mask[a:b]) for a, b in zip(bounds, bounds[1:])))
    return torch.tensor(lengths)


def episode_turn_advantages(batch: RolloutBatch, scores: Tensor, group_index: Tensor, scale: AdvantageScale) -> Tensor:
    """[N, L] each completion token's advantage under `turn_credit="return_to_go"` (trainer/turn_credit.py): per
    assistant turn, the group advantage of the reward still to come from it."""
    n = len(batch.samples)
    starts = [s or [0] for s in (batch.turn_starts or [None] * n)]
    given = batch.turn_rewards or [None] * n
    rewards = [list(r or [])[: len(s)] + [None] * (len(s) - len(r or [])) for r, s in zip(given, starts)]
    returns = turn_returns(scores, rewards)
    per_turn = torch.stack(
        [group_advantages(returns[:, t], group_index, scale=scale) for t in range(returns.shape[1])], dim=1
    )
    return token_advantages(per_turn, starts, [len(s.completion_ids) for s in batch.samples])


def training_rows(
    policy: Policy, batch: RolloutBatch, advantages: Tensor, group_index: Tensor, trainable: Tensor | None = None
) -> TrainingRows | None:
    """The rows of the groups whose advantages are not all zero, or None when there is none.

    `trainable` [N] (default all) leaves samples out of the loss, e.g. truncated ones under
    `overlong="mask"`; they still counted in their group's mean and std (the advantages are given).
    """
    keep = torch.ones_like(group_index, dtype=torch.bool) if trainable is None else trainable
    signal = advantages != 0 if advantages.dim() == 1 else (advantages != 0).any(dim=1)
    active_groups = torch.unique(group_index[signal & keep])
    if active_groups.numel() == 0:
        return None
    rows = (torch.isin(group_index, active_groups) & keep).nonzero().squeeze(1).tolist()
    pad_id = policy.tokenizer.pad_token_id
    prompt_ids = _padded(_row_prompt_ids(policy, batch, rows), pad_id, "left")
    completion_ids = _padded([batch.samples[k].completion_ids for k in rows], pad_id, "right")
    lengths = torch.tensor([batch.samples[k].n_tokens for k in rows])
    mask = torch.arange(completion_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    if batch.loss_masks is not None:
        mask &= _padded([_loss_mask(batch, k) for k in rows], 0, "right").bool()[:, : mask.shape[1]]
    per_group = batch.kl_weights or [1.0] * len(batch.prompts)
    kl_weights = torch.tensor([per_group[batch.samples[k].prompt_index] for k in rows], dtype=torch.float32)
    row_advantages = advantages[rows] if advantages.dim() == 1 else advantages[rows][:, : mask.shape[1]]
    tensors = (prompt_ids, completion_ids, mask, row_advantages, group_index[rows], active_groups, kl_weights)
    device = next(policy.model.parameters()).device  # built on the CPU; the model may sit on a GPU
    training = TrainingRows(*(t.to(device) for t in tensors))
    if all(batch.samples[k].logprobs is not None for k in rows):
        stored = [list(batch.samples[k].logprobs or []) for k in rows]
        training.old_logp = torch.tensor([row + [0.0] * (mask.shape[1] - len(row)) for row in stored]).to(device)
    return training


def _row_prompt_ids(policy: Policy, batch: RolloutBatch, rows: list[int]) -> list[list[int]]:
    """Each row's prompt tokens: its episode's opening when it has one, else its group's prompt tokenized."""
    given = batch.prompt_token_ids or [None] * len(batch.samples)
    tokenized = prompts.prompt_ids(policy.tokenizer, batch.prompts)
    return [given[k] or tokenized[batch.samples[k].prompt_index] for k in rows]


def _loss_mask(batch: RolloutBatch, k: int) -> list[int]:
    """Sample k's loss mask over its completion tokens (all 1 for a one-turn rollout)."""
    assert batch.loss_masks is not None
    mask = batch.loss_masks[k]
    n_tokens = len(batch.samples[k].completion_ids)
    if mask is None:
        return [1] * n_tokens
    if len(mask) != n_tokens:
        raise ValueError(f"sample {k}: loss mask of {len(mask)} tokens for {n_tokens} completion tokens")
    return list(mask)


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


def step_rows(
    policy: Policy, batch: RolloutBatch, cfg: GRPOConfig, reference: Policy | None
) -> tuple[dict[str, float], TrainingRows | None]:
    """A step's first half on the whole batch: its checks, its batch stats, and the rows that carry signal
    (advantages as `step_advantages` gives them, truncated samples out under overlong="mask"; None when no
    group carries signal). No model call: data-parallel ranks each compute the same from the same batch."""
    if cfg.kl_beta > 0 and reference is None:
        raise ValueError("kl_beta > 0 needs the reference policy")
    if len(batch.samples) != len(batch.rewards):
        raise ValueError(f"{len(batch.samples)} samples but {len(batch.rewards)} rewards")
    if cfg.needs_max_length and batch.max_new_tokens is None:
        raise ValueError("aggregation 'token-sum' and overlong 'penalty' need the batch's max_new_tokens")
    rewards = torch.tensor(batch.rewards, dtype=torch.float32)
    group_index = torch.tensor([s.prompt_index for s in batch.samples], dtype=torch.long)
    stats = batch_stats(rewards, group_index)
    if not batch.samples:
        return stats, None
    advantages = step_advantages(batch, rewards, group_index, cfg)
    trainable = None
    if cfg.overlong == "mask":
        trainable = torch.tensor([s.finish_reason != "length" for s in batch.samples], dtype=torch.bool)
    return stats, training_rows(policy, batch, advantages, group_index, trainable)


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
    if cfg.decoupled and rows.old_logp is not None:  # stale samples: clip around π_prox, weight by π_prox / π_b
        old_logp, entropy, ref_logp = rollout_logprobs(policy, rows, cfg, reference)
        rows = replace(rows, behaviour_weight=behaviour_weights(old_logp, rows.old_logp, rows.mask, cfg.ratio_cap))
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
    return {**averages, "updates": float(updates)}


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


def behaviour_weights(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, cap: float | None) -> Tensor:
    """Decoupled PPO's per-token weight π_prox / π_behaviour [R, T] (1 on padding), capped at `cap` when set."""
    weight = torch.exp(prox_logp - behaviour_logp).masked_fill(~mask, 1.0)
    return weight if cap is None else weight.clamp(max=cap)


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
                policy.model, rows.prompt_ids[part], rows.completion_ids[part], pad_id, cfg.temperature, cfg.fused_head
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
            model, prompt_ids, completion_ids, pad_id, temperature, cfg.fused_head
        )
        entropy_sum = float((entropy * token_mask).sum())
    else:
        logp = completion_logprobs(model, prompt_ids, completion_ids, pad_id, token_mask, temperature, cfg.fused_head)[
            0
        ]
    old = logp.detach() if old_logp is None else old_logp[selected]
    loss, loss_stats = clipped_surrogate_loss(
        logp,
        old,
        rows.advantages[selected],
        token_mask,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        aggregation=cfg.aggregation,
        dual_clip=cfg.dual_clip,
        ratio_cap=None if rows.behaviour_weight is not None else cfg.ratio_cap,  # decoupled: it caps the weight
        max_length=max_length,
        token_weight=None if rows.behaviour_weight is None else rows.behaviour_weight[selected],
    )
    loss_stats["entropy_sum"] = entropy_sum
    if ref_logp is None:
        return loss, None, loss_stats
    kl_term = reference_kl(logp, ref_logp[selected], token_mask, rows.kl_weights[selected], cfg.aggregation, max_length)
    return loss + cfg.kl_beta * kl_term, kl_term, loss_stats


def loss_share(part_mask: Tensor, whole_sequences: float, whole_tokens: float, aggregation: Aggregation) -> float:
    """The weight on a part's aggregate (`part_mask` [r, T] its rows' real tokens) so that the parts of a
    minibatch sum to the whole minibatch's aggregate: the aggregate is a mean over the part's own sequences
    (seq-mean-token-mean; token-sum divides by the row count too) or its own tokens (token-mean), so own /
    whole count. Used by micro-batches here and by the data-parallel ranks (trainer/distributed.py)."""
    if aggregation == "token-mean":
        own, whole = float(part_mask.sum()), whole_tokens
    elif aggregation in ("seq-mean-token-mean", "token-sum"):
        own, whole = float(part_mask.shape[0]), whole_sequences
    else:  # a new aggregation needs its own share here, or the parts' sum is not the whole minibatch's loss
        raise ValueError(f"no split weighting for aggregation '{aggregation}'")
    return own / max(whole, 1.0)


def micro_batches(rows: TrainingRows, selected: Tensor, budget: int | None) -> list[Tensor]:
    """The `selected` rows [R] (bool) as consecutive micro-batches (bool masks) of at most `budget` padded
    tokens each, at least one row each; `budget` None: the whole selection at once. Every row has the same
    padded width (the step's), so the budget is a row count; groups may straddle micro-batches."""
    if budget is None:
        return [selected]
    width = rows.prompt_ids.shape[1] + rows.completion_ids.shape[1]
    indices = selected.nonzero().squeeze(1)
    chunks = torch.split(indices, max(1, budget // width))
    return [torch.zeros_like(selected).index_fill_(0, chunk, True) for chunk in chunks]


MEMORY_SHARE = 0.7  # of the free GPU memory that micro-batches may plan on (the rest: allocator slack, workspaces)


def token_bytes(config: Any, checkpointing: bool) -> int:
    """Memory one padded token of a micro-batch may need in the loss pass, as float32 (under bf16 autocast most
    of it is half that): the logits, their gradient and one more vocabulary-sized buffer in the backward (3V),
    and what each decoder layer keeps for the backward, about 10H + 4I (norm inputs and outputs, q/k/v, the
    attention output, the MLP's gate, up, activation and product); with checkpointing each layer keeps only its
    input (H) and one layer at a time is recomputed."""
    vocab, hidden, layers = int(config.vocab_size), int(config.hidden_size), int(config.num_hidden_layers)
    width = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    per_layer = 10 * hidden + 4 * width
    kept = layers * hidden + per_layer if checkpointing else layers * per_layer
    return 4 * (3 * vocab + kept)


def unallocated_update_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """What the update will still allocate: each trainable parameter's gradient when it has none, and an Adam-style
    optimizer's two moments when it has no state for it yet (always, without an optimizer to ask). A parameter
    sharded over data-parallel ranks (a DTensor) counts this rank's shard only."""
    total = 0
    for param in model.parameters():
        if not param.requires_grad:
            continue
        held = param.to_local() if isinstance(param, DTensor) else param
        size = held.numel() * held.element_size()
        if param.grad is None:
            total += size
        if optimizer is None or not optimizer.state.get(param):
            total += 2 * size
    return total


def micro_batch_budget(
    model: PreTrainedModel, cfg: GRPOConfig, optimizer: torch.optim.Optimizer | None = None
) -> int | None:
    """`cfg.micro_batch_tokens` when set. Unset: on CUDA, the padded tokens that fit in `MEMORY_SHARE` of the free
    GPU memory (the caching allocator's unused reserve counts as free) after what the update will still allocate,
    at `token_bytes` each; elsewhere None (the whole minibatch, as the CPU always did)."""
    if cfg.micro_batch_tokens is not None:
        return cfg.micro_batch_tokens
    device = next(model.parameters()).device
    if device.type != "cuda":
        return None
    return tokens_that_fit(cuda_free_bytes(device), model, cfg, optimizer)


def cuda_free_bytes(device: torch.device) -> int:
    """The device's free memory plus the caching allocator's reserved but unallocated bytes."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def tokens_that_fit(
    free_bytes: int, model: PreTrainedModel, cfg: GRPOConfig, optimizer: torch.optim.Optimizer | None = None
) -> int:
    """Padded tokens of a micro-batch that fit in `MEMORY_SHARE` of `free_bytes` after what the update will still
    allocate, at `token_bytes` each; at least 1."""
    usable = MEMORY_SHARE * (free_bytes - unallocated_update_bytes(model, optimizer))
    per_token = token_bytes(model.config, cfg.gradient_checkpointing)
    return max(1, int(usable // per_token))


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
