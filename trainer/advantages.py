"""GRPO's advantages as plain functions on tensors (docs/methods.md#group-advantages): a sample's reward against
its group's, GDPO's per-component normalisation, SEED-GRPO's semantic-entropy factor, DAPO's overlong penalty, and
the share of groups that carry a signal. No model, no config: trainer/grpo_batch.py `step_advantages` chooses among
them by `GRPOConfig`.
"""

import math
from typing import Literal

import torch
from torch import Tensor

AdvantageScale = Literal["std", "batch", "none", "beta"]


def group_advantages(
    rewards: Tensor,
    group_index: Tensor,
    *,
    scale: AdvantageScale = "std",
    eps: float = 1e-6,
) -> Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) for the group g of sample i; scale="batch": divided by the std
    of every reward of the batch instead (Lite PPO: robust when a group's std is tiny); "none": r_i - mean_g;
    "beta": divided by a Beta density at the group's pass rate (BNPO, `beta_scale`; rewards in [0, 1]).

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
    if scale == "beta":
        if bool(((rewards < 0) | (rewards > 1)).any()):
            outside = float(rewards[(rewards < 0) | (rewards > 1)][0])
            raise ValueError(f"advantage_scale=beta (BNPO) needs rewards in [0, 1]; this batch has {outside:g}")
        return (centered / beta_scale(means, sizes)[group_index]).to(torch.float32)
    variances = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, centered**2) / sizes.clamp(min=1)
    return (centered / (variances.sqrt()[group_index] + eps)).to(torch.float32)


BNPO_PRIOR = 1.5  # Beta(1.5, 1.5): where the batch's pass rates give no moments; BNPO's scale is then GRPO's (x π/8)


def beta_scale(pass_rates: Tensor, sizes: Tensor) -> Tensor:
    """BNPO's divisor for each group (Xiao et al. 2025; docs/methods.md#bnpo): the density f(p_g; a, b) of
    Beta(a, b) at the group's pass rate p_g, with a = 1 + α/3 and b = 1 + β/3, where Beta(α, β) is fitted by moments
    to the batch's pass rates (mean m, population variance v: α = m c, β = (1 - m) c, c = m(1 - m)/v - 1), as the
    paper's variance-minimising choice for binary rewards. α = β = 1.5 gives f ∝ √(p(1-p)), GRPO's std: GRPO is the
    special case, and it is the fallback when the moments do not define a Beta (equal pass rates, c ≤ 0). A group
    at p 0 or 1 gets divisor 1 (its rewards equal its mean: advantage 0). Groups of size 0 are left out of the
    moments. float64 [G]."""
    present = sizes > 0
    rates = pass_rates[present]
    mean, variance = rates.mean(), rates.var(correction=0) if rates.numel() > 1 else torch.tensor(0.0)
    common = mean * (1 - mean) / variance - 1 if variance > 0 else torch.tensor(-1.0)
    alpha, beta = (mean * common, (1 - mean) * common) if common > 0 else (BNPO_PRIOR, BNPO_PRIOR)
    a, b = 1 + float(alpha) / 3, 1 + float(beta) / 3
    inside = (pass_rates > 0) & (pass_rates < 1)
    density = torch.ones_like(pass_rates)
    beta_dist = torch.distributions.Beta(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))
    density[inside] = beta_dist.log_prob(pass_rates[inside]).exp()
    return density


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
