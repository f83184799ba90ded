"""The plain functions behind the stages: generator, verifier, validation, splits, selection, budgets."""

from __future__ import annotations

import random
from collections import Counter

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlvr.curricula.base import Estimate, Pick, PoolProblem
from rlvr.curricula.uniform import UniformConfig, UniformStrategy
from rlvr.curricula.uniform_budget import UniformBudget, UniformBudgetConfig
from rlvr.data.validate import validate
from rlvr.storage.stage import Inputs
from rlvr.tasks.synthesize import assign_splits
from rlvr.trainer.grpo import GRPOConfig
from rlvr.trainer.updates import rollout_batch, step_batch
from rlvr.verifiers.arithmetic import ArithmeticSpec, ArithmeticVerifier, generate, space_size


def test_generator_enumerates_small_spaces_once():
    problems = generate(ArithmeticSpec(digits=1, terms=2, count=100), seed=0)
    assert len(problems) == 100 == space_size(ArithmeticSpec())
    assert len({p["prompt"] for p in problems}) == 100
    for p in problems:
        a, b = p["prompt"].rstrip("=").split("+")
        assert int(p["answer"]) == int(a) + int(b)


def test_generator_is_seeded_and_respects_precedence():
    spec = ArithmeticSpec(digits=2, terms=3, ops="+-*", count=50)
    assert generate(spec, 1) == generate(spec, 1)
    assert generate(spec, 1) != generate(spec, 2)
    for p in generate(spec, 1):
        assert int(p["answer"]) == eval(p["prompt"].rstrip("="))


def test_verifier_compares_whole_numbers_exactly():
    v = ArithmeticVerifier()
    assert v.score("12", "12").status == "ok"
    assert v.score("12.0", "12").status == "ok"
    assert v.score("+12", "12").value == 1.0
    assert v.score("13", "12").status == "wrong"
    assert v.score("2", "12").status == "wrong"  # the last digit is not the answer
    assert v.score("121", "12").status == "wrong"
    assert v.score("", "12").status == "unparseable"
    assert v.score("1+1", "12").status == "unparseable"
    assert v.score("12", "x").status == "error"


def test_validation_accounts_for_every_row():
    rows = [
        {"prompt": "1+1=", "answer": "2", "source_index": 0},
        {"prompt": "", "answer": "2", "source_index": 2},
        {"prompt": "9" * 60, "answer": "9", "source_index": 3},
        {"prompt": "2+2=", "answer": "four", "source_index": 4},
        {"prompt": "2+3=", "answer": "5", "source_index": 5},
    ]
    accepted, rejected, read = validate(rows, "sums", "arithmetic", max_prompt_chars=48)
    assert [c.source_index for c in accepted] == [0, 5]
    assert [(r.check, r.reason) for r in rejected] == [
        ("prompt", "empty prompt"),
        ("prompt", "prompt is 60 characters; the limit (synthesize.max_prompt_chars) is 48"),
        ("parse", "arithmetic: reference 'four' is not a plain number"),
    ]
    assert len(accepted) + len(rejected) == read == len(rows)


def test_splits_have_exact_sizes():
    labels = assign_splits(100, 0.2, 0.3, seed=0)
    assert Counter(labels) == {"test": 20, "warmup": 30, "train": 50}
    assert labels == assign_splits(100, 0.2, 0.3, seed=0)
    assert labels != assign_splits(100, 0.2, 0.3, seed=1)
    with pytest.raises(ValueError):
        assign_splits(10, 0.6, 0.6, seed=0)


def select_uniform(pool_ids, batch_size, seed):
    pool = [PoolProblem(pid, "a") for pid in sorted(pool_ids)]
    picks = UniformStrategy(UniformConfig()).select(pool, batch_size, random.Random(seed))
    return [(p.problem_id, p.probability) for p in picks]


def test_uniform_selection():
    pool = [f"p{i}" for i in range(10)]
    picks = select_uniform(pool, 4, seed=3)
    assert len(picks) == 4 and len({p for p, _ in picks}) == 4
    assert all(prob == pytest.approx(0.4) for _, prob in picks)
    assert picks == select_uniform(list(reversed(pool)), 4, seed=3)  # order of the pool does not matter
    assert picks == [(pid, 0.4) for pid in random.Random(3).sample(sorted(pool), 4)]  # the documented rng use
    with_replacement = select_uniform(pool[:2], 5, seed=0)
    assert len(with_replacement) == 5 and all(prob == 0.5 for _, prob in with_replacement)
    with pytest.raises(ValueError, match="empty problem pool"):
        select_uniform([], 1, seed=0)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 200), st.integers(1, 64))
def test_uniform_budget_sums(n_prompts, n):
    picks = [Pick(f"p{i}", "a", 1.0) for i in range(n_prompts)]
    budget = UniformBudget(UniformBudgetConfig(n=n)).allocate(picks, [Estimate(None)] * n_prompts, n_prompts * n)
    assert [a.n for a in budget] == [n] * n_prompts and {a.case for a in budget} <= {"unknown"}


def test_uniform_budget_refuses_an_uneven_budget():
    picks = [Pick("p0", "a", 1.0), Pick("p1", "a", 1.0)]
    with pytest.raises(ValueError, match="does not split evenly over 2 prompts"):
        UniformBudget(UniformBudgetConfig()).allocate(picks, [Estimate(0.5), Estimate(None)], 5)


def test_rollout_batch_groups_by_slot():
    rows = [
        {
            "rollout_id": f"r{s}{i}",
            "slot": s,
            "sample_index": i,
            "prompt": f"{s}+0=",
            "completion_ids": [4 + s, 2],
            "response": str(s),
            "n_tokens": 2,
            "finish_reason": "stop",
        }
        for s in (1, 0)
        for i in (1, 0)
    ]
    scores = {r["rollout_id"]: float(r["slot"]) for r in rows}
    batch = rollout_batch(rows, scores)
    assert batch.prompts == ["0+0=", "1+0="]
    assert [(s.prompt_index, s.sample_index) for s in batch.samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert batch.rewards == [0.0, 0.0, 1.0, 1.0]

    rewards = pa.table(
        {
            "rollout_id": [r["rollout_id"] for r in rows],
            "score": [scores[r["rollout_id"]] for r in rows],
            "status": ["ok" if scores[r["rollout_id"]] else "wrong" for r in rows],
            "verifier": ["arithmetic"] * len(rows),
            "extracted": [f"x{r['rollout_id']}" for r in rows],
        }
    )
    inputs = Inputs.given(rollouts=pa.Table.from_pylist(rows), rewards=rewards)
    assert step_batch(inputs, GRPOConfig()).answers is None  # read only for SEED-GRPO
    seed = step_batch(inputs, GRPOConfig(semantic_entropy=0.5))
    assert seed.answers == ["xr00", "xr01", "xr10", "xr11"]  # in the batch's sample order
