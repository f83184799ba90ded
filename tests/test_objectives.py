"""The objectives beside GRPO's surrogate (trainer/objectives.py) and BNPO's advantages (trainer/advantages.py), each
against values worked by hand from its formula on a batch with known log-probs and rewards: the loss and the
gradient on each log-prob. Each test fails under the mutation named in its docstring (tried by hand, 2026-12-04)."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr.trainer.advantages import group_advantages
from rlvr.trainer.grpo_batch import GRPOConfig
from rlvr.trainer.objectives import cispo_loss, disco_loss, sequence_surrogate_loss


def leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def test_gspo_clips_one_ratio_a_sequence_the_geometric_mean_of_its_tokens():
    """Row 0's tokens have log-ratios 0.1 and 0.3 (mean 0.2: s = e^0.2 = 1.2214, inside 1 + 0.3 although its second
    token's ratio e^0.3 = 1.35 is not); row 1's one token -0.5 (s = 0.6065, inside 1 - 0.5). With A = (1, -2):
    loss = -(1.2214 - 1.2131) / 2, and d loss / d logp = -A s / (2 |o|) on each token. Mutations that fail it: the
    sum of log-ratios for the mean (s = e^0.4 is clipped), token ratios (GRPO's) for the sequence's."""
    logp = leaf([[-1.0, -2.0], [-0.7, 0.0]])
    old = torch.tensor([[-1.1, -2.3], [-0.2, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    advantages = torch.tensor([1.0, -2.0])
    loss, stats = sequence_surrogate_loss(
        logp, old, advantages, mask, clip_low=0.5, clip_high=0.3, aggregation="seq-mean-token-mean"
    )
    s0, s1 = math.exp(0.2), math.exp(-0.5)
    assert loss.item() == pytest.approx(-(s0 * 1.0 + s1 * -2.0) / 2, abs=1e-6)
    loss.backward()
    expected = [[-s0 / 4, -s0 / 4], [2.0 * s1 / 2, 0.0]]
    assert logp.grad.tolist() == pytest.approx([pytest.approx(row, abs=1e-6) for row in expected])
    assert stats["clip_fraction"] == 0.0

    clipped, stats = sequence_surrogate_loss(
        logp, old, advantages, mask, clip_low=0.2, clip_high=0.2, aggregation="seq-mean-token-mean"
    )  # s0 clipped at 1.2 (A > 0), s1 at 0.8 (A < 0): both sequences cut, all three tokens
    assert clipped.item() == pytest.approx(-(1.2 * 1.0 + 0.8 * -2.0) / 2, abs=1e-6)
    assert stats["clip_fraction"] == 1.0


def test_cispo_keeps_every_tokens_gradient_with_its_weight_clipped_above_and_detached():
    """Token ratios e^0.5 = 1.6487 (past 1 + 0.28: weight 1.28) and e^-0.1 = 0.9048 (its own), A = 1, log-probs -1 and
    -2: loss = -(1.28 (-1) + 0.9048 (-2)) / 2 (token-mean), d loss / d logp = -w A / 2. GRPO's surrogate gives the
    first token no gradient. Mutations that fail it: a weight not detached (its derivative joins the gradient), the
    clip on both sides (a lower bound at 0.72 leaves 0.9048 alone, but one at 1 - 0.05 does not)."""
    logp = leaf([[-1.0, -2.0]])
    old = torch.tensor([[-1.5, -1.9]])
    mask = torch.ones(1, 2)
    loss, stats = cispo_loss(logp, old, torch.tensor([1.0]), mask, clip_high=0.28, aggregation="token-mean")
    w2 = math.exp(-0.1)
    assert loss.item() == pytest.approx(-(1.28 * -1.0 + w2 * -2.0) / 2, abs=1e-6)
    loss.backward()
    assert logp.grad.tolist() == [[pytest.approx(-1.28 / 2, abs=1e-6), pytest.approx(-w2 / 2, abs=1e-6)]]
    assert stats["clip_fraction"] == 0.5
    weighted, _ = cispo_loss(
        logp,
        old,
        torch.tensor([1.0]),
        mask,
        clip_high=0.28,
        aggregation="token-mean",
        token_weight=torch.tensor([[0.5, 1.0]]),
    )
    assert weighted.item() == pytest.approx(-(0.5 * 1.28 * -1.0 + w2 * -2.0) / 2, abs=1e-6)


def test_disco_raises_right_answers_against_a_log_mean_exp_of_wrong_ones_under_a_kl_hinge():
    """One group: right answers with token-mean log-probs -1 and -2, wrong ones -3 and -0.5; a second group all right
    (no pair: no term). τ = 10: J = -1.5 - 10 log((e^-0.3 + e^-0.05) / 2) = 0.1724, loss = -J; each right answer's
    gradient -1/2, each wrong one's its softmax weight of s/τ (0.4378, 0.5622), spread over its tokens. τ None
    (DisCO-b): J = -1.5 + 1.75. With π_old 0.01 above on every token, KL = 0.01 and the hinge adds
    1000 (0.01 - 1e-4)². Mutations that fail it: a log-sum-exp without the mean (log of the sum), the hinge
    unsquared, a group without a wrong answer counted."""
    logp = leaf([[-1.0, -1.0], [-2.0, 0.0], [-3.0, 0.0], [-0.5, 0.0], [-0.2, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1])
    loss, stats = disco_loss(logp, logp.detach(), advantages, mask, groups, tau=10.0)
    mean_exp = (math.exp(-0.3) + math.exp(-0.05)) / 2
    assert loss.item() == pytest.approx(-(-1.5 - 10 * math.log(mean_exp)), abs=1e-5)
    assert stats["clip_fraction"] == 0.0
    loss.backward()
    soft = [math.exp(-0.3) / (2 * mean_exp), math.exp(-0.05) / (2 * mean_exp)]
    expected = [[-0.25, -0.25], [-0.5, 0.0], [soft[0], 0.0], [soft[1], 0.0], [0.0, 0.0]]
    assert logp.grad.tolist() == pytest.approx([pytest.approx(row, abs=1e-6) for row in expected])

    plain, _ = disco_loss(logp, logp.detach(), advantages, mask, groups, tau=None)
    assert plain.item() == pytest.approx(-(-1.5 + 1.75), abs=1e-6)
    hinged, stats = disco_loss(logp, logp.detach() + 0.01 * mask, advantages, mask, groups, tau=None)
    assert hinged.item() == pytest.approx(-0.25 + 1e3 * (0.01 - 1e-4) ** 2, abs=1e-5)
    assert stats["clip_fraction"] == 1.0


def test_disco_lratio_scores_the_token_mean_of_the_ratio():
    """Lratio: s = token mean of π_θ / π_old; at π_θ = π_old every score is 1, so J = 1 - τ log(mean e^(1/τ)) = 0 and
    each right row's gradient is -1/(n+) times the ratio (1) over its tokens."""
    logp = leaf([[-1.0], [-2.0]])
    loss, _ = disco_loss(
        logp, logp.detach(), torch.tensor([1.0, -1.0]), torch.ones(2, 1), torch.tensor([0, 0]), score="Lratio", tau=1.0
    )
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    loss.backward()
    assert logp.grad.tolist() == [[pytest.approx(-1.0)], [pytest.approx(1.0)]]


def bnpo(rewards: list[float], groups: list[int]) -> torch.Tensor:
    return group_advantages(torch.tensor(rewards), torch.tensor(groups), scale="beta")


def beta_density(p: float, a: float, b: float) -> float:
    return p ** (a - 1) * (1 - p) ** (b - 1) / math.exp(math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))


def test_bnpo_divides_by_a_beta_density_fitted_to_the_batchs_pass_rates():
    """Pass rates 0.25 and 0.5: mean 0.375, variance 0.015625, so c = 0.375 x 0.625 / 0.015625 - 1 = 14, α = 5.25,
    β = 8.75, and BNPO's a = 1 + α/3 = 2.75, b = 1 + β/3 = 3.9167: A = (r - p) / f(p; a, b). Mutations that fail it:
    a = 1 + α/2, the sample variance (n - 1) for the moments."""
    got = bnpo([1, 0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1])
    a, b = 2.75, 1 + 8.75 / 3
    f1, f2 = beta_density(0.25, a, b), beta_density(0.5, a, b)
    expected = [0.75 / f1, -0.25 / f1, -0.25 / f1, -0.25 / f1, 0.5 / f2, 0.5 / f2, -0.5 / f2, -0.5 / f2]
    assert got.tolist() == pytest.approx(expected, rel=1e-5)


def test_bnpo_is_grpo_times_pi_over_8_where_the_moments_give_beta_one_and_a_half():
    """Pass rates 0.25 and 0.75 (variance 1/16) fit α = β = 1.5, so a = b = 1.5 and f(p) = √(p(1-p)) x 8/π: GRPO's
    std scaled by π/8; equal pass rates give no Beta and fall back to the same; a group all right keeps 0."""
    rewards, groups = [1, 0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    grpo = group_advantages(torch.tensor(rewards[:8]), torch.tensor(groups[:8]))
    assert bnpo(rewards[:8], groups[:8]).tolist() == pytest.approx((grpo * math.pi / 8).tolist(), rel=1e-4)
    assert bnpo([1, 0, 1, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1, 1]).tolist() == pytest.approx(
        [math.pi / 8 * x for x in (1, -1, 1, -1, -1, 1, 1, -1)], rel=1e-4
    )
    assert bnpo(rewards, groups)[8:].tolist() == [0.0, 0.0, 0.0, 0.0]
    with pytest.raises(
        ValueError, match=r"^advantage_scale=beta \(BNPO\) needs rewards in \[0, 1\]; this batch has -0.1$"
    ):
        bnpo([1.0, -0.1], [0, 0])


def test_objectives_refuse_what_they_cannot_combine_in_one_line():
    from pydantic import ValidationError

    from rlvr.errors import ConfigError
    from rlvr.flows.config import load_config

    refusals = {
        "disco couples a group's rows and the minibatch's KL: each minibatch goes through one pass": dict(
            objective="disco", micro_batch_tokens=64
        ),
        "objective=gspo scores whole sequences: it needs turn_credit=trajectory": dict(
            objective="gspo", turn_credit="return_to_go"
        ),
        "dual_clip and ratio_cap belong to the grpo objective, not cispo": dict(objective="cispo", dual_clip=3.0),
        "objective=disco has no per-token weight for decoupled PPO": dict(objective="disco", decoupled=True),
    }
    for message, settings in refusals.items():
        with pytest.raises(ValidationError, match=message):
            GRPOConfig(**settings)
    with pytest.raises(ConfigError, match="^train.grpo.objective=disco couples .* use train.data_parallel=1 with it$"):
        load_config(None, ["train.grpo.objective=disco", "train.data_parallel=2"])
    gym = ["env.type=gym", "env.options={make: gem, id: 'game:GuessTheNumber-v0-easy'}"]
    with pytest.raises(ConfigError, match=r"^train.grpo.advantage_scale=beta \(BNPO\) .* env.type=gym \(a game's"):
        load_config(None, ["train.grpo.advantage_scale=beta", *gym])
    assert GRPOConfig(objective="gspo").model_dump(mode="json").get("objective") == "gspo"
    assert "objective" not in GRPOConfig().model_dump(mode="json") and "disco" not in GRPOConfig().model_dump()
