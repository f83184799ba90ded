"""CLPO's decisions and rewriters, the KL-to-reference term, and Knapsack's outcome buffers."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rlvr.curricula.buffers import OutcomeBuffers
from rlvr.curricula.clpo import (
    RestructureConfig,
    RewriteRequest,
    keeps_rewrite,
    kl_weight,
    label_of,
    mode_for,
    reveals_answer,
)
from rlvr.data.sources import ArithmeticSource, ArithmeticSourceConfig, ProceduralRewriter
from rlvr.trainer.generation import sample
from rlvr.trainer.grpo import GRPOConfig, RolloutBatch, grpo_step, reference_kl
from rlvr.trainer.policy import PolicyConfig, init_policy, make_optimizer, weights_bytes
from rlvr.trainer.rewriting import PolicyRewriter

# ----- CLPO decisions ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "accuracy, label, mode, weight",
    [
        (0.0, "hard", "simplify", 0.5),
        (0.3, "hard", "simplify", 0.5),
        (0.31, "medium", "diversify", 1.0),
        (0.7, "medium", "diversify", 1.0),
        (0.75, "easy", None, 1.0),
        (1.0, "easy", None, 1.0),
    ],
)
def test_labels_modes_and_kl_weights_follow_the_thresholds(accuracy, label, mode, weight):
    cfg = RestructureConfig()
    assert label_of(accuracy, cfg) == label
    assert mode_for(label, cfg) == mode
    assert kl_weight(label, cfg) == weight


def test_mode_restrictions_and_threshold_order():
    assert mode_for("medium", RestructureConfig(modes="hard_only")) is None
    assert mode_for("hard", RestructureConfig(modes="medium_only")) is None
    with pytest.raises(ValueError, match="hard_threshold must not exceed medium_threshold"):
        RestructureConfig(hard_threshold=0.8, medium_threshold=0.5)


@pytest.mark.parametrize(
    "prompt, answer, reveals",
    [
        ("5+4=", "9", False),
        ("9=", "9", True),
        ("the sum is 9, so 4+5=", "9", True),
        ("19+2=", "9", False),
        ("9.5+1=", "9", False),
        ("x=3, y=12", "12", True),
        ("12+1=", "2", False),
        ("", "9", False),
    ],
)
def test_a_rewrite_that_states_its_answer_is_caught(prompt, answer, reveals):
    assert reveals_answer(prompt, answer) is reveals


def test_only_rewrites_solved_sometimes_are_kept():
    assert [keeps_rewrite(a) for a in (0.0, 0.25, 0.75, 1.0)] == [False, True, True, False]


# ----- rewriters ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, mode, expected",
    [
        ("2+3+4=", "simplify", "5+4="),
        ("12+3*4=", "simplify", "12+12="),
        ("2*3-1=", "simplify", "6-1="),
        ("3+4=", "simplify", None),
        ("12+3*4=", "diversify", "12+4*3="),
        ("2+3+4=", "diversify", "3+2+4="),
        ("4*4=", "diversify", None),
        ("9-2-3=", "diversify", None),
        ("not arithmetic", "simplify", None),
    ],
)
def test_arithmetic_rewrites_keep_the_value(prompt, mode, expected):
    source = ArithmeticSource(ArithmeticSourceConfig())
    answer = str(eval(prompt[:-1])) if expected else "0"
    made = source.rewrite(prompt, answer, mode)
    assert (made[0] if made else None) == expected
    if made:
        assert eval(made[0][:-1]) == int(answer)


def test_procedural_rewriter_answers_every_request_in_order():
    sources = {"sums": ArithmeticSource(ArithmeticSourceConfig())}
    rewriter = ProceduralRewriter(sources, {"a": "sums", "b": "sums", "c": "sums", "d": "other"})
    requests = [
        RewriteRequest("a", "2+3+4=", "9", "arithmetic", "simplify"),
        RewriteRequest("b", "3+4=", "7", "arithmetic", "simplify"),
        RewriteRequest("c", "1+2=", "3", "arithmetic", "diversify"),
        RewriteRequest("d", "1+2=", "3", "arithmetic", "diversify"),  # a source with no rewrite
    ]
    results = rewriter.rewrite(requests)
    assert [(r.prompt, r.answer) if r else None for r in results] == [("5+4=", "9"), None, ("2+1=", "3"), None]


def test_policy_rewriter_uses_the_domain_template_and_respects_the_context():
    policy = init_policy(PolicyConfig(), seed=0)
    long_template = {"simplify": "simplify this: {question} (answer {answer}) " * 10}
    short_template = {"diversify": "{question}"}
    templates = {"long": long_template, "short": short_template}
    rewriter = PolicyRewriter(policy, lambda domain: templates.get(domain, {}), max_new_tokens=3)
    results = rewriter.rewrite(
        [
            RewriteRequest("a", "2+3=", "5", "long", "simplify"),  # does not fit 64 positions
            RewriteRequest("b", "2+3=", "5", "short", "simplify"),  # no template for this mode
            RewriteRequest("c", "2+3=", "5", "short", "diversify"),
        ]
    )
    assert results[0] is None and results[1] is None
    assert results[2] is None or (results[2].answer == "5" and results[2].prompt)


# ----- the KL-to-reference term --------------------------------------------------------------------------


def test_k3_estimator_by_hand():
    logp = torch.tensor([[math.log(0.5), math.log(0.2)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.2)]])
    mask = torch.tensor([[True, False]])
    # D = r - log r - 1 with r = 0.25 / 0.5: 0.5 + ln 2 - 1 = 0.193147; the padded token does not count
    value = reference_kl(logp, ref, mask, torch.tensor([1.0]), "token-mean")
    assert float(value) == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    halved = reference_kl(logp, ref, mask, torch.tensor([0.5]), "seq-mean-token-mean")
    assert float(halved) == pytest.approx((0.5 + math.log(2) - 1) / 2, abs=1e-6)


def _one_step(beta: float, reference_is_copy: bool) -> tuple[bytes, dict[str, float]]:
    policy = init_policy(PolicyConfig(), seed=1)
    reference = copy.deepcopy(policy) if reference_is_copy else init_policy(PolicyConfig(), seed=2)
    samples = sample(policy, ["1+2=", "3+4="], [4, 4], max_new_tokens=3, temperature=2.5, top_p=1.0, seed=0)
    rewards = [float(i % 2) for i in range(len(samples))]
    batch = RolloutBatch(prompts=["1+2=", "3+4="], samples=samples, rewards=rewards, kl_weights=[0.5, 1.0])
    optimizer = make_optimizer(policy, lr=1e-3, weight_decay=0.0)
    stats = grpo_step(policy, optimizer, batch, GRPOConfig(kl_beta=beta), reference)
    return weights_bytes(policy.model), stats


def test_kl_to_an_identical_reference_changes_nothing_and_another_one_does():
    plain, plain_stats = _one_step(0.0, True)
    same, same_stats = _one_step(0.1, True)
    other, other_stats = _one_step(0.1, False)
    assert same == plain  # at π_θ = π_ref the k3 term and its gradient are 0
    assert same_stats["ref_kl"] == 0.0 and plain_stats["ref_kl"] == 0.0
    assert other != plain and other_stats["ref_kl"] > 0


def test_kl_needs_a_reference():
    policy = init_policy(PolicyConfig(), seed=1)
    batch = RolloutBatch(prompts=["1+2="], samples=[], rewards=[])
    with pytest.raises(ValueError, match="kl_beta > 0 needs the reference policy"):
        grpo_step(policy, make_optimizer(policy, 1e-3, 0.0), batch, GRPOConfig(kl_beta=0.1))


# ----- outcome buffers ------------------------------------------------------------------------------------


def test_buffers_keep_the_last_sixteen_and_estimate_from_eight():
    buffers = OutcomeBuffers()
    buffers.add("p", [1.0] * 7)
    assert buffers.estimate("p") is None and buffers.estimate("unseen") is None
    buffers.add("p", [0.0])
    estimate = buffers.estimate("p")
    assert (estimate.p_hat, estimate.count, estimate.source) == (7 / 8, 8, "buffer")
    buffers.add("p", [0.0] * 12)  # 20 outcomes: the oldest 4 (ones) fall out
    assert buffers.outcomes("p") == [1.0] * 3 + [0.0] * 13
    assert buffers.estimate("p").p_hat == 3 / 16
    with pytest.raises(ValueError, match="need 1 <= minimum <= length"):
        OutcomeBuffers(length=4, minimum=8)
