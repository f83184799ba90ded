"""Data-parallel GRPO over torch.distributed (gloo on CPU, nccl on GPUs) with the model wrapped by FSDP2
(trainer/sharding.py: `fsdp` shards it, `replicate` keeps a whole copy per rank; gradients are reduced by
FSDP2 either way).

Every rank holds the whole step's batch (token ids and rewards are small). The minibatches are grpo_step's
(the same contiguous slices of the active groups); inside each one, every rank takes whole groups (so group
advantages stay those of whole groups) and computes the loss on them weighted by its share of the
minibatch; FSDP2 sums the gradients over the ranks, so each update is the single-process update on the whole
minibatch, up to float32 summation order.

A forward through a sharded unit gathers its weights from every rank, so every pass (old log-probs, the
reference's, each micro-batch of the loss) runs the same number of times on every rank: a rank with fewer
micro-batches (or none) runs zero-weight passes on a one-token row (`_aligned`, `idle_pass`).
"""

from __future__ import annotations

import dataclasses
import json
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from rlvr.trainer.generation import Sample
from rlvr.trainer.grpo import (
    STAT_SUMS,
    GRPOConfig,
    RolloutBatch,
    TrainingRows,
    loss_share,
    micro_batch_budget,
    micro_batches,
    minibatch_loss,
    minibatch_stats,
    step_rows,
    training_precision,
)
from rlvr.trainer.logprobs import completion_logprobs, completion_logprobs_and_entropy
from rlvr.trainer.policy import Policy
from rlvr.trainer.sharding import accumulating, is_sharded


def shard_plan(active_groups: Tensor, group_cost: Tensor, minibatches: int, world_size: int) -> list[list[Tensor]]:
    """For each minibatch, the groups of each rank: plan[m][rank].

    The minibatches are grpo_step's contiguous slices of the active groups, so the updates are the same
    ones. Inside a minibatch, groups go longest first to the least-loaded rank (`group_cost`, indexed by
    group id), so that ranks finish their backward at about the same time; ties go to the lower rank and
    the lower group id, so every rank computes the same plan from the same batch.
    """
    plan = []
    for groups in torch.tensor_split(active_groups, min(minibatches, active_groups.numel())):
        loads = [0.0] * world_size
        owned: list[list[int]] = [[] for _ in range(world_size)]
        for group in sorted(groups.tolist(), key=lambda g: (-float(group_cost[g]), g)):
            rank = min(range(world_size), key=lambda r: (loads[r], r))
            owned[rank].append(group)
            loads[rank] += float(group_cost[group])
        plan.append([torch.tensor(sorted(groups_of_rank), dtype=torch.long) for groups_of_rank in owned])
    return plan


@dataclass
class Shard:
    """One rank's rows (those of its groups, over every minibatch) and their logprobs before any update."""

    rows: TrainingRows
    old_logp: Tensor
    ref_logp: Tensor | None
    entropy_sum: Tensor  # Σ over the shard's real tokens of π_old's entropy (for the step's mean entropy)


def _aligned(parts: list[Tensor], device: torch.device) -> list[Tensor | None]:
    """`parts` padded with None to the largest count of any rank: every rank then runs as many passes."""
    count = torch.tensor([len(parts)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return [*parts, *[None] * (int(count.item()) - len(parts))]


def idle_pass(model: torch.nn.Module, pad_id: int, device: torch.device) -> Tensor:
    """A forward on one one-token row that gathers every unit as a real pass does; its zero sum is a loss whose
    backward reduces (zero) gradients as a real one does."""
    token = torch.full((1, 1), pad_id, dtype=torch.long, device=device)
    mask = torch.ones((1, 1), dtype=torch.float32, device=device)
    logp = completion_logprobs(model, token, token, pad_id, mask, 1.0, False)[0]
    return logp.sum() * 0.0


def _own_rows(policy: Policy, rows: TrainingRows, groups: Tensor) -> TrainingRows | None:
    """The rows of `groups` (None when there is none). They keep the whole batch's padding, so each row's
    input is the single-process one."""
    selected = torch.isin(rows.groups, groups.to(rows.groups.device))
    if not bool(selected.any()):
        return None
    per_row = {
        field.name: getattr(rows, field.name)[selected]
        for field in dataclasses.fields(rows)
        # flow.async_level's stored log-probs (and decoupled PPO's weights) need one process
        if field.name not in ("active_groups", "old_logp", "behaviour_weight")
    }
    return TrainingRows(**per_row, active_groups=groups.to(rows.groups.device))


def _no_grad_logprobs(
    policy: Policy, model: torch.nn.Module, rows: TrainingRows | None, cfg: GRPOConfig, with_entropy: bool
) -> tuple[Tensor | None, Tensor | None]:
    """`model`'s log-probs [r, T] (and entropy with `with_entropy`) on `rows`, micro-batched and aligned across
    ranks; (None, None) when this rank has no rows (it still runs its share of passes)."""
    pad_id = policy.tokenizer.pad_token_id
    device = next(policy.model.parameters()).device
    parts: list[Tensor] = []
    logp = entropy = None
    if rows is not None:
        everything = torch.ones(rows.mask.shape[0], dtype=torch.bool, device=rows.mask.device)
        parts = micro_batches(rows, everything, micro_batch_budget(policy.model, cfg))
        logp = torch.zeros(rows.mask.shape, dtype=torch.float32, device=rows.mask.device)
        entropy = torch.zeros_like(logp)
    with torch.no_grad():
        for part in _aligned(parts, device):
            if part is None:
                idle_pass(model, pad_id, device)
                continue
            assert rows is not None and logp is not None and entropy is not None
            prompt_ids, completion_ids = rows.prompt_ids[part], rows.completion_ids[part]
            if with_entropy:
                logp[part], entropy[part] = completion_logprobs_and_entropy(
                    model, prompt_ids, completion_ids, pad_id, cfg.temperature, cfg.fused_head, cfg.fp32_head
                )
            else:
                mask = rows.mask[part].to(torch.float32)
                logp[part] = completion_logprobs(
                    model, prompt_ids, completion_ids, pad_id, mask, cfg.temperature, cfg.fused_head, cfg.fp32_head
                )[0]
    return logp, entropy


def _shard(
    policy: Policy, rows: TrainingRows, groups: Tensor, cfg: GRPOConfig, reference: Policy | None
) -> Shard | None:
    """This rank's rows and their old (and reference) log-probs; every rank runs the passes together."""
    own = _own_rows(policy, rows, groups)
    old_logp, entropy = _no_grad_logprobs(policy, policy.model, own, cfg, with_entropy=True)
    ref_logp = None
    if reference is not None:
        ref_logp = _no_grad_logprobs(policy, reference.model, own, cfg, with_entropy=False)[0]
    if own is None:
        return None
    assert old_logp is not None and entropy is not None
    return Shard(own, old_logp, ref_logp, (entropy * own.mask).sum().to(torch.float64))


def _global_counts(shard: Shard | None, plan: list[list[Tensor]], rank: int, device: torch.device) -> Tensor:
    """[minibatches + 1, 2], summed over ranks: sequences and completion tokens of each minibatch, then
    (Σ π_old entropy, tokens) of the whole step."""
    counts = torch.zeros(len(plan) + 1, 2, dtype=torch.float64, device=device)
    if shard is not None:
        for m, owned in enumerate(plan):
            selected = torch.isin(shard.rows.groups, owned[rank].to(device))
            counts[m, 0] = selected.sum()
            counts[m, 1] = shard.rows.mask[selected].sum()
        counts[-1, 0] = shard.entropy_sum
        counts[-1, 1] = shard.rows.mask.sum()
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return counts


def _accumulate(
    policy: Policy,
    shard: Shard | None,
    groups: Tensor,
    whole: tuple[float, float],
    cfg: GRPOConfig,
    max_length: int | None,
) -> Tensor:
    """Backward of this rank's share of a minibatch's loss, micro-batch by micro-batch, the same number of
    backward passes on every rank; gradients are reduced over the ranks by the last one only. Returns the
    float64 `STAT_SUMS` of this rank's parts."""
    model = policy.model
    device = next(model.parameters()).device
    sums = torch.zeros(STAT_SUMS, dtype=torch.float64)
    parts: list[Tensor] = []
    if shard is not None and groups.numel():
        selected = torch.isin(shard.rows.groups, groups.to(shard.rows.groups.device))
        if bool(selected.any()):
            parts = micro_batches(shard.rows, selected, micro_batch_budget(model, cfg))
    aligned = _aligned(parts, device)
    for index, part in enumerate(aligned):
        last = index == len(aligned) - 1
        with nullcontext() if last else accumulating(model):
            if part is None:
                idle_pass(model, policy.tokenizer.pad_token_id, device).backward()
                continue
            assert shard is not None
            loss, kl_term, stats = minibatch_loss(
                policy, shard.rows, part, shard.old_logp, shard.ref_logp, cfg, max_length
            )
            share = loss_share(shard.rows.mask[part], whole[0], whole[1], cfg.aggregation)
            (loss * share).backward()
            tokens = float(shard.rows.mask[part].sum())
            sums += torch.tensor(
                [
                    float(loss.detach()) * share,
                    0.0 if kl_term is None else float(kl_term.detach()) * share,
                    stats["clip_fraction"] * tokens,
                    stats["approx_kl"] * tokens,
                    0.0,
                ],
                dtype=torch.float64,
            )
    return sums


def _minibatch_update(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    shard: Shard | None,
    groups: Tensor,
    totals: Tensor,
    cfg: GRPOConfig,
    max_length: int | None,
) -> dict[str, float]:
    """One update on a minibatch: this rank's weighted loss and backward, gradients summed by FSDP2,
    global-norm clip, step. `totals` = (sequences, tokens) of the whole minibatch; the stats returned are the
    whole minibatch's."""
    optimizer.zero_grad(set_to_none=True)
    whole = (float(totals[0]), float(totals[1]))  # this rank's parts are weighted against all ranks' counts
    sums = _accumulate(policy, shard, groups, whole, cfg, max_length)
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.model.parameters(), cfg.max_grad_norm)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    reduced = sums.to(totals.device)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return {**minibatch_stats(reduced.cpu(), float(totals[1])), "grad_norm": float(grad_norm)}


def distributed_grpo_step(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    cfg: GRPOConfig,
    reference: Policy | None = None,
) -> dict[str, float]:
    """grpo_step over every rank of the default process group: the same updates, and the same stats on every
    rank. Every rank passes the same `batch` (the whole step) and its part of the sharded policy (and
    reference); each runs the model on its own groups only."""
    if not is_sharded(policy.model):
        raise ValueError("distributed_grpo_step needs the policy sharded over the ranks (trainer/sharding.py)")
    stats, rows = step_rows(policy, batch, cfg, reference)
    if rows is None:
        return stats
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cost = torch.bincount(rows.groups.cpu(), weights=rows.mask.sum(dim=1).cpu().to(torch.float64) + 1)
    plan = shard_plan(rows.active_groups.cpu(), cost, cfg.minibatches, world_size)
    reference = reference if cfg.kl_beta > 0 else None
    totals = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "ref_kl": 0.0, "grad_norm": 0.0}
    with training_precision(policy, cfg):
        shard = _shard(policy, rows, torch.cat([owned[rank] for owned in plan]), cfg, reference)
        counts = _global_counts(shard, plan, rank, next(policy.model.parameters()).device)
        for m, owned in enumerate(plan):
            update = _minibatch_update(policy, optimizer, shard, owned[rank], counts[m], cfg, batch.token_sum_length)
            for name, value in update.items():
                totals[name] += value
    optimizer.zero_grad(set_to_none=True)
    stats.update({name: value / len(plan) for name, value in totals.items()})
    stats["entropy"] = float(counts[-1, 0]) / max(float(counts[-1, 1]), 1.0)
    stats["updates"] = float(len(plan))
    return stats


# --- the batch as JSON, as rank 0 sends it to the others ------------------------------------------------


def payload_text(batch: RolloutBatch, cfg: GRPOConfig) -> str:
    """The step's batch and config as JSON (nothing pickled: a payload can come from another machine)."""
    return json.dumps({"config": cfg.model_dump(), "batch": dataclasses.asdict(batch)})


def parse_payload(text: str) -> tuple[RolloutBatch, GRPOConfig]:
    """Inverse of `payload_text`."""
    payload = json.loads(text)
    raw = payload["batch"]
    batch = RolloutBatch(**{**raw, "samples": [Sample(**sample) for sample in raw["samples"]]})
    return batch, GRPOConfig.model_validate(payload["config"])
