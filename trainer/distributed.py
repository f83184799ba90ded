"""Data-parallel GRPO over torch.distributed (gloo on CPU, nccl on GPUs), and its torchrun entry point.

Every rank holds the whole step's batch (token ids and rewards are small), a full replica of the policy and
of its optimizer. The minibatches are grpo_step's (the same contiguous slices of the active groups); inside
each one, every rank takes whole groups (so group advantages stay those of whole groups), computes the loss
on them weighted by its share of the minibatch, and the gradients are summed across ranks: each update is
the single-process update on the whole minibatch, up to float32 summation order.

Launch: `torchrun --nproc_per_node N -m rlvr.trainer.distributed --policy DIR --batch FILE --out DIR`
(see `main`); `run_torchrun` does it from Python and reads the result back.
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rlvr.errors import UserError
from rlvr.trainer.devices import DEFAULT_DEVICE, resolve_device
from rlvr.trainer.generation import Sample
from rlvr.trainer.grpo import (
    STAT_SUMS,
    GRPOConfig,
    RolloutBatch,
    TrainingRows,
    accumulate_gradients,
    minibatch_stats,
    rollout_logprobs,
    step_rows,
    training_precision,
)
from rlvr.trainer.policy import (
    Policy,
    load_optimizer_state,
    make_optimizer,
    optimizer_state_bytes,
    policy_files,
    policy_from_files,
)

OPTIMIZER_FILE = "optimizer.safetensors"  # the name checkpoints.py gives the optimizer state
STATS_FILE = "stats.json"  # written last by rank 0: its presence means the output is complete


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


def _shard(
    policy: Policy, rows: TrainingRows, groups: Tensor, cfg: GRPOConfig, reference: Policy | None
) -> Shard | None:
    """The rows of `groups` on the model's device, and their old (and reference) logprobs: each rank computes
    only its own. The rows keep the whole batch's padding, so each row's input is the single-process one."""
    selected = torch.isin(rows.groups, groups)
    if not bool(selected.any()):
        return None
    device = next(policy.model.parameters()).device
    per_row = {
        field.name: getattr(rows, field.name)[selected].to(device)
        for field in dataclasses.fields(rows)
        # flow.async_level's stored log-probs (and decoupled PPO's weights) need one process
        if field.name not in ("active_groups", "old_logp", "behaviour_weight")
    }
    own = TrainingRows(**per_row, active_groups=groups.to(device))
    old_logp, entropy, ref_logp = rollout_logprobs(policy, own, cfg, reference)  # micro-batched, as the loss
    return Shard(own, old_logp, ref_logp, (entropy * own.mask).sum().to(torch.float64))


def _global_counts(
    shard: Shard | None, plan: list[list[Tensor]], rank: int, device: torch.device, group: dist.ProcessGroup | None
) -> Tensor:
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
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    return counts


def sum_gradients(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Every parameter's gradient becomes the sum over ranks, in one flat all-reduce.

    A parameter keeps no gradient (None) only when no rank gave it one, as in a single process, so that
    AdamW skips it there too (weight decay included); a rank whose shard missed it contributes zeros.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    first = params[0]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    present = torch.tensor([p.grad is not None for p in params], dtype=first.dtype, device=first.device)
    flat = torch.cat([g.reshape(-1).to(first.dtype) for g in grads] + [present])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    chunks = flat.split([p.numel() for p in params] + [len(params)])
    for param, chunk, flag in zip(params, chunks, chunks[-1].tolist()):
        param.grad = chunk.view_as(param).to(param.dtype) if flag > 0 else None


def _minibatch_update(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    shard: Shard | None,
    groups: Tensor,
    totals: Tensor,
    cfg: GRPOConfig,
    max_length: int | None,
    group: dist.ProcessGroup | None,
) -> dict[str, float]:
    """One update on a minibatch: local weighted loss and backward (in micro-batches of at most
    `cfg.micro_batch_tokens` padded tokens), gradients summed, global-norm clip, step.
    `totals` = (sequences, tokens) of the whole minibatch; the stats returned are the whole minibatch's."""
    optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(STAT_SUMS, dtype=torch.float64)
    if shard is not None and groups.numel():
        selected = torch.isin(shard.rows.groups, groups.to(shard.rows.groups.device))
        whole = (float(totals[0]), float(totals[1]))  # this rank's parts are weighted against all ranks' counts
        rows, old_logp, ref_logp = shard.rows, shard.old_logp, shard.ref_logp
        sums = accumulate_gradients(policy, rows, selected, old_logp, ref_logp, cfg, max_length, whole)
    sum_gradients(policy.model, group)
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.model.parameters(), cfg.max_grad_norm)
    optimizer.step()
    reduced = sums.to(totals.device)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
    return {**minibatch_stats(reduced.cpu(), float(totals[1])), "grad_norm": float(grad_norm)}


def distributed_grpo_step(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    cfg: GRPOConfig,
    reference: Policy | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """grpo_step over the ranks of `group` (default: the world): the same updates, and the same stats on every
    rank. Every rank passes the same `batch` (the whole step); each runs the model on its own groups only."""
    stats, rows = step_rows(policy, batch, cfg, reference)
    if rows is None:
        return stats
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    cost = torch.bincount(rows.groups, weights=rows.mask.sum(dim=1).to(torch.float64) + 1)
    plan = shard_plan(rows.active_groups, cost, cfg.minibatches, world_size)
    reference = reference if cfg.kl_beta > 0 else None
    totals = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "ref_kl": 0.0, "grad_norm": 0.0}
    with training_precision(policy, cfg):
        shard = _shard(policy, rows, torch.cat([owned[rank] for owned in plan]), cfg, reference)
        counts = _global_counts(shard, plan, rank, next(policy.model.parameters()).device, group)
        for m, owned in enumerate(plan):
            update = _minibatch_update(
                policy, optimizer, shard, owned[rank], counts[m], cfg, batch.max_new_tokens, group
            )
            for name, value in update.items():
                totals[name] += value
    optimizer.zero_grad(set_to_none=True)
    stats.update({name: value / len(plan) for name, value in totals.items()})
    stats["entropy"] = float(counts[-1, 0]) / max(float(counts[-1, 1]), 1.0)
    stats["updates"] = float(len(plan))
    return stats


# --- payloads, the torchrun entry point, and launching it ------------------------------------------------


def payload_text(batch: RolloutBatch, cfg: GRPOConfig) -> str:
    """The step's batch and config as JSON (nothing pickled: a payload can come from another machine)."""
    return json.dumps({"config": cfg.model_dump(), "batch": dataclasses.asdict(batch)})


def parse_payload(text: str) -> tuple[RolloutBatch, GRPOConfig]:
    """Inverse of `payload_text`."""
    payload = json.loads(text)
    raw = payload["batch"]
    batch = RolloutBatch(**{**raw, "samples": [Sample(**sample) for sample in raw["samples"]]})
    return batch, GRPOConfig.model_validate(payload["config"])


def write_payload(path: Path, batch: RolloutBatch, cfg: GRPOConfig) -> None:
    path.write_text(payload_text(batch, cfg))


def read_payload(path: Path) -> tuple[RolloutBatch, GRPOConfig]:
    """Inverse of `write_payload`."""
    try:
        return parse_payload(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"cannot read the batch payload '{path}': {error}; write it with write_payload") from None


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node N -m rlvr.trainer.distributed",
        description="One data-parallel GRPO step; rank 0 writes the updated model directory and optimizer state.",
    )
    parser.add_argument("--policy", required=True, type=Path, help="Hugging Face model directory to update")
    parser.add_argument("--batch", required=True, type=Path, help="JSON payload from write_payload")
    parser.add_argument("--out", required=True, type=Path, help="directory rank 0 writes (model, optimizer, stats)")
    parser.add_argument("--optimizer", type=Path, help="optimizer state (safetensors) to resume from")
    parser.add_argument("--reference", type=Path, help="reference model directory (needed when kl_beta > 0)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument(
        "--device",
        default=DEFAULT_DEVICE,
        help="the run's policy.device: cpu keeps every rank on the CPU (gloo); otherwise each rank takes the GPU "
        "of its LOCAL_RANK when there are GPUs (nccl), else the CPU",
    )
    return parser.parse_args(argv)


def _write_files(directory: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)


def _write_result(out: Path, policy: Policy, optimizer: torch.optim.Optimizer, stats: dict[str, float]) -> None:
    """Model directory and optimizer state first, stats last (the marker of a complete output)."""
    torch.nn.Module.to(policy.model, "cpu")
    _write_files(out, policy_files(policy))
    (out / OPTIMIZER_FILE).write_bytes(optimizer_state_bytes(optimizer))
    (out / STATS_FILE).write_text(json.dumps(stats))


def _load(directory: Path, threads: int, device: torch.device) -> Policy:
    """The model directory `run_torchrun` wrote, on `device`, in the dtype it was stored in."""
    files = {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}
    return policy_from_files(files, source=str(directory), threads=threads, device=device)


def _train(args: argparse.Namespace, device: torch.device) -> None:
    if dist.get_rank() == 0:
        (args.out / STATS_FILE).unlink(missing_ok=True)  # a stale marker must not pass for this step's output
    batch, cfg = read_payload(args.batch)
    policy = _load(args.policy, args.threads, device)
    reference = _load(args.reference, args.threads, device) if args.reference is not None else None
    optimizer = make_optimizer(policy, cfg.lr, cfg.weight_decay)
    if args.optimizer is not None:
        load_optimizer_state(optimizer, args.optimizer.read_bytes())
    stats = distributed_grpo_step(policy, optimizer, batch, cfg, reference)
    if dist.get_rank() == 0:
        _write_result(args.out, policy, optimizer, stats)


def main(argv: Sequence[str] | None = None) -> int:
    """The torchrun entry: one process group (nccl on GPUs, else gloo), one step, rank 0 writes."""
    args = _arguments(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    use_cuda = resolve_device(args.device).type == "cuda"  # a one-line error for cuda on a machine without
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        _train(args, device)
        dist.barrier()
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


def run_torchrun(
    policy: Policy,
    optimizer: torch.optim.Optimizer | None,
    batch: RolloutBatch,
    cfg: GRPOConfig,
    reference: Policy | None = None,
    *,
    nproc: int,
    threads: int = 1,
    env: dict[str, str] | None = None,
    device: str | None = None,
) -> tuple[dict[str, bytes], bytes, dict[str, float]]:
    """One step with `nproc` torchrun processes on this machine: the updated model files, the optimizer
    state and the step's stats. The inputs go through a temp directory; nothing else is written. `device` is
    the run's policy.device (None: auto), which decides between the CPU and the GPUs for the ranks."""
    with tempfile.TemporaryDirectory(prefix="rlvr-dp-") as tmp:
        work = Path(tmp)
        _write_files(work / "policy", policy_files(policy))
        write_payload(work / "batch.json", batch, cfg)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        command += ["-m", "rlvr.trainer.distributed", "--policy", str(work / "policy"), "--batch"]
        command += [str(work / "batch.json"), "--out", str(work / "out"), "--threads", str(threads)]
        command += ["--device", device or DEFAULT_DEVICE]
        if optimizer is not None:
            (work / OPTIMIZER_FILE).write_bytes(optimizer_state_bytes(optimizer))
            command += ["--optimizer", str(work / OPTIMIZER_FILE)]
        if reference is not None:
            _write_files(work / "reference", policy_files(reference))
            command += ["--reference", str(work / "reference")]
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=work, check=False)
        if done.returncode != 0 or not (work / "out" / STATS_FILE).is_file():
            raise RuntimeError(f"torchrun exited {done.returncode}:\n{done.stderr[-4000:]}")
        out = work / "out"
        files = {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
        stats: dict[str, Any] = json.loads(files.pop(STATS_FILE))
        return files, files.pop(OPTIMIZER_FILE), stats


if __name__ == "__main__":
    sys.exit(main())
