"""The policy objectives besides GRPO's clipped token surrogate (docs/methods.md#objectives), as plain functions on
tensors; `train.grpo.objective` chooses one and trainer/grpo.py calls it on the log-probs of a step's rows.

- GSPO (Zheng et al. 2025): one importance ratio a sequence, the geometric mean of its tokens' ratios, clipped
  around 1 (the paper's ranges are 3e-4 and 4e-4: sequence ratios sit far closer to 1 than token ones).
- CISPO (MiniMax-M1, 2025): every token keeps its gradient; the importance weight is clipped from above and
  detached, so no token drops out of the update as clipped ones do in PPO.
- DisCO (Li et al. 2025): a discriminative objective: raise the scores of a group's right answers and lower those
  of its wrong ones, without clipping and without GRPO's √(p(1-p)) weight on each question, under a squared-hinge
  penalty on KL(π_old ‖ π_θ) above δ.

All take log-probs [R, T], a mask of the real tokens [R, T] and one advantage a row [R] (DisCO reads only its sign:
a row whose reward is above its group's mean is a right answer). Each returns the loss and the stats GRPO's
surrogate returns (clip_fraction, approx_kl).
"""

from typing import Literal

import torch
from torch import Tensor

from rlvr.trainer.grpo_loss import Aggregation, aggregate

Objective = Literal["grpo", "gspo", "cispo", "disco"]
DiscoScore = Literal["logL", "Lratio"]


def _token_kl(ratio: Tensor, log_ratio: Tensor, mask: Tensor) -> float:
    """The k3 estimate of KL(π_old ‖ π_θ), token mean over the real tokens."""
    with torch.no_grad():
        return float((((ratio - 1) - log_ratio) * mask).sum() / mask.sum().clamp(min=1))


def sequence_surrogate_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    aggregation: Aggregation,
    max_length: int | None = None,
    token_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO: s_i = exp(mean over the row's tokens of (logp - old_logp)), the sequence's ratio normalised by its
    length; ℓ_i = -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i), every token of row i carrying ℓ_i,
    aggregated by `aggregation` (seq-mean-token-mean: the mean over sequences, as the paper); `token_weight` [R, T]
    multiplies each token's share (a mismatch correction). clip_fraction: the share of tokens whose sequence the
    clip cuts off."""
    mask = mask.to(logp.dtype)
    log_ratio = logp - old_logp
    lengths = mask.sum(dim=1).clamp(min=1)
    seq_ratio = torch.exp((log_ratio * mask).sum(dim=1) / lengths)
    advantage = advantages.to(logp.dtype)
    unclipped = seq_ratio * advantage
    clipped = torch.clamp(seq_ratio, 1.0 - clip_low, 1.0 + clip_high) * advantage
    objective = torch.minimum(unclipped, clipped)
    per_token = (-objective).unsqueeze(1).expand_as(mask)
    if token_weight is not None:
        per_token = per_token * token_weight.to(per_token.dtype)
    loss = aggregate(per_token, mask, aggregation, max_length)
    with torch.no_grad():
        cut = (clipped < unclipped).to(mask.dtype).unsqueeze(1)
        clip_fraction = float((cut * mask).sum() / mask.sum().clamp(min=1))
    return loss, {"clip_fraction": clip_fraction, "approx_kl": _token_kl(torch.exp(log_ratio), log_ratio, mask)}


def cispo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_high: float,
    aggregation: Aggregation,
    max_length: int | None = None,
    token_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO: ℓ_t = -sg(min(ρ_t, 1 + clip_high)) A log π_θ(o_t), ρ_t = exp(logp - old_logp), aggregated by
    `aggregation` (the paper: token-mean). No lower bound on the weight (the paper set ε_low large and tuned only
    ε_high). Its gradient at ρ = 1 is GRPO's; past the bound the token still pulls, with weight 1 + clip_high.
    `token_weight` [R, T] multiplies each token's term (a mismatch correction). clip_fraction: the share of tokens
    whose weight the bound truncates."""
    mask = mask.to(logp.dtype)
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(max=1.0 + clip_high).detach()
    advantage = advantages.to(logp.dtype)
    if advantage.dim() == 1:
        advantage = advantage.unsqueeze(-1)
    objective = weight * advantage * logp
    if token_weight is not None:
        objective = objective * token_weight.to(objective.dtype)
    loss = aggregate(-objective, mask, aggregation, max_length)
    with torch.no_grad():
        clip_fraction = float(((ratio > 1.0 + clip_high).to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1))
    return loss, {"clip_fraction": clip_fraction, "approx_kl": _token_kl(ratio, log_ratio, mask)}


def disco_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    groups: Tensor,
    *,
    score: DiscoScore = "logL",
    tau: float | None = 10.0,
    delta: float = 1e-4,
    beta: float = 1e3,
) -> tuple[Tensor, dict[str, float]]:
    """DisCO: loss = -mean over groups g of J_g + β · max(KL - δ, 0)², where

        J_g = mean_{o+ ∈ g} s(o+) - τ log mean_{o- ∈ g} exp(s(o-) / τ)     (τ None: - mean_{o-} s(o-), DisCO-b)

    over the groups with at least one right (A > 0) and one wrong (A < 0) row; s is the row's token mean of
    log π_θ (`logL`) or of π_θ / π_old (`Lratio`); KL is the token mean of old_logp - logp over every real token,
    an estimate of KL(π_old ‖ π_θ) on π_old's samples. The log-mean-exp over the wrong answers weights the
    hardest (highest-scored) ones most: DisCO's answer to questions with many more wrong answers than right.
    clip_fraction: 1 when the KL penalty is active (KL above δ), else 0."""
    mask = mask.to(logp.dtype)
    lengths = mask.sum(dim=1).clamp(min=1)
    log_ratio = logp - old_logp
    per_token = logp if score == "logL" else torch.exp(log_ratio)
    scores = (per_token * mask).sum(dim=1) / lengths
    terms = []
    for group in torch.unique(groups):
        own = groups == group
        right, wrong = scores[own & (advantages > 0)], scores[own & (advantages < 0)]
        if right.numel() == 0 or wrong.numel() == 0:
            continue
        if tau is None:
            against = wrong.mean()
        else:
            count = torch.tensor(float(wrong.numel()), dtype=wrong.dtype, device=wrong.device)
            against = tau * (torch.logsumexp(wrong / tau, dim=0) - torch.log(count))
        terms.append(right.mean() - against)
    discriminative = -torch.stack(terms).mean() if terms else scores.sum() * 0.0
    kl = ((old_logp - logp) * mask).sum() / mask.sum().clamp(min=1)
    excess = torch.clamp(kl - delta, min=0.0)
    loss = discriminative + beta * excess**2
    stats = {"clip_fraction": float(excess.detach() > 0), "approx_kl": _token_kl(torch.exp(log_ratio), log_ratio, mask)}
    return loss, stats
