"""GRPO's loss as plain functions on tensors (docs/methods.md#clipped-surrogate): the clipped surrogate with its dual
clip and ratio cap, the loss aggregations, the KL-to-reference term, decoupled PPO's per-token weight, and the share
of a minibatch's loss that one part of it carries (micro-batches, data-parallel ranks). trainer/grpo.py calls them
on the log-probs of a step's rows.
"""

from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["seq-mean-token-mean", "token-mean", "token-sum"]


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


def behaviour_weights(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, cap: float | None) -> Tensor:
    """Decoupled PPO's per-token weight π_prox / π_behaviour [R, T] (1 on padding), capped at `cap` when set."""
    weight = torch.exp(prox_logp - behaviour_logp).masked_fill(~mask, 1.0)
    return weight if cap is None else weight.clamp(max=cap)
