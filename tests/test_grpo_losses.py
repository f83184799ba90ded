"""The GRPO family (trainer/grpo.py) against hand-computed values: advantages (group / batch / none, GDPO,
advantage clip, overlong penalty), the surrogate (both clip sides, dual clip, ratio cap), the three
aggregations, the KL term, overlong masking and entropy; then the tiny model learning with each variant."""

import copy
import math
import random
from dataclasses import replace

import pyarrow as pa
import pytest
import torch

from rlvr.storage.stage import Inputs
from rlvr.storage.store import Store
from rlvr.trainer.generation import Sample, greedy, sample
from rlvr.trainer.grpo import (
    GRPOConfig,
    RolloutBatch,
    aggregate,
    clipped_surrogate_loss,
    gdpo_advantages,
    group_advantages,
    grpo_step,
    overlong_penalty,
    reference_kl,
    semantic_entropy_scale,
    step_advantages,
    training_rows,
)
from rlvr.trainer.policy import PolicyConfig, init_policy, make_optimizer
from rlvr.trainer.sft import sft_warmstart
from rlvr.trainer.updates import reward_components, rollout_batch, rollout_max_new_tokens
from rlvr.verifiers.arithmetic import ArithmeticVerifier

# The ragged two-group batch: group 0 has 3 samples, group 1 has 2.
GROUPS = torch.tensor([0, 0, 0, 1, 1])
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0])
S2 = math.sqrt(2)


def _close(got, expected, atol=1e-5):
    torch.testing.assert_close(got, torch.tensor(expected, dtype=got.dtype), atol=atol, rtol=0)


# --- advantages -------------------------------------------------------------------------------------


def test_group_std_batch_std_and_no_scaling():
    # Group 0 {1,0,0}: mean 1/3, population std sqrt(2)/3 -> sqrt(2), -1/sqrt(2), -1/sqrt(2).
    # Group 1 {0,2}: mean 1, std 1 -> -1, +1.
    _close(group_advantages(REWARDS, GROUPS, scale="std"), [S2, -1 / S2, -1 / S2, -1.0, 1.0])
    # Batch: centred by the group mean as above [2/3, -1/3, -1/3, -1, 1], divided by the std of all five rewards:
    # mean 0.6, variance (0.16 + 3 x 0.36 + 1.96) / 5 = 0.64, std 0.8.
    _close(group_advantages(REWARDS, GROUPS, scale="batch"), [5 / 6, -5 / 12, -5 / 12, -1.25, 1.25])
    _close(group_advantages(REWARDS, GROUPS, scale="none"), [2 / 3, -1 / 3, -1 / 3, -1.0, 1.0])


def test_batch_std_keeps_uniform_groups_at_zero():
    # Group 1 {3,3} is uniform: centred 0 whatever the batch std.
    got = group_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), torch.tensor([0, 0, 1, 1]), scale="batch")
    # Batch rewards mean 1.75, variance (0.5625 + 3.0625 + 1.5625 x 2) / 4 = 1.6875; group 0 centred +-0.5.
    s = math.sqrt(1.6875)
    _close(got, [0.5 / s, -0.5 / s, 0.0, 0.0])


# Components: "correct" {1,0,0 | 0,1}, "format" {1,1,0 | 1,1}.
COMPONENTS = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [1.0, 1.0]])


def test_gdpo_normalises_each_component_then_the_batch():
    # correct: group 0 -> [sqrt2, -1/sqrt2, -1/sqrt2], group 1 {0,1} -> [-1, 1].
    # format:  group 0 {1,1,0}: mean 2/3, std sqrt2/3 -> [1/sqrt2, 1/sqrt2, -sqrt2]; group 1 uniform -> [0, 0].
    # S = [3/sqrt2, 0, -3/sqrt2, -1, 1]; batch variance (4.5 + 0 + 4.5 + 1 + 1) / 5 = 2.2.
    got = gdpo_advantages(COMPONENTS, GROUPS, torch.tensor([1.0, 1.0]))
    r = math.sqrt(2.2)
    _close(got, [3 / S2 / r, 0.0, -3 / S2 / r, -1 / r, 1 / r])
    # Summing first ({2,1,0 | 1,2}) and normalising per group gives group 0 [1.2247, 0, -1.2247]: a different ranking
    # of the two components' contributions, which is GDPO's point.
    summed = group_advantages(COMPONENTS.sum(dim=1), GROUPS)
    assert not torch.allclose(summed, got, atol=1e-3)
    # Weight 0 on "format": S = the "correct" advantages, whose batch variance is (2 + .5 + .5 + 1 + 1) / 5 = 1.
    _close(gdpo_advantages(COMPONENTS, GROUPS, torch.tensor([1.0, 0.0])), [S2, -1 / S2, -1 / S2, -1.0, 1.0])


def _samples(n_tokens, finish=None, groups=(0, 0, 0, 1, 1)):
    finish = finish or ["stop"] * len(n_tokens)
    return [
        Sample(group, k, [4] * n, "", n, reason)  # type: ignore[arg-type]
        for k, (group, n, reason) in enumerate(zip(groups, n_tokens, finish))
    ]


def test_step_advantages_with_components_clip_and_penalty():
    parts = [{"correct": float(c), "format": float(f)} for c, f in COMPONENTS.tolist()]
    batch = RolloutBatch(["a", "b"], _samples([2, 2, 2, 2, 2]), REWARDS.tolist(), components=parts)
    cfg = GRPOConfig(advantage_components={"correct": 1.0, "format": 1.0})
    torch.testing.assert_close(
        step_advantages(batch, REWARDS, GROUPS, cfg), gdpo_advantages(COMPONENTS, GROUPS, torch.ones(2))
    )
    # Advantage clip at 1: group std [1.414, -0.707, -0.707, -1, 1] -> [1, -0.707, -0.707, -1, 1].
    clipped = step_advantages(batch, REWARDS, GROUPS, GRPOConfig(advantage_clip=1.0))
    _close(clipped, [1.0, -1 / S2, -1 / S2, -1.0, 1.0])
    with pytest.raises(ValueError, match=r"\['tests'\] are in no reward"):
        step_advantages(batch, REWARDS, GROUPS, GRPOConfig(advantage_components={"tests": 1.0}))
    batch.components = None
    with pytest.raises(ValueError, match="needs the reward components"):
        step_advantages(batch, REWARDS, GROUPS, cfg)


def test_overlong_penalty_is_dapos_linear_ramp():
    # max 8, buffer 4: 0 up to 4 tokens, then (4 - |y|) / 4, -1 at 8.
    _close(overlong_penalty(torch.tensor([3, 4, 5, 7, 8]), 8, 4), [0.0, 0.0, -0.25, -0.75, -1.0])
    with pytest.raises(ValueError, match="overlong_buffer"):
        overlong_penalty(torch.tensor([3]), 8, 9)


def test_overlong_penalty_joins_the_reward_before_advantages():
    batch = RolloutBatch(["a", "b"], _samples([2, 5, 8, 3, 6]), REWARDS.tolist(), max_new_tokens=8)
    cfg = GRPOConfig(overlong="penalty", overlong_buffer=4, advantage_scale="none")
    # Penalties [0, -0.25, -1, 0, -0.5]; shaped rewards group 0 [1, -0.25, -1] (mean -1/12), group 1 [0, 1.5].
    _close(step_advantages(batch, REWARDS, GROUPS, cfg), [13 / 12, -2 / 12, -11 / 12, -0.75, 0.75])
    # Under GDPO the penalty is one more component of weight 1.
    parts = [{"correct": float(c), "format": float(f)} for c, f in COMPONENTS.tolist()]
    batch.components = parts
    gdpo = cfg.model_copy(update={"advantage_components": {"correct": 1.0, "format": 1.0}})
    penalty = torch.tensor([[0.0], [-0.25], [-1.0], [0.0], [-0.5]])
    expected = gdpo_advantages(torch.cat([COMPONENTS, penalty], dim=1), GROUPS, torch.ones(3), scale="none")
    torch.testing.assert_close(step_advantages(batch, REWARDS, GROUPS, gdpo), expected)


# --- surrogate and aggregation ------------------------------------------------------------------------

# clip_low 0.2, clip_high 0.28 (range [0.8, 1.28]).
# Row 0, A = +1, ratios 1.5 (above 1.28: clipped to 1.28), 1.1, 0.9 -> losses -1.28, -1.1, -0.9.
# Row 1, A = -1, ratios 0.5 (below 0.8: clipped, min(-0.5, -0.8) = -0.8), 4.0 (unclipped -4 is the min), padding
#   -> losses 0.8, 4.0.
RATIOS = torch.tensor([[1.5, 1.1, 0.9], [0.5, 4.0, 1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([1.0, -1.0])


def _loss(aggregation="token-mean", **kwargs):
    logp = RATIOS.log().requires_grad_(True)
    loss, stats = clipped_surrogate_loss(
        logp, torch.zeros(2, 3), ADV, MASK, clip_low=0.2, clip_high=0.28, aggregation=aggregation, **kwargs
    )
    loss.backward()
    return loss.item(), stats, logp.grad


def test_aggregations_hand_computed():
    # seq-mean-token-mean: ((-1.28 - 1.1 - 0.9) / 3 + (0.8 + 4) / 2) / 2 = (-1.09333 + 2.4) / 2.
    assert _loss("seq-mean-token-mean")[0] == pytest.approx((-3.28 / 3 + 2.4) / 2, abs=1e-6)
    # token-mean: (-3.28 + 4.8) / 5 tokens.
    assert _loss("token-mean")[0] == pytest.approx(1.52 / 5, abs=1e-6)
    # token-sum: the same sum over R x max_length = 2 x 4.
    assert _loss("token-sum", max_length=4)[0] == pytest.approx(1.52 / 8, abs=1e-6)
    with pytest.raises(ValueError, match="needs max_length"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2), "token-sum")


def test_both_clip_sides_cut_the_gradient():
    _, stats, grad = _loss()
    assert stats["clip_fraction"] == pytest.approx(2 / 5)  # row 0 token 0 (above), row 1 token 0 (below)
    assert grad[0, 0] == 0 and grad[1, 0] == 0 and grad[1, 2] == 0  # clipped, clipped, padding
    # Unclipped: d(-ρA)/dlogp = -ρA, over 5 tokens: row 0 token 1 -> -1.1/5; row 1 token 1 -> +4/5.
    _close(grad[0, 1], -1.1 / 5)
    _close(grad[1, 1], 4.0 / 5)


def test_dual_clip_bounds_negative_advantages():
    # c = 3: row 1 token 1 becomes max(-4, 3 x -1) = -3 -> loss 3 with no gradient; nothing else changes
    # (row 1 token 0's -0.8 is above -3). token-mean (-3.28 + 0.8 + 3) / 5.
    loss, stats, grad = _loss(dual_clip=3.0)
    assert loss == pytest.approx(0.52 / 5, abs=1e-6)
    assert stats["clip_fraction"] == pytest.approx(3 / 5)
    assert grad[1, 1] == 0
    _close(grad[0, 1], -1.1 / 5)  # positive advantages untouched


def test_ratio_cap_truncates_the_weight_but_keeps_a_gradient():
    # C = 2: row 1 token 1 uses min(4, 2) x -1 = -2 (min with the clipped -1.28) -> loss 2; gradient -C A / 5.
    # Row 0 token 0 (ratio 1.5 < 2) keeps its clip. token-mean (-3.28 + 0.8 + 2) / 5.
    loss, stats, grad = _loss(ratio_cap=2.0)
    assert loss == pytest.approx(-0.48 / 5, abs=1e-6)
    _close(grad[1, 1], 2.0 / 5)
    assert grad[0, 0] == 0 and stats["clip_fraction"] == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="must exceed 1 \\+ clip_high"):
        _loss(ratio_cap=1.2)


def test_reference_kl_aggregates_like_the_loss():
    # x = log π_ref - log π_θ = [log 2, log 4]: D = e^x - x - 1 = [1 - log 2, 3 - log 4]; weight 0.5.
    logp, ref = torch.log(torch.tensor([[0.5, 0.25]])), torch.zeros(1, 2)
    d = (1 - math.log(2)) + (3 - math.log(4))
    weights, mask = torch.tensor([0.5]), torch.ones(1, 2)
    assert float(reference_kl(logp, ref, mask, weights, "token-mean")) == pytest.approx(0.5 * d / 2, abs=1e-6)
    assert float(reference_kl(logp, ref, mask, weights, "token-sum", 4)) == pytest.approx(0.5 * d / 4, abs=1e-6)


def test_config_checks():
    assert GRPOConfig().model_dump()["advantage_scale"] == "std"
    with pytest.raises(ValueError, match="ratio_cap must exceed"):
        GRPOConfig(clip_high=0.28, ratio_cap=1.25)
    with pytest.raises(ValueError, match="needs overlong_buffer"):
        GRPOConfig(overlong="penalty")
    with pytest.raises(ValueError):
        GRPOConfig(dual_clip=1.0)


# --- steps on the tiny model -----------------------------------------------------------------------------


@pytest.fixture
def policy():
    return init_policy(PolicyConfig(), seed=0)


def test_overlong_mask_leaves_truncated_samples_out(policy):
    finish = ["stop", "stop", "length", "length", "length"]
    samples = _samples([2, 3, 4, 4, 4], finish)
    batch = RolloutBatch(["1+1=", "2+2="], samples, REWARDS.tolist())
    advantages = group_advantages(REWARDS, GROUPS)
    trainable = torch.tensor([f != "length" for f in finish])
    rows = training_rows(policy, batch, advantages, GROUPS, trainable)
    assert rows is not None
    # Group 1 is all truncated: out. Group 0 keeps its two finished samples, with the full group's advantages.
    assert rows.active_groups.tolist() == [0] and rows.groups.tolist() == [0, 0]
    _close(rows.advantages, [S2, -1 / S2])
    assert rows.mask.sum(dim=1).tolist() == [2, 3]
    # All truncated: no update at all under "mask", one without it.
    cut = RolloutBatch(["1+1="], _samples([4, 4], ["length", "length"], groups=(0, 0)), [0.0, 1.0])
    optimizer = make_optimizer(policy, 1e-3, 0.0)
    assert grpo_step(policy, optimizer, cut, GRPOConfig(overlong="mask"))["updates"] == 0
    assert grpo_step(policy, optimizer, cut, GRPOConfig())["updates"] == 1


def test_entropy_is_the_token_mean_on_trained_tokens(policy):
    samples = _samples([2, 3, 1, 2, 2])
    samples[4].completion_ids = [5, 2]
    # Group 1 is uniform (no rows); group 0 trains on 2 + 3 + 1 = 6 tokens.
    batch = RolloutBatch(["1+1=", "2+2="], samples, [1.0, 0.0, 0.0, 1.0, 1.0])
    with torch.no_grad():
        policy.model.get_input_embeddings().weight.zero_()  # tied head: every logit 0, π uniform over 18 tokens
    stats = grpo_step(policy, make_optimizer(policy, 1e-3, 0.0), batch, GRPOConfig())
    assert stats["entropy"] == pytest.approx(math.log(18), abs=1e-5)  # -Σ (1/18) log(1/18)


def test_entropy_matches_a_direct_forward(policy):
    samples = _samples([2, 3, 1, 2, 2])
    batch = RolloutBatch(["1+1=", "2+2="], samples, [1.0, 0.0, 0.0, 1.0, 1.0])
    expected = []
    with torch.no_grad():
        for s in samples[:3]:  # group 0 only
            ids = torch.tensor([policy.tokenizer("1+1=")["input_ids"] + s.completion_ids])
            log_probs = torch.log_softmax(policy.model(input_ids=ids).logits[0, 4 : 4 + s.n_tokens], dim=-1)
            expected += (-(log_probs.exp() * log_probs).sum(dim=-1)).tolist()
    stats = grpo_step(policy, make_optimizer(policy, 1e-3, 0.0), batch, GRPOConfig())
    assert stats["entropy"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)


def test_token_sum_and_penalty_need_the_max_length(policy):
    batch = RolloutBatch(["1+1="], _samples([2, 2], groups=(0, 0)), [0.0, 1.0])
    optimizer = make_optimizer(policy, 1e-3, 0.0)
    with pytest.raises(ValueError, match="need the batch's max_new_tokens"):
        grpo_step(policy, optimizer, batch, GRPOConfig(aggregation="token-sum"))
    batch.max_new_tokens = 3
    assert grpo_step(policy, optimizer, batch, GRPOConfig(aggregation="token-sum", dual_clip=3.0))["updates"] == 1


# --- the train stage's inputs ------------------------------------------------------------------------------


def test_train_stage_reads_components_and_max_new_tokens(tmp_path):
    rewards = pa.table({"rollout_id": ["r0", "r1"], "components": ['{"math.value": 1.0, "format.value": 0.0}', None]})
    components_of = reward_components(Inputs.given(rewards=rewards))
    assert components_of == {"r0": {"math.value": 1.0, "format.value": 0.0}, "r1": {}}
    rows = [
        {"rollout_id": f"r{i}", "slot": 3, "sample_index": i, "prompt": "1+1=", "completion_ids": [6, 2]}
        | {"response": "2", "n_tokens": 2, "finish_reason": "stop"}
        for i in (1, 0)
    ]
    batch = rollout_batch(rows, {"r0": 1.0, "r1": 0.0}, components_of)
    assert batch.components == [{"math.value": 1.0, "format.value": 0.0}, {}]
    store = Store.open(str(tmp_path / "s"), create=True)
    for aid, limit in (("ro-1", 3), ("ro-2", 5)):
        common = dict(run_id="r", stage="rollout", parents=[], code_version="2", config={"max_new_tokens": limit})
        store.write_artifact("test_rows", aid, pa.table({"x": [1]}), **common)  # type: ignore[arg-type]
    assert rollout_max_new_tokens(Inputs(store, {"rollouts": ("ro-1", "ro-2")})) == 5


# --- learning -------------------------------------------------------------------------------------------

# The copy skill (`n*1=` -> n, verifiers/skills.py): learnt early in RL. 100 problems, 30 held out.
COPY = [(f"{n}*1=", str(n)) for n in range(100)]
_ORDER = COPY[:]
random.Random(0).shuffle(_ORDER)
HELD_OUT, TRAIN = _ORDER[:30], _ORDER[30:]
STEPS, PROMPTS, ROLLOUTS, MARGIN = 50, 16, 8, 0.2
# GDPO normalises each component on its own: "format" is 1 in nearly every group, so its advantage is 0 there and a
# large +-1 where one answer is not a number, and the first steps train on that; it learns later (see the test).
STEPS_OF = {"gdpo": 80}

VARIANTS = {
    "grpo": {},
    "kl-to-reference": {"kl_beta": 0.05},
    "ratio-cap": {"ratio_cap": 2.0},
    "token-mean+clip-higher": {"aggregation": "token-mean", "clip_high": 0.28},
    "token-sum": {"aggregation": "token-sum", "advantage_scale": "none"},
    "dual-clip": {"dual_clip": 3.0},
    "batch-std": {"advantage_scale": "batch"},
    "advantage-clip": {"advantage_clip": 2.0},
    "gdpo": {"advantage_components": {"correct": 1.0, "format": 1.0}},
    "overlong-mask": {"overlong": "mask"},
    "gspo": {"objective": "gspo", "clip_low": 3e-4, "clip_high": 4e-4},
    "cispo": {"objective": "cispo", "aggregation": "token-mean", "clip_high": 0.28},
    "disco": {"objective": "disco"},
    "bnpo": {"advantage_scale": "beta"},
}


def _accuracy(policy) -> float:
    answers = greedy(policy, [prompt for prompt, _ in HELD_OUT], max_new_tokens=3)
    return sum(got == want for got, (_, want) in zip(answers, HELD_OUT)) / len(HELD_OUT)


@pytest.fixture(scope="module")
def warm_policy():
    """Seed 1, 30 supervised steps (batch 32, lr 3e-3) on the 70 training problems: held-out accuracy 0.2."""
    policy = init_policy(PolicyConfig(), seed=1)
    sft_warmstart(policy, make_optimizer(policy, 3e-3, 0.0), TRAIN, steps=30, batch_size=32, seed=0)
    return policy, _accuracy(policy)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_task_learns_with_each_variant(warm_policy, variant):
    """From the shared warm start (held-out greedy accuracy 0.20 on 30 problems), 50 GRPO steps of 16 prompts x 8
    rollouts (temperature 1, 3 new tokens, lr 1e-3, 2 minibatches) raise held-out accuracy by at least 0.20
    (6 problems) with every variant. Measured 2026-11 on the 2-core machine: 0.20 -> 0.80 GRPO (seq-mean-token-mean),
    0.73 KL to the warm start (k3, beta 0.05), 0.83 ratio cap 2, 0.80 token-mean+clip-higher,
    0.83 token-sum, 0.70 dual-clip, 0.70 batch-std, 0.83 advantage-clip, 0.50 GDPO, 0.83 overlong-mask; 6-10 s each. Added 2026-12-04: 0.70 GSPO
    (clip 3e-4/4e-4), 0.80 CISPO (token-mean, clip_high 0.28), 0.67 DisCO (logL, τ 10), 0.73 BNPO.
    GDPO gets 80 steps: on another machine of the same kind (2026-11-29, other float rounding, so other samples) it
    stood at 0.13, 0.07, 0.13, 0.17, 0.30 after 10-50 steps and 0.57, 0.63, 0.60 after 60-80 (GRPO: 0.77 at 50).

    Reward: the arithmetic verifier's value. GDPO's two components are synthetic, from the same verdict:
    "correct" (the value) and "format" (1 unless the response is not a plain number).
    """
    base, before = warm_policy
    policy = copy.deepcopy(base)
    cfg = GRPOConfig(minibatches=2, **VARIANTS[variant])
    optimizer = make_optimizer(policy, cfg.lr, cfg.weight_decay)
    verifier, answer, picker = ArithmeticVerifier(), dict(COPY), random.Random(1)
    for step in range(STEPS_OF.get(variant, STEPS)):
        prompts = [prompt for prompt, _ in picker.sample(TRAIN, PROMPTS)]
        samples = sample(policy, prompts, [ROLLOUTS] * PROMPTS, max_new_tokens=3, temperature=1.0, top_p=1.0, seed=step)
        scores = [verifier.score(s.text, answer[prompts[s.prompt_index]]) for s in samples]
        components = [{"correct": sc.value, "format": float(sc.status != "unparseable")} for sc in scores]
        batch = RolloutBatch(prompts, samples, [sc.value for sc in scores], components=components, max_new_tokens=3)
        grpo_step(policy, optimizer, batch, cfg, reference=base if cfg.kl_beta > 0 else None)
    assert _accuracy(policy) >= before + MARGIN


def test_seed_grpo_scales_each_group_by_the_entropy_of_its_answers():
    """Group 0: answers 7, 7, 7, 3 -> p = (3/4, 1/4), SE = -(0.75 ln 0.75 + 0.25 ln 0.25) = 0.5623351446188083,
    SE / ln 4 = 0.4056390622295664; alpha 0.5: linear 1 - 0.2028195311147832 = 0.7971804688852168, exponential
    exp(-0.2028...) = 0.816425567543357. Group 1: all 5 -> SE 0 -> 1. Group 2: 1, 2 and a missing answer (its own
    cluster) -> SE = ln 3 -> 1 - alpha. Group 3: one sample -> 1."""
    answers = ["7", "7", "7", "3", "5", "5", "1", "2", None, "9"]
    group_index = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2, 3])
    linear = semantic_entropy_scale(answers, group_index, 0.5)
    expected = [0.7971804688852168] * 4 + [1.0, 1.0] + [0.5] * 3 + [1.0]
    assert linear.tolist() == pytest.approx(expected, abs=1e-7)
    exponential = semantic_entropy_scale(answers, group_index, 0.5, "exponential")
    assert exponential[:4].tolist() == pytest.approx([0.816425567543357] * 4, abs=1e-7)
    assert exponential[6:9].tolist() == pytest.approx([math.exp(-0.5)] * 3, abs=1e-7)

    rewards = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    samples = [Sample(int(g), k, [4], "", 1, "stop") for k, g in enumerate(group_index.tolist())]
    batch = RolloutBatch(prompts=["a", "b", "c", "d"], samples=samples, rewards=rewards, answers=answers)
    plain = step_advantages(batch, torch.tensor(rewards), group_index, GRPOConfig())
    scaled = step_advantages(batch, torch.tensor(rewards), group_index, GRPOConfig(semantic_entropy=0.5))
    assert scaled.tolist() == pytest.approx((plain * linear).tolist(), abs=1e-7)
    assert float(scaled[0]) == pytest.approx(0.7971804688852168 * float(plain[0]), abs=1e-7) and float(plain[0]) != 0
    with pytest.raises(ValueError, match="semantic_entropy needs every sample's extracted answer"):
        step_advantages(
            replace(batch, answers=None), torch.tensor(rewards), group_index, GRPOConfig(semantic_entropy=0.5)
        )


def test_seed_grpo_counts_each_missing_answer_as_a_cluster_of_its_own():
    """Early in RL most outputs cannot be parsed; two missing answers must not agree with each other.
    Group 0: 1 and three missing -> four clusters of one, SE = ln 4, SE / ln 4 = 1 -> linear 1 - 0.5 = 0.5 (one
    cluster "missing" of three would give p = (1/4, 3/4) and 0.7971804688852168). Group 1: missing, missing, 2, 2 ->
    p = (1/4, 1/4, 1/2), SE = 1.5 ln 2, SE / ln 4 = 0.75 -> 1 - 0.375 = 0.625 (not 1 - 0.25). Group 2: three missing ->
    SE = ln 3 -> 0.5 (not 1: they do not agree)."""
    answers = ["1", None, None, None, None, None, "2", "2", None, None, None]
    group_index = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2])
    linear = semantic_entropy_scale(answers, group_index, 0.5)
    assert linear.tolist() == pytest.approx([0.5] * 4 + [0.625] * 4 + [0.5] * 3, abs=1e-7)
    exponential = semantic_entropy_scale(answers, group_index, 0.5, "exponential")
    expected = [math.exp(-0.5)] * 4 + [math.exp(-0.375)] * 4 + [math.exp(-0.5)] * 3
    assert exponential.tolist() == pytest.approx(expected, abs=1e-7)
