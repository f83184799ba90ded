"""The sampler-trainer mismatch (trainer/mismatch.py): its figures and each correction's weights on log-probs worked by
hand, and a GRPO step on rollouts that carry another policy's log-probs, whose recorded figures are those computed
here from the two policies directly. Mutations that fail these tests (tried 2026-12-04): tis clamping from below (at 0.95),
mis keeping rejected tokens in the mask, icepop dropping them from it, sequence weights as the mean of the
log-ratios, the KL's k3 written as log r."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlvr.trainer.grpo import GRPOConfig, behaviour_logprobs, grpo_step
from rlvr.trainer.mismatch import correction_weights, mismatch_stats
from rlvr.trainer.policy import PolicyConfig, init_policy, make_optimizer
from tests.test_distributed import ragged_batch

TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -3.0, 0.0]])
# log w = trainer - sampler: 0.1, -0.5, 1.0 on row 0; -1.0, 0.2 (and padding) on row 1
SAMPLER = torch.tensor([[-1.1, -1.5, -1.5], [0.0, -3.2, 0.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])
LOG_W = [0.1, -0.5, 1.0, -1.0, 0.2]


def test_the_mismatch_figures_are_the_log_ratio_mean_max_and_k3():
    stats = mismatch_stats(TRAINER, SAMPLER, MASK)
    assert stats["mismatch_mean"] == pytest.approx(sum(abs(x) for x in LOG_W) / 5)
    assert stats["mismatch_max"] == pytest.approx(1.0)
    assert stats["mismatch_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in LOG_W) / 5)


def test_each_correction_truncates_rejects_or_zeroes_the_tokens_outside_its_bounds():
    e = math.exp
    weight, kept, share = correction_weights(TRAINER, SAMPLER, MASK, "tis")  # (-, 2): e^1 = 2.72 truncated
    assert weight.tolist() == [pytest.approx([e(0.1), e(-0.5), 2.0]), pytest.approx([e(-1.0), e(0.2), 1.0])]
    assert kept.tolist() == MASK.tolist() and share == pytest.approx(1 / 5)

    weight, kept, share = correction_weights(TRAINER, SAMPLER, MASK, "mis")  # (0.5, 2): e^1 and e^-1 rejected
    assert weight.tolist() == [pytest.approx([e(0.1), e(-0.5), 0.0]), pytest.approx([0.0, e(0.2), 1.0])]
    assert kept.tolist() == [[True, True, False], [False, True, False]] and share == pytest.approx(2 / 5)

    weight, kept, share = correction_weights(TRAINER, SAMPLER, MASK, "icepop")  # (0.5, 5): e^-1 zeroed, kept
    assert weight.tolist() == [pytest.approx([e(0.1), e(-0.5), e(1.0)]), pytest.approx([0.0, e(0.2), 1.0])]
    assert kept.tolist() == MASK.tolist() and share == pytest.approx(1 / 5)

    # one weight a sequence, the product of its tokens': e^0.6 (inside (0.5, 2)) and e^-0.8 = 0.45 (outside)
    weight, kept, share = correction_weights(TRAINER, SAMPLER, MASK, "mis", "sequence")
    assert weight.tolist() == [pytest.approx([e(0.6)] * 3), pytest.approx([0.0, 0.0, 1.0])]
    assert kept.tolist() == [[True, True, True], [False, False, False]] and share == pytest.approx(2 / 5)
    weight, _, share = correction_weights(TRAINER, SAMPLER, MASK, "tis", "sequence", bounds=(0.0, 1.5))
    assert weight.tolist() == [pytest.approx([1.5] * 3), pytest.approx([e(-0.8), e(-0.8), 1.0])]
    assert share == pytest.approx(3 / 5)


def test_a_step_on_another_policys_samples_records_the_mismatch_and_centres_its_clip_on_its_own_pi_old():
    """Samples carrying the log-probs of a policy of another seed: the step's figures are those of the two policies'
    log-probs computed here, and with a correction the clip is centred on the trainer's own π_old (ratio 1 at the
    first update: nothing clipped, KL 0) where without one it clips most tokens."""
    batch = ragged_batch(3, [5, 3, 4, 2])
    base = GRPOConfig(minibatches=1, clip_low=0.01, clip_high=0.01)
    other = init_policy(PolicyConfig(), seed=1)
    sampler = behaviour_logprobs(other, batch.prompts, batch.samples, base)
    trainer = behaviour_logprobs(init_policy(PolicyConfig(), seed=0), batch.prompts, batch.samples, base)
    carrying = dataclasses.replace(
        batch, samples=[dataclasses.replace(s, logprobs=lp) for s, lp in zip(batch.samples, sampler)]
    )
    gaps = [t - s for ts, ss in zip(trainer, sampler) for t, s in zip(ts, ss)]

    def step(**settings: object) -> dict[str, float]:
        policy = init_policy(PolicyConfig(), seed=0)
        cfg = base.model_copy(update=settings)
        return grpo_step(policy, make_optimizer(policy, 1e-3, 0.0), carrying, cfg)

    plain = step()
    assert plain["mismatch_mean"] == pytest.approx(sum(abs(g) for g in gaps) / len(gaps), rel=1e-5)
    assert plain["mismatch_max"] == pytest.approx(max(abs(g) for g in gaps), rel=1e-5)
    assert plain["corrected_share"] == 0.0 and plain["clip_fraction"] > 0.2
    corrected = step(correction="mis", correction_bounds=(0.97, 1.03))
    outside = sum(not 0.97 <= math.exp(g) <= 1.03 for g in gaps) / len(gaps)
    assert 0 < outside < 1 and corrected["corrected_share"] == pytest.approx(outside)
    assert corrected["clip_fraction"] == 0.0 and abs(corrected["kl"]) < 1e-6
    assert corrected["mismatch_mean"] == pytest.approx(plain["mismatch_mean"])


def test_a_step_without_the_samplers_log_probs_records_no_mismatch():
    policy = init_policy(PolicyConfig(), seed=0)
    stats = grpo_step(policy, make_optimizer(policy, 1e-3, 0.0), ragged_batch(3, [5, 3, 4, 2]), GRPOConfig())
    assert not {"mismatch_mean", "mismatch_max", "mismatch_kl", "corrected_share"} & stats.keys()


def test_correction_settings_are_refused_in_one_line_where_they_cannot_apply():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="set correction or decoupled, not both"):
        GRPOConfig(correction="tis", decoupled=True)
    with pytest.raises(ValidationError, match=r"correction_bounds \[2.0, 0.5\]: need 0 <= low < high"):
        GRPOConfig(correction="mis", correction_bounds=(2.0, 0.5))
    with pytest.raises(ValidationError, match="objective=disco has no per-token weight for a mismatch correction"):
        GRPOConfig(correction="icepop", objective="disco")
    assert "correction" not in GRPOConfig().model_dump(mode="json")


def test_the_report_draws_the_mismatch_only_for_runs_that_measured_it():
    from rlvr.flows.report_plots import RunData, mismatch_figure

    plain = RunData("plain", "rl", "completed", {}, steps=[{"step": 1, "mismatch_mean": None}])
    assert mismatch_figure([plain]) is None
    measured = [{"step": s, "mismatch_mean": 0.1 * s, "mismatch_max": 0.5 * s, "corrected_share": 0.25} for s in (1, 2)]
    figure = mismatch_figure([plain, RunData("async", "rl", "completed", {}, steps=measured)])
    assert figure is not None and figure.svg is not None and 'aria-label="Sampler-trainer mismatch"' in figure.svg
    assert figure.notes == ["plain: no data: no step measured it"]
