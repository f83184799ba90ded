"""Each data-parallel rank's share of supervised steps (trainer/sft.py `sft_steps` on a sharded policy: the warm start
of a run with ranks), so that no process holds the whole model while it trains.

Every rank draws the same batches (`sft_batches`, seeded on the CPU) and takes a contiguous run of about equal
numbers of each batch's sequences, keeping the whole batch's padding so that each row's input is the one-process one.
FSDP2 sums the gradients over the ranks, so each rank divides its summed log-likelihood by the whole batch's token
count: the sum is then the one-process gradient. A rank without sequences (a batch smaller than the group) runs an
idle pass, so that every rank gathers the same units.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlvr.trainer.distributed import idle_pass
from rlvr.trainer.policy import Policy, make_optimizer
from rlvr.trainer.ranks.operations import RankState
from rlvr.trainer.sft import SftBatch, SftSequence, sft_batches, summed_nll
from rlvr.trainer.sharding import resharded


def sft_share(state: RankState, request: dict[str, Any], optimizer: torch.optim.Optimizer | None = None) -> list[float]:
    """Every rank: the SFT steps `request` describes (sequences, steps, batch_size, seed; lr and weight_decay of the
    AdamW the rank makes over its shards when not given one, dropped after). Every rank returns every step's loss
    over the whole batch."""
    assert state.policy is not None
    policy = state.policy
    if optimizer is None:
        optimizer = make_optimizer(policy, request["lr"], request["weight_decay"])
    sequences = [SftSequence(**raw) for raw in request["sequences"]]
    settings = {name: int(request[name]) for name in ("steps", "batch_size", "seed")}
    batches = sft_batches(sequences, pad_id=policy.tokenizer.pad_token_id, **settings)
    with resharded(policy.model):  # each forward and backward gathers one unit at a time
        losses = [sft_step_share(policy, optimizer, batch, state.device) for batch in batches]
    optimizer.zero_grad(set_to_none=True)
    return losses


def sft_step_share(policy: Policy, optimizer: torch.optim.Optimizer, batch: SftBatch, device: torch.device) -> float:
    """One update from this rank's share of `batch`; the loss of the whole batch (the ranks' sums added)."""
    rows = torch.tensor_split(torch.arange(batch.mask.shape[0]), dist.get_world_size())[dist.get_rank()]
    tokens = float(batch.mask.sum())  # the whole batch's: what one process divides by
    optimizer.zero_grad(set_to_none=True)
    if rows.numel():
        summed = summed_nll(policy, batch, rows)
    else:
        summed = idle_pass(policy.model, policy.tokenizer.pad_token_id, device)
    (summed / tokens).backward()
    optimizer.step()
    total = summed.detach().reshape(1).clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return float(total.item()) / tokens
