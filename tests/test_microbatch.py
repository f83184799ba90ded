"""Gradient accumulation (`GRPOConfig.micro_batch_tokens`): a step split into micro-batches gives the update and
the stats of the unsplit step, and no forward pass with gradients holds more padded tokens than the budget.

The batch has one big group (12 samples) that the budgets below cut across micro-batches, and small ragged
groups beside it (one uniform, one of one: no signal). SGD keeps the parameters linear in the gradients, so the
split and unsplit steps agree to float32 summation noise (the tolerance of tests/test_distributed.py).
"""

import dataclasses
import math

import pytest
import torch

from rlvr.trainer.grpo import GRPOConfig, TrainingRows, grpo_step, micro_batches, step_advantages, training_rows
from rlvr.trainer.policy import PolicyConfig, init_policy
from tests.test_distributed import ATOL, _assert_same_parameters, _assert_same_stats, _fresh, ragged_batch

# Groups 0, 1, 3 carry signal (12, 3, 4 samples); 2 is uniform and 4 is a group of one. Two minibatches:
# groups {0, 1} (15 rows) then {3} (4 rows).
BATCH = dataclasses.replace(ragged_batch(3, [12, 3, 2, 4, 1], uniform=(2,)), kl_weights=[0.5, 1.0, 1.0, 2.0, 1.0])
AGGREGATIONS: dict[str, GRPOConfig] = {
    "seq-mean": GRPOConfig(lr=1e-2, minibatches=2, aggregation="seq-mean-token-mean", kl_beta=0.5),
    "token-mean": GRPOConfig(lr=1e-2, minibatches=2, aggregation="token-mean", kl_beta=0.5, weight_decay=0.1),
    "token-sum": GRPOConfig(
        lr=1e-2, minibatches=2, aggregation="token-sum", advantage_scale="none", kl_beta=0.5, dual_clip=3.0
    ),
}


def _rows(cfg: GRPOConfig) -> TrainingRows:
    """The step's training rows, as grpo_step builds them."""
    rewards = torch.tensor(BATCH.rewards)
    group_index = torch.tensor([s.prompt_index for s in BATCH.samples])
    advantages = step_advantages(BATCH, rewards, group_index, cfg)
    rows = training_rows(init_policy(PolicyConfig(), seed=0), BATCH, advantages, group_index)
    assert rows is not None
    return rows


def _row_width(rows: TrainingRows) -> int:
    """Padded tokens per row of the step (prompt width + completion width): the unit of the budget."""
    return rows.prompt_ids.shape[1] + rows.completion_ids.shape[1]


def _step(cfg: GRPOConfig) -> tuple[dict[str, torch.Tensor], dict[str, float], list[torch.Size]]:
    """One step from the fresh tiny policy; also the input shape of every policy forward pass with gradients."""
    policy, optimizer, reference = _fresh(cfg)
    shapes: list[torch.Size] = []

    def record(_module: torch.nn.Module, _args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():  # the old logprobs' pass is no_grad and holds no activations for backward
            shapes.append(kwargs["input_ids"].shape)

    handle = policy.model.register_forward_pre_hook(record, with_kwargs=True)
    stats = grpo_step(policy, optimizer, BATCH, cfg, reference)
    handle.remove()
    return policy.model.state_dict(), stats, shapes


@pytest.mark.parametrize("rows_per_micro_batch", [5, 0])  # 0: a budget below one row, so one row each
@pytest.mark.parametrize("aggregation", list(AGGREGATIONS))
def test_micro_batches_give_the_unsplit_update_and_stats(aggregation, rows_per_micro_batch):
    cfg = AGGREGATIONS[aggregation]
    width = _row_width(_rows(cfg))
    budget = max(1, rows_per_micro_batch * width)
    expected_state, expected_stats, whole_shapes = _step(cfg)
    state, stats, shapes = _step(cfg.model_copy(update={"micro_batch_tokens": budget}))
    assert [shape[0] for shape in whole_shapes] == [15, 4]
    per = max(1, rows_per_micro_batch)
    assert len(shapes) == math.ceil(15 / per) + math.ceil(4 / per)  # group 0's 12 rows span several micro-batches
    assert all(rows * columns <= max(budget, width) for rows, columns in shapes)
    assert max(rows * columns for rows, columns in shapes) == min(per * width, 15 * width)
    _assert_same_parameters(state, expected_state, ATOL)
    _assert_same_stats(stats, expected_stats)
    assert stats["ref_kl"] > 0 and stats["updates"] == 2.0


def test_a_budget_that_holds_the_minibatch_is_bit_identical_to_none():
    cfg = AGGREGATIONS["seq-mean"]
    expected_state, expected_stats, _ = _step(cfg)
    state, stats, shapes = _step(cfg.model_copy(update={"micro_batch_tokens": 10**9}))
    assert len(shapes) == 2
    assert stats == expected_stats
    assert all(torch.equal(state[name], expected_state[name]) for name in expected_state)


def test_micro_batches_cover_the_selection_in_order_without_overlap():
    rows = _rows(AGGREGATIONS["seq-mean"])
    width = _row_width(rows)
    selected = torch.isin(rows.groups, torch.tensor([0, 1]))
    parts = micro_batches(rows, selected, 4 * width + width - 1)  # room for 4 rows, not 5
    assert [int(part.sum()) for part in parts] == [4, 4, 4, 3]
    assert torch.equal(torch.stack(parts).sum(dim=0), selected.long())  # every selected row exactly once
    assert all(int(part.nonzero().max()) < int(later.nonzero().min()) for part, later in zip(parts, parts[1:]))
    assert micro_batches(rows, selected, None) == [selected]
