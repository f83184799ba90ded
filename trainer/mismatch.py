"""The sampler-trainer mismatch (docs/training.md#sampler-trainer-mismatch): what it measures between the log-probs a
sampler gave its tokens and the trainer's own log-probs of the same tokens, and the corrections that weigh or drop
tokens where the two differ. The sampler may be another engine (vLLM, an OpenAI-compatible server returning
log-probs), another precision, or an older policy (`flow.async_level`): the trainer then centres its clip on its own
π_old and weights each token by w = π_trainer / π_sampler, as corrected here.

- tis: truncated importance sampling, w' = min(w, high) (TRL's and verl's default correction);
- mis: masked importance sampling, tokens with w outside [low, high] rejected, out of the loss and its
  denominator; the rest weighted by w;
- icepop: tokens with w outside [low, high] weighted 0 (kept in the denominator), the rest by w (Ring-1T's IcePop).

At `sequence` level w is one number a sequence, the product of its tokens' w (its log the sum of their log-ratios),
and a whole sequence is truncated, rejected or zeroed.
"""

from typing import Literal

import torch
from torch import Tensor

Correction = Literal["none", "tis", "mis", "icepop"]
CorrectionLevel = Literal["token", "sequence"]
DEFAULT_BOUNDS: dict[str, tuple[float, float]] = {"tis": (0.0, 2.0), "mis": (0.5, 2.0), "icepop": (0.5, 5.0)}


def mismatch_stats(trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Over the real tokens [R, T]: the mean and the largest |log π_sampler - log π_trainer|, and the k3 estimate
    of KL(π_sampler ‖ π_trainer) on the sampler's tokens, token mean of (r - 1) - log r with r = π_trainer/π_sampler."""
    real = mask.bool()
    if not bool(real.any()):
        return {"mismatch_mean": 0.0, "mismatch_max": 0.0, "mismatch_kl": 0.0}
    log_r = (trainer_logp - sampler_logp)[real].to(torch.float64)
    return {
        "mismatch_mean": float(log_r.abs().mean()),
        "mismatch_max": float(log_r.abs().max()),
        "mismatch_kl": float((torch.exp(log_r) - 1 - log_r).mean()),
    }


def correction_weights(
    trainer_logp: Tensor,
    sampler_logp: Tensor,
    mask: Tensor,
    correction: Correction,
    level: CorrectionLevel = "token",
    bounds: tuple[float, float] | None = None,
) -> tuple[Tensor, Tensor, float]:
    """Each token's weight [R, T] (detached; 1 on padding), the mask [R, T] of the tokens kept in the loss (`mis`
    drops the rejected ones), and the share of real tokens the correction truncated, rejected or zeroed.
    `bounds` (low, high): the method's default (DEFAULT_BOUNDS) when None; `tis` reads only high."""
    real = mask.bool()
    low, high = bounds if bounds is not None else DEFAULT_BOUNDS[correction]
    log_w = (trainer_logp - sampler_logp).detach().masked_fill(~real, 0.0)
    if level == "sequence":
        log_w = log_w.sum(dim=1, keepdim=True).expand_as(log_w)
    weight = torch.exp(log_w)
    if correction == "tis":
        cut = weight > high
        weight = weight.clamp(max=high)
        kept = real
    else:
        cut = (weight < low) | (weight > high)
        weight = weight.masked_fill(cut, 0.0)
        kept = real & ~cut if correction == "mis" else real
    weight = weight.masked_fill(~real, 1.0)
    share = float((cut & real).sum() / real.sum().clamp(min=1))
    return weight, kept, share
