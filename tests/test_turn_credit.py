"""Turn-level credit (`train.grpo.turn_credit="return_to_go"`, trainer/turn_credit.py): the reward still to come
from each turn, its group baseline over every trajectory, the tokens each turn's advantage lands on, and the
update it makes."""

from __future__ import annotations

import statistics

import pytest
import torch

from rlvr.trainer.generation import Sample
from rlvr.trainer.grpo import GRPOConfig, RolloutBatch, grpo_step, step_rows
from rlvr.trainer.policy import PolicyConfig, init_policy, make_optimizer
from rlvr.trainer.turn_credit import token_advantages, turn_returns

# One group of four episodes: A is right on its only turn; B is wrong twice; C is wrong, then right (the
# environment's reward on turn 1); D earns an intermediate 0.25 on turn 0 and nothing more.
SCORES = torch.tensor([1.0, 0.0, 1.0, 0.25])
TURN_REWARDS = [[1.0], [None, None], [None, 1.0], [0.25, None]]
# G[i, t] = score minus the turn rewards before t, 0 after the episode's last turn (worked by hand)
RETURNS = [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.25, 0.0]]


def test_the_return_from_a_turn_is_the_score_less_the_rewards_before_it_and_nothing_after_the_end() -> None:
    assert turn_returns(SCORES, TURN_REWARDS).tolist() == RETURNS
    # a score no turn carries (a verifier's, after the episode) belongs to the last turn
    assert turn_returns(torch.tensor([0.75, 0.5]), [[None, None, None], []]).tolist() == [
        [0.75, 0.75, 0.75],
        [0.5, 0.0, 0.0],
    ]


def test_each_turns_advantage_covers_its_tokens_up_to_the_next_turns_start() -> None:
    per_turn = torch.tensor([[0.5, -1.0, 2.0], [3.0, 0.0, 0.0]])
    tokens = token_advantages(per_turn, [[0, 2, 5], [0]], [6, 3])
    assert tokens.tolist() == [[0.5, 0.5, -1.0, -1.0, -1.0, 2.0], [3.0, 3.0, 3.0, 0.0, 0.0, 0.0]]


def _episode(prompt_index: int, sample_index: int, turn_lengths: list[int], gap: int) -> Sample:
    """A sample of `turn_lengths` sampled turns with `gap` environment tokens after each but the last."""
    ids: list[int] = []
    for t, length in enumerate(turn_lengths):
        ids += [5 + (prompt_index + sample_index + t + k) % 7 for k in range(length)]
        if t < len(turn_lengths) - 1:
            ids += [4] * gap
    return Sample(prompt_index, sample_index, ids, "", len(ids), "stop")


def _batch(turn_lengths: list[list[int]], rewards: list[float], turn_rewards: list[list[float | None]]) -> RolloutBatch:
    gap = 2
    samples = [_episode(k // 4, k % 4, lengths, gap) for k, lengths in enumerate(turn_lengths)]
    starts, masks = [], []
    for lengths in turn_lengths:
        begin, mask, turn_starts = 0, [], []
        for t, length in enumerate(lengths):
            turn_starts.append(begin)
            mask += [1] * length + ([0] * gap if t < len(lengths) - 1 else [])
            begin += length + gap
        starts.append(turn_starts)
        masks.append(mask)
    return RolloutBatch(
        prompts=[f"{g}+{g}=" for g in range(len(samples) // 4)],
        samples=samples,
        rewards=rewards,
        prompt_token_ids=[[3, 6, 7] for _ in samples],
        loss_masks=masks,
        turn_starts=starts,
        turn_rewards=turn_rewards,
    )


def test_the_loss_sees_each_turns_advantage_against_the_whole_groups_baseline() -> None:
    policy = init_policy(PolicyConfig(), seed=0)
    batch = _batch([[2], [2, 3], [1, 2], [3, 1]], SCORES.tolist(), TURN_REWARDS)
    cfg = GRPOConfig(turn_credit="return_to_go", advantage_scale="none")
    _, rows = step_rows(policy, batch, cfg, None)
    assert rows is not None
    means = [statistics.fmean(r[t] for r in RETURNS) for t in range(2)]  # 0.5625, 0.25: every episode counts
    for k, sample in enumerate(batch.samples):
        starts = batch.turn_starts[k]  # type: ignore[index]
        expected = [0.0] * sample.n_tokens
        for t, start in enumerate(starts):
            end = starts[t + 1] if t + 1 < len(starts) else sample.n_tokens
            expected[start:end] = [RETURNS[k][t] - means[t]] * (end - start)
        assert rows.advantages[k, : sample.n_tokens].tolist() == pytest.approx(expected, abs=1e-7)
    # turn 0 is the trajectory's own advantage; C's right second answer is credited against turn 1's lower baseline
    assert float(rows.advantages[2, 0]) == pytest.approx(1.0 - 0.5625)
    assert float(rows.advantages[2, batch.turn_starts[2][1]]) == pytest.approx(1.0 - 0.25)  # type: ignore[index]


def test_with_no_turn_rewards_and_equal_turn_counts_the_update_is_the_trajectory_ones_exactly() -> None:
    lengths = [[2, 3], [1, 2], [3, 1], [2, 2], [1, 1], [2, 3], [3, 2], [1, 3]]
    batch = _batch(lengths, [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0], [[None, None]] * 8)
    weights = []
    for credit in ("trajectory", "return_to_go"):
        policy = init_policy(PolicyConfig(), seed=0)
        optimizer = make_optimizer(policy, lr=1e-2, weight_decay=0.0)
        stats = grpo_step(policy, optimizer, batch, GRPOConfig(turn_credit=credit, minibatches=2))
        assert stats["updates"] == 2.0
        weights.append([p.detach().clone() for p in policy.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))
    # and a turn reward changes it
    batch.turn_rewards = [[0.5, None], *[[None, None]] * 7]
    policy = init_policy(PolicyConfig(), seed=0)
    grpo_step(policy, make_optimizer(policy, lr=1e-2, weight_decay=0.0), batch, GRPOConfig(turn_credit="return_to_go"))
    assert not all(torch.equal(a, b) for a, b in zip(weights[0], policy.model.parameters()))


def test_turn_credit_is_refused_beside_gdpo_and_seed_grpo_and_left_out_of_dumps_at_its_default() -> None:
    with pytest.raises(ValueError, match="turn_credit=return_to_go works on the reward alone"):
        GRPOConfig(turn_credit="return_to_go", advantage_components={"correct": 1.0})
    with pytest.raises(ValueError, match="turn_credit=return_to_go works on the reward alone"):
        GRPOConfig(turn_credit="return_to_go", semantic_entropy=1.0)
    assert "turn_credit" not in GRPOConfig().model_dump()
    assert GRPOConfig(turn_credit="return_to_go").model_dump()["turn_credit"] == "return_to_go"


def test_an_assistant_turns_reward_is_the_reply_to_it_on_the_next_turn_or_its_own_when_it_ended() -> None:
    from rlvr.tasks.rollout import assistant_turn_rewards
    from rlvr.trainer.episodes import Turn

    def turn(k: int, role: str, reward: float | None) -> Turn:
        return Turn(k, role, k, k + 1, "", (), reward, 0.0)

    # an intermediate reward on the tool turn answering assistant turn 0, the final one on the last assistant turn
    played = [turn(0, "assistant", None), turn(1, "tool", 0.25), turn(2, "assistant", None), turn(3, "user", None)]
    assert assistant_turn_rewards([*played, turn(4, "assistant", 1.0)]) == [0.25, None, 1.0]
    assert assistant_turn_rewards([turn(0, "assistant", None)]) == [None]
