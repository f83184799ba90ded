"""DAPO-style dynamic sampling (docs/methods.md#dynamic-sampling): a group whose rewards are all equal gives GRPO no
gradient, so over-sample prompts, keep only groups with reward variance, and refill until the batch has
B of them or the refill limit is hit.

Pure decisions on reward lists; drawing prompts, generating, and warning when the limit is hit are the
pipeline's job. Pass the verifier's task outcome (correctness), not a shaped reward: after a length
penalty or a format bonus an all-wrong group can show variance and slip through.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal

from pydantic import BaseModel, ConfigDict, Field, field_validator


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

    @field_validator("band")
    @classmethod
    def _band_in_unit_interval(cls, band: tuple[float, float] | None) -> tuple[float, float] | None:
        if band is not None and not 0.0 <= band[0] <= band[1] <= 1.0:
            raise ValueError(f"band must be [low, high] with 0 <= low <= high <= 1, got {list(band)}")
        return band


def has_reward_variance(rewards: Sequence[float]) -> bool:
    """True when the group's rewards are not all equal (std > 0; for binary rewards 0 < Σr < G)."""
    return len(rewards) > 1 and min(rewards) != max(rewards)


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
    inside it); `zero_variance`, `outside_band` and `surplus` (valid groups beyond B) were consumed without
    training, which the pipeline logs so the epoch position can be restored.
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

    @property
    def refill(self) -> bool:
        return self.refill_prompts > 0


def filter_groups(
    groups: Sequence[Sequence[float]], batch_size: int, refills_done: int, cfg: DynamicSamplingConfig
) -> FilterDecision:
    """Decide which of `groups` (every group so far, first round and refills, in order) to keep.

    Disabled, every group is kept and nothing refills. Enabled, the first `batch_size` groups with
    variance (and a pass rate in `cfg.band`, when set: `groups` then hold 0/1 correctness) are kept;
    with fewer, a refill of prompts_to_draw(missing) is asked while `refills_done` < `max_refills`,
    after which `limit_reached` is set.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if refills_done < 0:
        raise ValueError(f"refills_done must be >= 0, got {refills_done}")
    varied = [i for i, rewards in enumerate(groups) if has_reward_variance(rewards)]
    ratio = len(varied) / len(groups) if groups else 0.0
    if not cfg.enabled:
        return FilterDecision(tuple(range(len(groups))), (), (), 0, False, ratio)
    valid = [i for i in varied if in_band(groups[i], cfg.band)]
    zero = tuple(i for i in range(len(groups)) if not has_reward_variance(groups[i]))
    outside = tuple(i for i in varied if not in_band(groups[i], cfg.band))
    missing = batch_size - len(valid)
    if missing <= 0:
        return FilterDecision(tuple(valid[:batch_size]), zero, tuple(valid[batch_size:]), 0, False, ratio, outside)
    if refills_done < cfg.max_refills:
        return FilterDecision(tuple(valid), zero, (), prompts_to_draw(missing, cfg), False, ratio, outside)
    return FilterDecision(tuple(valid), zero, (), 0, True, ratio, outside)
