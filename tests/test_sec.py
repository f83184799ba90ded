"""SEC (curricula/sec.py): TD(0) values and Boltzmann probabilities against hand arithmetic, the
documented rng use, state round trips, and errors."""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest
from pydantic import ValidationError

from rlvr.curricula.base import PoolProblem, ProblemOutcome, StepFeedback
from rlvr.curricula.registry import make_strategy
from rlvr.curricula.sampling import draw_index
from rlvr.curricula.sec import SecConfig, SecStrategy, boltzmann_probabilities

A = [PoolProblem("a1", "a"), PoolProblem("a2", "a")]
B = [PoolProblem("b1", "b")]
C = [PoolProblem("c1", "c"), PoolProblem("c2", "c"), PoolProblem("c3", "c")]


def outcome(slot: int, problem: PoolProblem, advantages: tuple[float, ...]) -> ProblemOutcome:
    rewards = tuple(1.0 if a > 0 else 0.0 for a in advantages)
    return ProblemOutcome(slot, problem.problem_id, problem.arm, rewards, advantages)


def rows_by_arm(rows: list[dict]) -> dict[str, dict]:
    return {row["arm"]: row for row in rows}


def test_three_steps_match_hand_arithmetic():
    """α = 0.5, τ = 0.4; arms a (2 problems), b (1), c (3).

    Step 0: Q = (0, 0, 0), P = 1/3 each.
      a pulled twice, mean|A| 1.0 and 0.5 -> r_a = 0.75; b once, mean|A| 0.2 -> r_b = 0.2; c not pulled.
      Q1: a = 0.5·0.75 + 0.5·0 = 0.375; b = 0.5·0.2 + 0.5·0 = 0.1; c = 0 (unchanged).
    Step 1: c's pool is empty, so c is masked: P over {a, b} ∝ (e^(0.375/0.4), e^(0.1/0.4)) = (e^0.9375, e^0.25)
      = (2.553589458062927, 1.284025416687741), sum 3.837614874750668
      -> P_a = 0.665410558746814, P_b = 0.334589441253186.
      b pulled once, mean|A| 0.6 -> Q2_b = 0.5·0.6 + 0.5·0.1 = 0.35; a not pulled -> Q2_a = 0.375; c stays 0.
    Step 2: all arms back. P ∝ (e^0.9375, e^(0.35/0.4) = e^0.875, e^0) = (2.553589458062927, 2.398875293967098, 1),
      sum 5.952464752030025 -> P = (0.428996989388648, 0.403005375739350, 0.167997634872002).
      a pulled with an all-equal group (|A| = 0) -> r_a = 0; c pulled, mean|A| 0.8 -> r_c = 0.8; b not pulled.
      Q3: a = 0.5·0 + 0.5·0.375 = 0.1875; b = 0.35; c = 0.5·0.8 + 0.5·0 = 0.4.
    After: P ∝ (e^0.46875, e^0.875, e^1) = (1.597995449950633, 2.398875293967098, 2.718281828459045),
      sum 6.715152572376776 -> P = (0.237968599034383, 0.357233177967546, 0.404798222998071).
    """
    sec = SecStrategy(SecConfig(alpha=0.5, tau=0.4))
    pool = A + B + C
    assert sec.arm_probabilities(pool) == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}, abs=1e-15)

    rows = rows_by_arm(
        sec.observe(
            StepFeedback(
                0,
                pool,
                [
                    outcome(0, A[0], (1.0, -1.0)),
                    outcome(1, A[1], (0.5, -0.5, 0.5, -0.5)),
                    outcome(2, B[0], (0.2, -0.2)),
                ],
            )
        )
    )
    assert rows["a"] == {
        "arm": "a",
        "pool_size": 2,
        "q_before": 0.0,
        "probability": pytest.approx(1 / 3),
        "pulls": 2,
        "reward": 0.75,
        "q_after": 0.375,
        "cumulative_pulls": 2,
    }
    assert rows["b"]["reward"] == pytest.approx(0.2) and rows["b"]["q_after"] == pytest.approx(0.1)
    assert (rows["c"]["pulls"], rows["c"]["reward"], rows["c"]["q_after"], rows["c"]["pool_size"]) == (0, None, 0.0, 3)

    masked_pool = A + B
    assert sec.arm_probabilities(masked_pool) == pytest.approx(
        {"a": 0.665410558746814, "b": 0.334589441253186}, rel=1e-12
    )
    rows = rows_by_arm(sec.observe(StepFeedback(1, masked_pool, [outcome(0, B[0], (0.6, -0.6))])))
    assert set(rows) == {"a", "b"}  # c has no problems and was not trained: no row, Q untouched
    assert rows["a"]["probability"] == pytest.approx(0.665410558746814, rel=1e-12)
    assert rows["a"]["q_before"] == rows["a"]["q_after"] == 0.375  # not pulled: unchanged
    assert rows["b"]["q_after"] == pytest.approx(0.35, rel=1e-12)
    assert sec.q["c"] == 0.0

    rows = rows_by_arm(
        sec.observe(
            StepFeedback(
                2,
                pool,
                [
                    outcome(0, A[0], (0.0, 0.0, 0.0, 0.0)),
                    outcome(1, C[2], (0.8, -0.8)),
                ],
            )
        )
    )
    assert [rows[arm]["probability"] for arm in "abc"] == pytest.approx(
        [0.428996989388648, 0.403005375739350, 0.167997634872002], rel=1e-12
    )
    assert [rows[arm]["q_after"] for arm in "abc"] == pytest.approx([0.1875, 0.35, 0.4], rel=1e-12)
    assert rows["b"]["q_before"] == rows["b"]["q_after"]
    assert [rows[arm]["cumulative_pulls"] for arm in "abc"] == [3, 2, 1]
    assert sec.arm_probabilities(pool) == pytest.approx(
        {"a": 0.237968599034383, "b": 0.357233177967546, "c": 0.404798222998071}, rel=1e-12
    )
    assert sec.updates == 3 and sec.last_step == 2


def test_pick_probability_is_arm_probability_over_arm_size():
    sec = SecStrategy(SecConfig())
    sec.load_state_dict({"q": {"a": 0.375, "b": 0.1}})
    picks = sec.select(A + B + C, 50, random.Random(3))
    probs = sec.arm_probabilities(A + B + C)
    sizes = {"a": 2, "b": 1, "c": 3}
    for pick in picks:
        assert pick.probability == probs[pick.arm] / sizes[pick.arm]
        assert pick.problem_id.startswith(pick.arm)


def test_select_spends_rng_as_documented():
    """Per slot: one rng.random() for the arm (inverse CDF over sorted arms), one randrange for the problem."""
    sec = SecStrategy(SecConfig())
    sec.load_state_dict({"q": {"a": 0.2, "b": -0.1, "c": 0.05}})
    pool = list(reversed(C + B + A))  # the draw must not depend on the pool's order
    probs = sec.arm_probabilities(pool)
    members = {"a": ["a1", "a2"], "b": ["b1"], "c": ["c1", "c2", "c3"]}
    replay = random.Random(11)
    expected = []
    for _ in range(20):
        u = replay.random()
        arm = "a" if u < probs["a"] else "b" if u < probs["a"] + probs["b"] else "c"
        expected.append(members[arm][replay.randrange(len(members[arm]))])
    assert [p.problem_id for p in sec.select(pool, 20, random.Random(11))] == expected


def test_draw_frequencies_follow_probabilities():
    sec = SecStrategy(SecConfig(tau=0.4))
    sec.load_state_dict({"q": {"a": 0.4, "b": 0.0, "c": 0.2}})
    counts = Counter(p.arm for p in sec.select(A + B + C, 30000, random.Random(0)))
    for arm, prob in sec.arm_probabilities(A + B + C).items():
        assert counts[arm] / 30000 == pytest.approx(prob, abs=0.01)


def test_arm_appearing_later_starts_at_zero():
    sec = SecStrategy(SecConfig())
    sec.observe(StepFeedback(0, A, [outcome(0, A[0], (1.0, -1.0))]))
    rows = rows_by_arm(sec.observe(StepFeedback(1, A + [PoolProblem("n1", "new")], [])))
    assert rows["new"]["q_before"] == 0.0 and rows["new"]["q_after"] == 0.0
    assert rows["a"]["q_after"] == 0.5


def test_trained_arm_outside_pool_is_still_updated():
    sec = SecStrategy(SecConfig())
    rows = rows_by_arm(sec.observe(StepFeedback(0, A, [outcome(0, B[0], (1.0, -1.0))])))
    assert rows["b"]["pool_size"] == 0 and rows["b"]["probability"] is None and rows["b"]["q_after"] == 0.5


def test_alpha_weighs_the_new_reward_and_one_minus_alpha_the_old_value():
    """α = 0.2 (not 0.5, where swapping α and 1 - α changes nothing): arm a's Q goes 0 -> 0.2·0.75 = 0.15,
    then with mean |A| 0.25: 0.2·0.25 + 0.8·0.15 = 0.17. Swapped it would be 0.6 and then 0.32."""
    sec = SecStrategy(SecConfig(alpha=0.2, tau=0.4))
    first = rows_by_arm(sec.observe(StepFeedback(0, A, [outcome(0, A[0], (1.0, -0.5))])))
    assert first["a"]["q_after"] == pytest.approx(0.15, abs=1e-15)
    second = rows_by_arm(sec.observe(StepFeedback(1, A, [outcome(0, A[1], (0.25, -0.25))])))
    assert (second["a"]["q_before"], second["a"]["q_after"]) == (pytest.approx(0.15), pytest.approx(0.17))


def test_state_round_trips_through_json_and_reproduces_next_picks():
    sec = SecStrategy(SecConfig(alpha=0.5, tau=0.4))
    pool = A + B + C
    sec.observe(StepFeedback(0, pool, [outcome(0, A[0], (0.3, -0.3)), outcome(1, C[0], (1 / 3, -1 / 3))]))
    sec.observe(StepFeedback(1, pool, [outcome(0, B[0], (0.7, -0.1, 0.1))]))
    state = sec.state_dict()
    restored = SecStrategy(SecConfig(alpha=0.5, tau=0.4))
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state  # exact floats
    assert restored.select(pool, 16, random.Random(5)) == sec.select(pool, 16, random.Random(5))


def test_large_values_do_not_overflow():
    probs = boltzmann_probabilities({"a": 500.0, "b": 499.0}, ["a", "b"], 0.2)
    assert probs["a"] == pytest.approx(1 / (1 + math.exp(-5)))


def test_draw_index_never_returns_zero_weight_entries():
    assert {draw_index([0.0, 0.0, 1.0, 1.0], random.Random(i)) for i in range(200)} == {2}
    with pytest.raises(ValueError, match="sum to zero"):
        draw_index([0.0, 0.0], random.Random(0))


def test_bad_input_is_refused_with_a_reason():
    sec = SecStrategy(SecConfig())
    with pytest.raises(ValueError, match="cannot select from an empty problem pool"):
        sec.select([], 4, random.Random(0))
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        sec.select(A, 0, random.Random(0))
    with pytest.raises(ValidationError, match="alpha"):
        SecConfig(alpha=0.0)
    with pytest.raises(ValidationError, match="tau"):
        SecConfig(tau=-1.0)


def test_registered_under_its_type():
    assert isinstance(make_strategy(SecConfig()), SecStrategy)
