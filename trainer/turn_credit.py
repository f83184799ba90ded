"""Turn-level credit for an environment's episodes: `train.grpo.turn_credit="return_to_go"` (docs/training.md,
"Turn credit").

The default ("trajectory") gives every sampled token of an episode its group advantage. With return_to_go, the
tokens of assistant turn t of trajectory i get

    A[i, t] = (G[i, t] - mean_g G[., t]) / scale_g(G[., t])

where G[i, t] is the reward still to come from turn t on: the score minus the turn rewards the episode got
before turn t (the part of the score no turn carries, e.g. a verifier's after the episode, counts as the last
turn's), and 0 from the turn after its last on, since an episode that has ended gets nothing more. Every
trajectory of the group counts in every turn's baseline, so the baseline has the same terms whatever turn this
trajectory stopped at: it does not depend on the trajectory's own actions, and the estimate stays unbiased (up to
the 1/G share of its own return in the mean, as in GRPO itself). Normalising per turn index over only the
trajectories that reached it, and summing those per-turn advantages, makes the number of baseline terms the
trajectory's own turn count: an action-dependent baseline that biases the gradient toward longer or shorter
episodes (verl RFC 7244). Turn 0's advantages are always the trajectory advantages; with no intermediate rewards
and every episode as long as the others, so are every turn's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def turn_returns(scores: Tensor, turn_rewards: Sequence[Sequence[float | None]]) -> Tensor:
    """[N, T] G[i, t]: scores[i] minus trajectory i's turn rewards before turn t (None counts 0) for its turns
    (len(turn_rewards[i]) of them, at least 1), 0 after them; T is the most turns of any trajectory."""
    n_turns = max((max(len(rewards), 1) for rewards in turn_rewards), default=1)
    returns = torch.zeros((len(turn_rewards), n_turns), dtype=torch.float64)
    for i, rewards in enumerate(turn_rewards):
        remaining = float(scores[i])
        for t in range(max(len(rewards), 1)):
            returns[i, t] = remaining
            remaining -= (rewards[t] if t < len(rewards) else None) or 0.0
    return returns


def token_advantages(per_turn: Tensor, turn_starts: Sequence[Sequence[int]], n_tokens: Sequence[int]) -> Tensor:
    """[N, L] each completion token's advantage: turn t's from its start to the next turn's start (the environment's
    tokens between are masked out of the loss anyway), the last turn's to the end; L = max(n_tokens), 0-padded."""
    width = max(n_tokens, default=0)
    out = torch.zeros((len(n_tokens), width), dtype=per_turn.dtype)
    for i, starts in enumerate(turn_starts):
        bounds = [*starts[1:], n_tokens[i]]
        for t, (start, end) in enumerate(zip(starts, bounds)):
            out[i, start:end] = per_turn[i, t]
    return out
