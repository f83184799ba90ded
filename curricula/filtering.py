"""DAPO-style dynamic sampling (docs/methods.md#dynamic-sampling): a group whose rewards are all equal gives GRPO no
gradient, so over-sample prompts, keep only groups with reward variance, and refill until the batch has
B of them or the refill limit is hit.

Pure decisions on reward lists; drawing prompts, generating, and warning when the limit is hit are the
pipeline's job. Pass the verifier's task outcome (correctness), not a shaped reward: after a length
penalty or a format bonus an all-wrong group can show variance and slip through.

Two filter strategies narrow "has variance" further: the band-pass filter (`band`, a pass rate inside [low, high])
and RLPR's standard-deviation filter (`std`: a reward std of at least β × the EMA of the steps' mean group std,
whose state is carried from step to step).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StdFilterConfig(BaseModel):
    """RLPR's standard-deviation filter (its code's `filter_mode: EMA`, `filter_target: final_reward_std`): once
    `skip_steps + warmup_steps` steps have passed, keep a group only when its reward std is at least `beta` x the
    EMA of the steps' mean group std. The EMA starts as the mean of the warm-up steps' means and then follows
    ema <- decay * ema + (1 - decay) * (the previous step's mean). Defaults are RLPR's scripts'
    (std_filter_beta 0.5, filter_ema_ratio 0.99, filter_ema_start_step 6, filter_start_step 11)."""

    model_config = ConfigDict(extra="forbid")

    beta: float = Field(0.5, ge=0.0, description="a group needs a reward std of at least beta x the EMA")
    decay: float = Field(0.99, ge=0.0, lt=1.0, description="the EMA's weight on its previous value")
    skip_steps: int = Field(5, ge=0, description="first steps whose stds are not recorded")
    warmup_steps: int = Field(5, ge=1, description="steps after those whose mean stds start the EMA, unfiltered")

    def first_filtered_step(self) -> int:
        return self.skip_steps + self.warmup_steps + 1


class DynamicSamplingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="filter zero-variance groups and refill the batch")
    oversample: float = Field(1.5, ge=1.0, description="prompts drawn per wanted group, first round and refills")
    max_refills: int = Field(2, ge=0, description="refill rounds after the first before training on fewer groups")
    band: tuple[float, float] | None = Field(
        None,
        exclude_if=lambda value: value is None,  # left out of dumps (so of ids) when unset: earlier runs keep theirs
        description=(
            "keep only groups whose pass rate (share of correct answers) lies in [low, high], e.g. [0.2, 0.8] "
            "(verl issue 2791), besides having reward variance; None: every group with variance"
        ),
    )

    std: StdFilterConfig | None = Field(
        None,
        exclude_if=lambda value: value is None,  # left out of dumps (so of ids) when unset: earlier runs keep theirs
        description="RLPR's standard-deviation filter on the groups' rewards (docs/rewards.md#rlpr); None: off",
    )

    @model_validator(mode="after")
    def _std_filter_needs_dynamic_sampling(self) -> DynamicSamplingConfig:
        if self.std is not None and not self.enabled:
            raise ValueError("filter.std filters dynamic sampling's groups: set filter.enabled=true too")
        return self

    @field_validator("band")
    @classmethod
    def _band_in_unit_interval(cls, band: tuple[float, float] | None) -> tuple[float, float] | None:
        if band is not None and not 0.0 <= band[0] <= band[1] <= 1.0:
            raise ValueError(f"band must be [low, high] with 0 <= low <= high <= 1, got {list(band)}")
        return band


def has_reward_variance(rewards: Sequence[float]) -> bool:
    """True when the group's rewards are not all equal (std > 0; for binary rewards 0 < Σr < G)."""
    return len(rewards) > 1 and min(rewards) != max(rewards)


def group_std(rewards: Sequence[float]) -> float | None:
    """A group's reward standard deviation with Bessel's correction (n - 1: `torch.std`, what RLPR's code
    filters on); None for fewer than two rewards."""
    return statistics.stdev(rewards) if len(rewards) > 1 else None


def step_std_ema(previous: Mapping[str, Any] | None, step: int, cfg: StdFilterConfig) -> float | None:
    """The EMA of the mean group std that step `step`'s threshold uses, from the state the step before left
    (`std_filter_state`); None before `cfg.first_filtered_step()` or while no step has recorded a mean."""
    if step < cfg.first_filtered_step():
        return None
    before = previous or {}
    ema, last = before.get("ema"), before.get("mean")
    if ema is None:  # the first filtered step: the warm-up steps' means start it
        means = before.get("warmup") or []
        return sum(means) / len(means) if means else None
    return ema if last is None else cfg.decay * ema + (1.0 - cfg.decay) * last


def std_filter_state(
    previous: Mapping[str, Any] | None, step: int, ema: float | None, stds: Sequence[float], cfg: StdFilterConfig
) -> dict[str, Any]:
    """The state step `step` leaves: the EMA it used, its mean group std over `stds` (every group it made, kept
    or not; None without one) and the warm-up steps' means so far."""
    mean = sum(stds) / len(stds) if stds else None
    warmup = list((previous or {}).get("warmup") or [])
    if cfg.skip_steps < step < cfg.first_filtered_step() and mean is not None:
        warmup.append(mean)
    return {"ema": ema, "mean": mean, "warmup": warmup}


def in_band(correct: Sequence[float], band: tuple[float, float] | None) -> bool:
    """True when the group's pass rate (mean of its 0/1 correctness) lies in `band` (always, without one)."""
    if band is None:
        return True
    rate = sum(correct) / len(correct) if correct else 0.0
    return band[0] <= rate <= band[1]


def prompts_to_draw(wanted_groups: int, cfg: DynamicSamplingConfig) -> int:
    """Prompts a round should draw to hope for `wanted_groups` valid groups: ceil(oversample x wanted)
    when enabled, exactly `wanted_groups` when not. The factor is read as the decimal it prints as, so
    1.1 x 10 asks for 11 prompts, not the 12 binary rounding would give."""
    if wanted_groups < 0:
        raise ValueError(f"wanted_groups must be >= 0, got {wanted_groups}")
    if not cfg.enabled:
        return wanted_groups
    return math.ceil(Decimal(repr(cfg.oversample)) * wanted_groups)


@dataclass(frozen=True)
class FilterDecision:
    """What to do with the groups produced so far (indices into them, in production order).

    `keep` trains (at most B, the first valid groups: with reward variance and, with a band, a pass rate
    inside it, with a std floor, a reward std at or above it); `zero_variance`, `outside_band`, `low_std` and
    `surplus` (valid groups beyond B) were consumed without training, which the pipeline logs so the epoch
    position can be restored.
    `refill_prompts` > 0 asks for another round of that many prompts; `limit_reached` means fewer than B
    valid groups and no refill left: train on `keep` and warn. `effective_ratio` is the share of groups
    with variance before filtering (the figure Knapsack RL raises).
    """

    keep: tuple[int, ...]
    zero_variance: tuple[int, ...]
    surplus: tuple[int, ...]
    refill_prompts: int
    limit_reached: bool
    effective_ratio: float
    outside_band: tuple[int, ...] = ()
    low_std: tuple[int, ...] = ()

    @property
    def refill(self) -> bool:
        return self.refill_prompts > 0


def filter_groups(
    groups: Sequence[Sequence[float]],
    batch_size: int,
    refills_done: int,
    cfg: DynamicSamplingConfig,
    rewards: Sequence[Sequence[float]] | None = None,
    std_floor: float | None = None,
) -> FilterDecision:
    """Decide which of `groups` (every group so far, first round and refills, in order) to keep.

    Disabled, every group is kept and nothing refills. Enabled, the first `batch_size` groups with
    variance (and a pass rate in `cfg.band`, when set: `groups` then hold 0/1 correctness; and a std of
    `rewards[i]`, each group's rewards, of at least `std_floor`, when given) are kept;
    with fewer, a refill of prompts_to_draw(missing) is asked while `refills_done` < `max_refills`,
    after which `limit_reached` is set.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if refills_done < 0:
        raise ValueError(f"refills_done must be >= 0, got {refills_done}")
    varied = [i for i, scores in enumerate(groups) if has_reward_variance(scores)]
    ratio = len(varied) / len(groups) if groups else 0.0
    if not cfg.enabled:
        return FilterDecision(tuple(range(len(groups))), (), (), 0, False, ratio)
    banded = [i for i in varied if in_band(groups[i], cfg.band)]
    valid = [i for i in banded if std_floor is None or (group_std((rewards or groups)[i]) or 0.0) >= std_floor]
    zero = tuple(i for i in range(len(groups)) if not has_reward_variance(groups[i]))
    outside = tuple(i for i in varied if not in_band(groups[i], cfg.band))
    low = tuple(i for i in banded if i not in set(valid))
    missing = batch_size - len(valid)
    if missing <= 0:
        return FilterDecision(tuple(valid[:batch_size]), zero, tuple(valid[batch_size:]), 0, False, ratio, outside, low)
    if refills_done < cfg.max_refills:
        return FilterDecision(tuple(valid), zero, (), prompts_to_draw(missing, cfg), False, ratio, outside, low)
    return FilterDecision(tuple(valid), zero, (), 0, True, ratio, outside, low)
