"""Prioritized (Kimi k1.5), VAS (MMR1), DADS (RuleReasoner) and DAPO dynamic sampling: their numbers by
hand, their documented rng use, state round trips and errors."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from pydantic import ValidationError

from rlvr.curricula.base import PoolProblem, ProblemOutcome, StepFeedback
from rlvr.curricula.dads import DadsConfig, DadsStrategy, dads_probabilities, reward_ema
from rlvr.curricula.filtering import DynamicSamplingConfig, filter_groups, has_reward_variance, prompts_to_draw
from rlvr.curricula.prioritized import PrioritizedConfig, PrioritizedStrategy, success_rate
from rlvr.curricula.registry import make_strategy
from rlvr.curricula.vas import VasConfig, VasStrategy, outcome_variance, response_diversity, slot_split


def outcome(slot: int, problem_id: str, arm: str, rewards: tuple[float, ...], responses: tuple[str, ...] = ()):
    return ProblemOutcome(slot, problem_id, arm, rewards, tuple(0.0 for _ in rewards), responses)


def replay_inverse_cdf(probs: list[float], rng: random.Random) -> int:
    """The documented draw: the first index whose cumulative probability exceeds u·total."""
    u = rng.random() * sum(probs)
    return next(i for i, c in enumerate(itertools.accumulate(probs)) if u < c)


# --- prioritized (Kimi k1.5) ---------------------------------------------------------------------------

KIMI_POOL = [
    PoolProblem("p1", "x", p_hat=0.9),
    PoolProblem("p2", "x"),  # no estimate: prior 0.5
    PoolProblem("p3", "y", p_hat=0.0),  # never solved: held at the floor
    PoolProblem("p4", "y", p_hat=0.2),  # its history (all solved) overrides p̂
]


def solved_p4() -> PrioritizedStrategy:
    kimi = PrioritizedStrategy(PrioritizedConfig(success_floor=0.5))
    kimi.load_state_dict({"history": {"p4": [1.0, 1.0]}})
    return kimi


def test_prioritized_probabilities_by_hand():
    # Weights 1 − max(s, 0.5): p1 1 − 0.9 = 0.1, p2 1 − 0.5 = 0.5, p3 1 − max(0, 0.5) = 0.5, p4 1 − 1 = 0;
    # total 1.1 -> 1/11, 5/11, 5/11, 0.
    drawn = {p.problem_id: prob for p, prob in solved_p4().draw_probabilities(KIMI_POOL)}
    assert drawn == pytest.approx({"p1": 1 / 11, "p2": 5 / 11, "p3": 5 / 11, "p4": 0.0})
    # success_floor 0 is the paper's rule: p3 weighs 1; 0.1 + 0.5 + 1 + 0 = 1.6.
    kimi = PrioritizedStrategy(PrioritizedConfig(success_floor=0.0))
    kimi.load_state_dict({"history": {"p4": [1.0, 1.0]}})
    drawn = {p.problem_id: prob for p, prob in kimi.draw_probabilities(KIMI_POOL)}
    assert drawn == pytest.approx({"p1": 0.1 / 1.6, "p2": 0.5 / 1.6, "p3": 1 / 1.6, "p4": 0.0})


def test_prioritized_select_spends_one_random_per_slot():
    kimi = solved_p4()
    picks = kimi.select(list(reversed(KIMI_POOL)), 30, random.Random(7))
    replay = random.Random(7)
    probs = [1 / 11, 5 / 11, 5 / 11, 0.0]
    assert [p.problem_id for p in picks] == [f"p{replay_inverse_cdf(probs, replay) + 1}" for _ in range(30)]
    assert "p4" not in {p.problem_id for p in picks}
    assert {p.problem_id: p.probability for p in picks}["p2"] == pytest.approx(5 / 11)


def test_prioritized_history_is_bounded_and_clipped():
    kimi = PrioritizedStrategy(PrioritizedConfig(history=4))
    kimi.observe(StepFeedback(0, KIMI_POOL, [outcome(0, "p1", "x", (1.0, 0.0, 1.5))]))
    kimi.observe(StepFeedback(1, KIMI_POOL, [outcome(0, "p1", "x", (0.0, -0.5, 1.0))]))
    assert kimi.history["p1"] == [1.5, 0.0, -0.5, 1.0]  # the last 4, oldest dropped
    assert success_rate(kimi.history["p1"]) == 0.5  # (1 + 0 + 0 + 1) / 4 after clipping to [0, 1]
    assert kimi.success(KIMI_POOL[0]) == 0.5  # the history now overrides p̂ = 0.9


def test_prioritized_audit_rows_carry_the_arm_probability():
    rows = {r["arm"]: r for r in solved_p4().observe(StepFeedback(0, KIMI_POOL, [outcome(0, "p3", "y", (0.0, 0.0))]))}
    assert rows["x"]["probability"] == pytest.approx(6 / 11) and rows["y"]["probability"] == pytest.approx(5 / 11)
    assert rows["y"]["pulls"] == 1 and rows["x"]["pulls"] == 0


def test_prioritized_all_mastered_pool_draws_uniformly():
    kimi = PrioritizedStrategy(PrioritizedConfig())
    pool = [PoolProblem("a", "x", p_hat=1.0), PoolProblem("b", "x", p_hat=1.0)]
    assert [prob for _, prob in kimi.draw_probabilities(pool)] == [0.5, 0.5]
    assert len(kimi.select(pool, 3, random.Random(0))) == 3


def test_prioritized_state_round_trip_reproduces_picks():
    kimi = PrioritizedStrategy(PrioritizedConfig())
    kimi.observe(StepFeedback(0, KIMI_POOL, [outcome(0, "p1", "x", (0.1, 0.7)), outcome(1, "p3", "y", (1.0,))]))
    restored = PrioritizedStrategy(PrioritizedConfig())
    restored.load_state_dict(json.loads(json.dumps(kimi.state_dict())))
    assert restored.state_dict() == kimi.state_dict()
    assert restored.select(KIMI_POOL, 12, random.Random(2)) == kimi.select(KIMI_POOL, 12, random.Random(2))


# --- VAS (MMR1) ----------------------------------------------------------------------------------------


def test_vas_scores_by_hand():
    assert outcome_variance((1.0, 0.0, 1.0, 1.0)) == 0.1875  # p̂ = 0.75: 0.75 · 0.25
    assert outcome_variance(()) == 0.0
    # "a b" -> {a, b, (a,b)}, "a c" -> {a, c, (a,c)}: shared {a}, union of 5: distance 1 − 1/5 = 0.8.
    assert response_diversity(["a b", "a c"]) == pytest.approx(0.8)
    # Pairs of ("a b", "a c", "a b"): 0.8, 0, 0.8 -> mean 1.6 / 3.
    assert response_diversity(["a b", "a c", "a b"]) == pytest.approx(1.6 / 3)
    assert response_diversity(["same text"] * 4) == 0.0 and response_diversity(["x", "y"]) == 1.0
    assert response_diversity(["only one"]) == 0.0 and response_diversity(["", ""]) == 0.0


def test_vas_slot_split_rounds_half_up():
    assert [slot_split(5, 0.5), slot_split(4, 0.5), slot_split(10, 0.0), slot_split(3, 1.0)] == [
        (3, 2),
        (2, 2),
        (0, 10),
        (3, 0),
    ]
    assert slot_split(100, 0.29) == (29, 71)


VAS_POOL = [PoolProblem("u", "k"), PoolProblem("v", "k", p_hat=0.9), PoolProblem("w", "m", p_hat=0.5)]


def test_vas_refreshes_every_update_every_steps():
    vas = VasStrategy(VasConfig(update_every=2))
    # Priors: VPS = 0.5·OVS + 0.5·TDS with TDS = 1: u (no p̂) 0.5·0.25 + 0.5 = 0.625,
    # v 0.5·0.09 + 0.5 = 0.545, w 0.625; total 1.795.
    assert vas.vps_probabilities(VAS_POOL) == pytest.approx([0.625 / 1.795, 0.545 / 1.795, 0.625 / 1.795])
    step0 = [outcome(0, "u", "k", (1.0, 0.0), ("a b", "a c")), outcome(1, "w", "m", (1.0, 1.0), ("z", "z"))]
    rows = vas.observe(StepFeedback(0, VAS_POOL, step0))
    assert not rows[0]["refreshed"] and vas.vps == {}  # scored, but the draws still use the old table
    # u: OVS 0.25, TDS 0.8 -> 0.525; w: OVS 0, TDS 0 -> 0 (never drawn by VPS); v keeps its prior 0.545.
    rows = vas.observe(StepFeedback(1, VAS_POOL, []))
    assert rows[0]["refreshed"] and vas.vps == pytest.approx({"u": 0.525, "w": 0.0})
    assert vas.vps_probabilities(VAS_POOL) == pytest.approx([0.525 / 1.07, 0.545 / 1.07, 0.0])


def test_vas_select_spends_rng_as_documented():
    vas = VasStrategy(VasConfig(vps_share=0.5))
    vas.load_state_dict({"vps": {"u": 0.525, "w": 0.0}})
    probs = [0.525 / 1.07, 0.545 / 1.07, 0.0]
    picks = vas.select(list(reversed(VAS_POOL)), 5, random.Random(4))
    replay = random.Random(4)
    ids = ["u", "v", "w"]
    expected = [ids[replay_inverse_cdf(probs, replay)] for _ in range(3)] + [ids[replay.randrange(3)] for _ in range(2)]
    assert [p.problem_id for p in picks] == expected
    assert [p.probability for p in picks[3:]] == [1 / 3, 1 / 3]
    assert all(p.probability == pytest.approx(probs[ids.index(p.problem_id)]) for p in picks[:3])


def test_vas_zero_scores_fall_back_to_uniform_and_state_round_trips():
    vas = VasStrategy(VasConfig(update_every=1))
    solved = [outcome(i, pid, "k", (1.0, 1.0), ("s", "s")) for i, pid in enumerate("uvw")]
    vas.observe(StepFeedback(0, VAS_POOL, solved))
    assert vas.vps_probabilities(VAS_POOL) == [1 / 3, 1 / 3, 1 / 3]
    restored = VasStrategy(VasConfig(update_every=1))
    restored.load_state_dict(json.loads(json.dumps(vas.state_dict())))
    assert restored.state_dict() == vas.state_dict()
    assert restored.select(VAS_POOL, 9, random.Random(8)) == vas.select(VAS_POOL, 9, random.Random(8))


# --- DADS (RuleReasoner) -------------------------------------------------------------------------------

DADS_POOL = [PoolProblem("x1", "x"), PoolProblem("x2", "x"), PoolProblem("y1", "y")]


def test_dads_ema_and_probabilities_by_hand():
    """γ 0.9, τ 0.5, uniform_share 0.1.

    Before any batch both arms count as r̄ = 0: P = 0.5 each.
    Step 0: x's slots have mean rewards 1.0 and 0.5 -> 0.75, its first batch, so r̄_x = 0.75; y's 0.0 -> r̄_y = 0.
    Weights exp((1 − 0.75)/0.5) = e^0.5 and exp(1/0.5) = e^2: softmax_x = 1/(1 + e^1.5) = 0.182425523806356,
    so P_x = 0.9·0.182425523806356 + 0.05 = 0.214182971425721 and P_y = 0.785817028574279.
    Step 1: x's batch mean 0.25 -> r̄_x = 0.9·0.75 + 0.1·0.25 = 0.7; y not pulled keeps 0.
    """
    dads = DadsStrategy(DadsConfig(gamma=0.9, tau=0.5, uniform_share=0.1))
    assert dads.arm_probabilities(DADS_POOL) == {"x": 0.5, "y": 0.5}
    rows = {
        r["arm"]: r
        for r in dads.observe(
            StepFeedback(
                0,
                DADS_POOL,
                [
                    outcome(0, "x1", "x", (1.0, 1.0)),
                    outcome(1, "x2", "x", (1.0, 0.0, 0.0, 1.0)),
                    outcome(2, "y1", "y", (0.0,)),
                ],
            )
        )
    }
    assert rows["x"]["q_before"] is None and rows["x"]["reward"] == 0.75 and rows["x"]["q_after"] == 0.75
    assert rows["x"]["probability"] == 0.5 and rows["y"]["q_after"] == 0.0
    assert dads.arm_probabilities(DADS_POOL) == pytest.approx(
        {"x": 0.214182971425721, "y": 0.785817028574279}, rel=1e-12
    )
    rows = {r["arm"]: r for r in dads.observe(StepFeedback(1, DADS_POOL, [outcome(0, "x1", "x", (0.25,))]))}
    assert rows["x"]["q_after"] == pytest.approx(0.7) and rows["y"]["q_after"] == rows["y"]["q_before"] == 0.0
    assert rows["x"]["cumulative_pulls"] == 3 and rows["y"]["cumulative_pulls"] == 1


def test_dads_clips_rewards_and_keeps_a_floor():
    assert reward_ema(None, 0.4, 0.9) == 0.4 and reward_ema(0.4, 1.0, 0.5) == 0.7
    # r̄ 1.3 counts as 1 (need 0) and −2 as 0 (need 1): the weight ratio is at most e^(1/τ).
    probs = dads_probabilities({"hard": -2.0, "easy": 1.3}, ["easy", "hard"], 0.5, 0.0)
    assert probs["hard"] / probs["easy"] == pytest.approx(2.718281828459045**2)
    probs = dads_probabilities({"hard": 0.0, "easy": 1.0}, ["easy", "hard"], 0.01, 0.2)
    assert probs["easy"] == pytest.approx(0.1)  # the softmax gives it ~0; the uniform share keeps 0.2 / 2


def test_dads_picks_and_state_round_trip():
    dads = DadsStrategy(DadsConfig())
    dads.observe(StepFeedback(0, DADS_POOL, [outcome(0, "x1", "x", (1.0, 0.0, 1.0))]))
    arm_probs = dads.arm_probabilities(DADS_POOL)
    picks = dads.select(DADS_POOL, 20, random.Random(9))
    assert all(p.probability == arm_probs[p.arm] / {"x": 2, "y": 1}[p.arm] for p in picks)
    restored = DadsStrategy(DadsConfig())
    restored.load_state_dict(json.loads(json.dumps(dads.state_dict())))
    assert restored.state_dict() == dads.state_dict()
    assert restored.select(DADS_POOL, 20, random.Random(9)) == picks


# --- errors and registration, every strategy ------------------------------------------------------------


@pytest.mark.parametrize("cfg", [PrioritizedConfig(), VasConfig(), DadsConfig()])
def test_strategies_refuse_bad_input_and_are_registered(cfg):
    strategy = make_strategy(cfg)
    assert strategy.type == cfg.type
    with pytest.raises(ValueError, match="cannot select from an empty problem pool"):
        strategy.select([], 2, random.Random(0))
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        strategy.select(DADS_POOL, 0, random.Random(0))


def test_configs_refuse_out_of_range_values():
    with pytest.raises(ValidationError, match="success_floor"):
        PrioritizedConfig(success_floor=1.0)
    with pytest.raises(ValidationError, match="vps_share"):
        VasConfig(vps_share=1.5)
    with pytest.raises(ValidationError, match="gamma"):
        DadsConfig(gamma=1.0)
    with pytest.raises(ValidationError, match="oversample"):
        DynamicSamplingConfig(oversample=0.5)


# --- DAPO dynamic sampling -----------------------------------------------------------------------------

ON = DynamicSamplingConfig(enabled=True, oversample=1.5, max_refills=2)
GROUPS = [[1, 1], [1, 0], [0, 0], [0, 1], [1, 0, 0]]


def test_reward_variance():
    assert has_reward_variance([1, 0, 1]) and has_reward_variance([0.2, 0.3])
    assert not has_reward_variance([1, 1]) and not has_reward_variance([0.5]) and not has_reward_variance([])


def test_prompts_to_draw():
    assert prompts_to_draw(4, ON) == 6 and prompts_to_draw(1, ON) == 2
    assert prompts_to_draw(10, DynamicSamplingConfig(enabled=True, oversample=1.1)) == 11
    assert prompts_to_draw(4, DynamicSamplingConfig()) == 4
    with pytest.raises(ValueError, match="wanted_groups must be >= 0, got -1"):
        prompts_to_draw(-1, ON)


def test_filter_keeps_the_first_valid_groups():
    decision = filter_groups(GROUPS, 2, 0, ON)
    assert (decision.keep, decision.zero_variance, decision.surplus) == ((1, 3), (0, 2), (4,))
    assert not decision.refill and not decision.limit_reached and decision.effective_ratio == 0.6


def test_filter_asks_for_a_refill_then_stops_at_the_limit():
    decision = filter_groups(GROUPS, 4, 0, ON)  # 3 valid of 4 wanted: refill ceil(1.5 · 1) = 2 prompts
    assert decision.keep == (1, 3, 4) and decision.refill and decision.refill_prompts == 2
    decision = filter_groups(GROUPS + [[1, 1], [0, 0]], 4, 2, ON)  # still 3 after the second refill
    assert decision.keep == (1, 3, 4) and not decision.refill and decision.limit_reached


def test_filter_disabled_keeps_everything():
    decision = filter_groups(GROUPS, 5, 0, DynamicSamplingConfig())
    assert decision.keep == (0, 1, 2, 3, 4) and not decision.refill and decision.effective_ratio == 0.6


def test_band_pass_keeps_groups_whose_pass_rate_is_inside_the_band():
    """Pass rates 0.25, 0.75, 0.5, 1/8, 7/8 and 1.0 (no variance) with band [0.25, 0.75]: 0.25, 0.75 and 0.5 are
    kept (bounds included); 1/8 and 7/8 have variance but fall outside; with B = 4 a refill is asked."""
    groups = [[1, 0, 0, 0], [1, 1, 1, 0], [1, 0], [1] + [0] * 7, [1] * 7 + [0], [1, 1]]
    band = DynamicSamplingConfig(enabled=True, band=(0.25, 0.75), max_refills=1)
    decision = filter_groups(groups, 4, 0, band)
    assert (decision.keep, decision.outside_band, decision.zero_variance) == ((0, 1, 2), (3, 4), (5,))
    assert decision.refill_prompts == 2 and decision.effective_ratio == 5 / 6  # the ratio counts variance only
    assert filter_groups(groups, 4, 0, ON).keep == (0, 1, 2, 3)  # without the band 1/8 is kept
    with pytest.raises(ValueError, match=r"band must be \[low, high\] with 0 <= low <= high <= 1, got \[0.8, 0.2\]"):
        DynamicSamplingConfig(band=(0.8, 0.2))


def test_filter_refuses_bad_input():
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        filter_groups(GROUPS, 0, 0, ON)
    with pytest.raises(ValueError, match="refills_done must be >= 0, got -1"):
        filter_groups(GROUPS, 2, -1, ON)


def test_the_filter_stage_filters_on_correctness_not_on_the_shaped_score():
    """Slot 0: all wrong with partial-credit scores 0.2 and 0.6 (score variance, no signal); slot 1: one right,
    one wrong with equal scores 0.5 (no score variance, signal). Filtering on the score would keep slot 0."""
    import pyarrow as pa

    from rlvr.storage.stage import Inputs, StageContext
    from rlvr.tasks.filter import build

    rollouts = pa.table(
        {
            "rollout_id": ["r0", "r1", "r2", "r3"],
            "slot": [0, 0, 1, 1],
            "sample_index": [0, 1, 0, 1],
            "problem_id": ["p0", "p0", "p1", "p1"],
        }
    )
    rewards = pa.table(
        {
            "rollout_id": ["r0", "r1", "r2", "r3"],
            "status": ["wrong", "wrong", "ok", "wrong"],
            "score": [0.2, 0.6, 0.5, 0.5],
            "verifier": ["arithmetic"] * 4,
        }
    )
    params = {"batch_size": 1, "refills_done": 1, "first_slot": 0}
    ctx = StageContext("r", 0, 1, "filter", {}, {"filtered_groups": "f-1"}, params)
    built = build(
        Inputs.given(rollouts=rollouts, rewards=rewards), DynamicSamplingConfig(enabled=True, max_refills=1), ctx
    )
    rows = built.table.to_pylist()
    assert [(r["slot"], r["kept"], r["reason"], r["mean_reward"]) for r in rows] == [
        (0, False, "zero variance", 0.0),
        (1, True, "kept", 0.5),
    ]
