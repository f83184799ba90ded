"""One meaning for a verdict (verifiers/outcomes.py, issue 51): an environment's reward without a verdict is solved only
at `env.solved_at`, a failed verdict (status error) is no outcome and never trained on, and every reader of
correctness (dynamic sampling, GHPO's hints, CLPO, Knapsack's buffers, difficulty, evaluation) reads it through
the same functions; length shaping counts the model's own tokens."""

from __future__ import annotations

import json

import duckdb
import pyarrow as pa
import pytest

from rlvr.curricula.buffers import OutcomeBuffers
from rlvr.curricula.filtering import DynamicSamplingConfig
from rlvr.environments.base import reward_verdict
from rlvr.errors import UserError
from rlvr.storage.stage import Inputs, StageContext
from rlvr.tasks.allocate import _with_outcomes
from rlvr.tasks.difficulty import difficulty_row
from rlvr.tasks.filter import build as filter_build
from rlvr.tasks.label import environment_verdicts
from rlvr.tasks.restructure import group_accuracy
from rlvr.tasks.update import hint_outcomes
from rlvr.trainer.generation import Sample
from rlvr.trainer.grpo import GRPOConfig, RolloutBatch, overlong_lengths, step_advantages
from rlvr.trainer.updates import step_batch
from rlvr.verifiers.outcomes import OUTCOME_SQL, check_error_share, outcome, solved

ROWS = [  # (verifier, status, score): every kind of row a rewards table holds
    ("arithmetic", "ok", 1.0),
    ("arithmetic", "wrong", 0.0),
    ("format", "wrong", 0.2),  # partial credit: not solved
    ("env:gym", "wrong", -0.1),  # GEM's penalty for a bad guess
    ("env:gym", "ok", 1.0),
    ("judge", "error", 0.0),
    ("env:calculator", "timeout", 0.0),
    ("rlpr", "ok", 0.37),
    ("rlpr", "unparseable", 0.0),
]


def test_outcome_reads_correctness_and_rlpr_its_reward_and_an_error_has_none():
    assert [outcome(*row) for row in ROWS] == [1.0, 0.0, 0.0, 0.0, 1.0, None, 0.0, 0.37, 0.0]
    assert [solved(v, s) for v, s, _ in ROWS] == [True, False, False, False, True, None, False, None, None]


def test_the_sql_twin_gives_the_same_outcome_row_for_row():
    rewards = pa.table({name: [row[k] for row in ROWS] for k, name in enumerate(("verifier", "status", "score"))})
    con = duckdb.connect()
    con.register("rewards", rewards)
    found = con.execute(f"SELECT {OUTCOME_SQL} AS o FROM rewards").fetchall()
    assert [o for (o,) in found] == [outcome(*row) for row in ROWS]


def test_a_reward_without_a_verdict_is_solved_only_at_solved_at():
    assert reward_verdict(-0.1, 1.0).status == "wrong"
    assert reward_verdict(0.0, 1.0).status == "wrong"
    assert reward_verdict(1.0, 1.0).status == "ok"
    assert reward_verdict(1.0, 1.0).reason == "reward 1 >= env.solved_at 1"
    nan = reward_verdict(float("nan"), 1.0)
    assert (nan.status, nan.value) == ("error", 0.0)
    assert reward_verdict(float("-inf"), 0.0).status == "error"


def _episode_rollouts(*episodes: tuple[str, float | None, dict | None]) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "rollout_id": rid,
                "env": "gym@1",
                "env_reward": reward,
                "env_verdict": None if verdict is None else json.dumps(verdict),
            }
            for rid, reward, verdict in episodes
        ]
    )


def test_the_label_stage_never_reads_an_environments_reward_as_solved():
    wrong = {"status": "wrong", "reason": "reward -0.1 < env.solved_at 1", "extracted": None, "components": {}}
    failed = {"status": "error", "reason": "the environment's step ran past 5 s", "extracted": None, "components": {}}
    rows = environment_verdicts(
        _episode_rollouts(
            ("decided", -0.1, wrong),
            ("undecided", -0.1, None),  # a reward with no verdict: before verdicts were recorded
            ("failed", None, failed),  # an episode that failed: no reward, an error verdict
            ("left", None, None),  # neither: the verifier scores its final answer
        )
    )
    assert {rid: (r["status"], r["score"]) for rid, r in rows.items()} == {
        "decided": ("wrong", -0.1),
        "undecided": ("error", 0.0),
        "failed": ("error", 0.0),
    }
    assert rows["failed"]["reason"] == "the environment's step ran past 5 s"
    assert rows["decided"]["verifier"] == "env:gym"


def _step(statuses: dict[int, list[tuple[str, float, str]]]) -> Inputs:
    """A step's rollouts and rewards: per slot, its samples' (status, score, verifier)."""
    rollouts, rewards = [], []
    for slot, samples in statuses.items():
        for k, (status, score, verifier) in enumerate(samples):
            rid = f"r{slot}{k}"
            rollouts.append(
                {
                    "rollout_id": rid,
                    "slot": slot,
                    "sample_index": k,
                    "problem_id": f"p{slot}",
                    "prompt": f"{slot}+0=",
                    "completion_ids": [4, 2],
                    "response": "4",
                    "n_tokens": 2,
                    "finish_reason": "stop",
                }
            )
            rewards.append(
                {
                    "rollout_id": rid,
                    "step": 1,
                    "problem_id": f"p{slot}",
                    "verifier": verifier,
                    "status": status,
                    "score": score,
                    "reason": "failed" if status == "error" else None,
                }
            )
    return Inputs.given(rollouts=pa.Table.from_pylist(rollouts), rewards=pa.Table.from_pylist(rewards))


GEM_MIXED = [("wrong", -0.1, "env:gym"), ("ok", 1.0, "env:gym")]
GEM_PENALTIES = [("wrong", -0.1, "env:gym"), ("wrong", 0.0, "env:gym")]  # rewards differ, nothing solved
WITH_AN_ERROR = [("ok", 1.0, "judge"), ("error", 0.0, "judge")]  # one verdict: no signal


def test_dynamic_sampling_keeps_groups_by_outcome_and_leaves_error_rows_out():
    inputs = _step({0: GEM_MIXED, 1: GEM_PENALTIES, 2: WITH_AN_ERROR})
    ctx = StageContext("r", 0, 1, "filter", {}, {}, {"batch_size": 3, "refills_done": 2})
    built = filter_build(inputs, DynamicSamplingConfig(enabled=True, max_refills=2), ctx)
    assert {r["slot"]: r["reason"] for r in built.table.to_pylist()} == {
        0: "kept",
        1: "zero variance",
        2: "zero variance",
    }


def test_the_update_trains_on_no_error_row_whatever_its_source():
    inputs = _step({0: [("ok", 1.0, "arithmetic"), ("error", 0.0, "arithmetic")], 1: GEM_MIXED})
    batch = step_batch(inputs, GRPOConfig())
    assert batch.rollout_ids == ["r00", "r10", "r11"]
    assert batch.reward_errors == 1


def test_hints_clpo_and_knapsack_read_solved_not_the_reward():
    inputs = _step({0: GEM_MIXED, 1: GEM_PENALTIES, 2: WITH_AN_ERROR})
    assert {g.slot: g.any_correct for g in hint_outcomes(inputs)} == {0: True, 1: False, 2: True}
    assert group_accuracy(inputs) == [(0, "p0", 0.5), (1, "p1", 0.0), (2, "p2", 1.0)]
    buffers = _with_outcomes(OutcomeBuffers(), inputs.table("rewards"))
    assert buffers.outcomes("p1") == [0.0, 0.0]  # not the game's -0.1
    assert buffers.outcomes("p2") == [1.0]  # the failed verdict is no outcome


def test_difficulty_counts_only_the_samples_with_a_verdict():
    assert difficulty_row("r", "p", "pol", 6, 3, 5)["pass_rate"] == 0.5
    none = difficulty_row("r", "p", "pol", 0, 0, 5)
    assert (none["pass_rate"], none["posterior_mean"]) == (None, 0.5)


def test_past_the_threshold_failed_verdicts_stop_in_one_line():
    rows = [{"status": "ok", "verifier": "env:gym", "reason": None}] * 8
    rows += [{"status": "error", "verifier": "env:gym", "reason": "the environment's step raised KeyError: 'x'"}]
    check_error_share(rows, "rewards of step 2", 0.2)  # 1 of 9: under
    with pytest.raises(UserError) as raised:
        check_error_share(rows, "rewards of step 2", 0.1)
    assert str(raised.value) == (
        "1 of 9 rewards of step 2 have no verdict (status error; more than reward.max_error_rate 0.1); first, from "
        "env:gym: the environment's step raised KeyError: 'x'"
    )


def _episode(mask: list[int], starts: list[int]) -> tuple[Sample, list[int], list[int]]:
    ids = list(range(len(mask)))
    return Sample(0, 0, ids, "", len(ids), "stop"), mask, starts


def test_length_shaping_counts_the_longest_sampled_turn_not_the_environments_tokens():
    # two turns of 3 and 2 sampled tokens around 5 tokens of tool output: 10 tokens, the longest turn 3
    sample, mask, starts = _episode([1, 1, 1, 0, 0, 0, 0, 0, 1, 1], [0, 8])
    one_turn = Sample(1, 0, [5, 6, 7, 8], "", 4, "stop")
    batch = RolloutBatch(prompts=["a", "b"], samples=[sample, one_turn], rewards=[1.0, 1.0])
    batch.loss_masks, batch.turn_starts = [mask, None], [starts, None]
    assert overlong_lengths(batch).tolist() == [3, 4]
    # with max_new_tokens 4 and a buffer of 2, a 3-token turn costs -0.5, 4 tokens -1; 10 tokens would cost -1
    batch.max_new_tokens = 4
    cfg = GRPOConfig(overlong="penalty", overlong_buffer=2, advantage_scale="none")
    advantages = step_advantages(batch, pa_rewards(batch), group_of(batch), cfg)
    assert advantages.tolist() == [0.0, 0.0]  # each alone in its group: the penalty joins the reward, not the mean
    batch.samples[1] = Sample(0, 1, [5, 6, 7, 8], "", 4, "stop")  # now the same group: 0.5 - 0 vs 0 - 0.5
    assert step_advantages(batch, pa_rewards(batch), group_of(batch), cfg).tolist() == [0.25, -0.25]


def pa_rewards(batch: RolloutBatch):
    import torch

    return torch.tensor(batch.rewards, dtype=torch.float32)


def group_of(batch: RolloutBatch):
    import torch

    return torch.tensor([s.prompt_index for s in batch.samples], dtype=torch.long)
