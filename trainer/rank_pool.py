"""Data-parallel ranks that live for the whole run (`train.data_parallel` = N > 1).

The run's process is rank 0. Its first data-parallel update starts ranks 1..N-1 (`python -m
rlvr.trainer.rank_pool`), which stay until the process ends. For each update rank 0 sends the step's
batch and GRPO config (JSON) and every rank runs `distributed_grpo_step` on its own replica: the summed
gradients and the same optimizer step keep the replicas equal to the run's live policy and optimizer, so
nothing else crosses. The whole state is sent again only when the live objects change (the first update,
a resumed run, a policy rebuilt by replay) and the KL reference once. Before, every step launched
torchrun and serialised the model and optimizer through files both ways (`run_torchrun`, still there for
one-off steps); benchmarks/data_parallel_step.py measures the two.

Messages are broadcasts from rank 0 (gloo on the CPU, nccl on GPUs): a JSON header, then the bytes it
announces. A worker exits when rank 0 says stop, when a collective fails (rank 0 died), or when rank 0's
process is gone (`exit_when_gone`), so no rank outlives the run.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import socket
import subprocess
import sys
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlvr.child_guard import exit_when_gone, start_time
from rlvr.trainer.distributed import distributed_grpo_step, parse_payload, payload_text
from rlvr.trainer.grpo import GRPOConfig, RolloutBatch
from rlvr.trainer.policy import (
    Policy,
    load_optimizer_state,
    make_optimizer,
    optimizer_state_bytes,
    policy_files,
    policy_from_files,
)

TIMEOUT = timedelta(minutes=30)  # a collective waits this long for a rank (a long generation between updates)


def pack_files(files: dict[str, bytes]) -> bytes:
    """A model directory (name -> bytes) as one byte string: a JSON index, then the files in its order."""
    index = json.dumps([[name, len(data)] for name, data in files.items()]).encode()
    return len(index).to_bytes(8, "little") + index + b"".join(files.values())


def unpack_files(packed: bytes) -> dict[str, bytes]:
    """Inverse of `pack_files`."""
    size = int.from_bytes(packed[:8], "little")
    files, offset = {}, 8 + size
    for name, length in json.loads(packed[8 : 8 + size]):
        files[name] = packed[offset : offset + length]
        offset += length
    return files


def broadcast_bytes(data: bytes | None, device: torch.device) -> bytes:
    """Rank 0 sends `data`; every rank returns it (the others pass None)."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if data is not None:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=0)
    return data if data is not None else buffer.cpu().numpy().tobytes()


class RankPool:
    """Rank 0's side: the worker processes, the process group, and which live objects the replicas hold."""

    def __init__(self, nproc: int, device: torch.device, threads: int = 1) -> None:
        self.nproc, self.device = nproc, device
        port = _free_port()
        init = f"tcp://127.0.0.1:{port}"
        me = [str(os.getpid()), str(start_time(os.getpid()) or 0)]
        self.workers = [
            subprocess.Popen(
                [sys.executable, "-m", "rlvr.trainer.rank_pool", init, str(rank), str(nproc), str(threads)]
                + [device.type, *me]
            )
            for rank in range(1, nproc)
        ]
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init, rank=0, world_size=nproc, timeout=TIMEOUT)
        self._state: tuple[weakref.ref[Any], weakref.ref[Any]] | None = None
        self._reference: weakref.ref[Any] | None = None
        self.state_syncs = 0  # how often the whole state was sent (tests and the benchmark read it)

    def _send(self, header: dict[str, Any], *blobs: bytes) -> None:
        self._check_workers()
        broadcast_bytes(json.dumps(header).encode(), self.device)
        for blob in blobs:
            broadcast_bytes(blob, self.device)

    def _check_workers(self) -> None:
        for worker in self.workers:
            if worker.poll() is not None:
                raise RuntimeError(f"data-parallel rank process {worker.pid} exited with {worker.returncode}")

    def _holds(self, policy: Policy, optimizer: torch.optim.Optimizer) -> bool:
        return self._state is not None and self._state[0]() is policy.model and self._state[1]() is optimizer

    def update(
        self,
        policy: Policy,
        optimizer: torch.optim.Optimizer,
        batch: RolloutBatch,
        cfg: GRPOConfig,
        reference: Policy | None,
    ) -> dict[str, float]:
        """One data-parallel GRPO step on every rank; `policy` and `optimizer` (rank 0's) are updated in place."""
        if not self._holds(policy, optimizer):
            group = optimizer.param_groups[0]
            header = {"op": "state", "lr": group["lr"], "weight_decay": group["weight_decay"]}
            self._send(header, pack_files(policy_files(policy)), optimizer_state_bytes(optimizer))
            self.state_syncs += 1
        use_reference = reference is not None and cfg.kl_beta > 0
        if use_reference and (self._reference is None or self._reference() is not reference.model):  # type: ignore[union-attr]
            self._send({"op": "reference"}, pack_files(policy_files(reference)))  # type: ignore[arg-type]
            self._reference = weakref.ref(reference.model)  # type: ignore[union-attr]
        self._send({"op": "step", "reference": use_reference}, payload_text(batch, cfg).encode())
        stats = distributed_grpo_step(policy, optimizer, batch, cfg, reference if use_reference else None)
        self._state = (weakref.ref(policy.model), weakref.ref(optimizer))
        return stats

    def close(self) -> None:
        """Stop the workers and leave the process group."""
        try:
            if all(worker.poll() is None for worker in self.workers):
                self._send({"op": "stop"})
        finally:
            dist.destroy_process_group()
            for worker in self.workers:
                try:
                    worker.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    worker.kill()


_pool: RankPool | None = None


def pooled_update(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    cfg: GRPOConfig,
    reference: Policy | None,
    nproc: int,
) -> dict[str, float]:
    """The update on this process's pool of `nproc` ranks on the policy's device, started on first use (and
    started anew when the rank count or device changes)."""
    global _pool
    device = next(policy.model.parameters()).device
    if _pool is not None and (_pool.nproc != nproc or _pool.device != device):
        close_pool()
    if _pool is None:
        _pool = RankPool(nproc, device)
    return _pool.update(policy, optimizer, batch, cfg, reference)


def current_pool() -> RankPool | None:
    return _pool


@atexit.register
def close_pool() -> None:
    """Stop this process's ranks (at exit, or before a pool of another shape starts)."""
    global _pool
    pool, _pool = _pool, None
    if pool is not None:
        pool.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- a worker rank ------------------------------------------------------------------------------------------


def serve(init: str, rank: int, world_size: int, device: torch.device, threads: int) -> None:
    """Hold a replica and run every update rank 0 announces, until it says stop."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world_size, timeout=TIMEOUT)
    policy: Policy | None = None
    optimizer: torch.optim.Optimizer | None = None
    reference: Policy | None = None
    try:
        while (header := json.loads(broadcast_bytes(None, device)))["op"] != "stop":
            if header["op"] == "state":
                policy = policy_from_files(unpack_files(broadcast_bytes(None, device)), threads=threads, device=device)
                optimizer = make_optimizer(policy, header["lr"], header["weight_decay"])
                load_optimizer_state(optimizer, broadcast_bytes(None, device))
            elif header["op"] == "reference":
                reference = policy_from_files(
                    unpack_files(broadcast_bytes(None, device)), threads=threads, device=device
                )
                reference.model.requires_grad_(False)
            elif header["op"] == "step":
                batch, cfg = parse_payload(broadcast_bytes(None, device).decode())
                assert policy is not None and optimizer is not None, "rank 0 sends the state before a step"
                distributed_grpo_step(policy, optimizer, batch, cfg, reference if header["reference"] else None)
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlvr.trainer.rank_pool", description="one data-parallel rank")
    for name in ("init", "rank", "world_size", "threads", "device", "parent_pid", "parent_start"):
        parser.add_argument(name)
    args = parser.parse_args(argv)
    exit_when_gone(int(args.parent_pid), int(args.parent_start) or None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rank = int(args.rank)
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    serve(args.init, rank, int(args.world_size), device, int(args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
