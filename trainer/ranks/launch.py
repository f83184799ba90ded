"""The data-parallel ranks of a run (`train.data_parallel` = N > 1): one torch.distributed process group whose
ranks each hold their part of the policy (FSDP2, trainer/sharding.py) and do their share of every model pass.
This module starts the group and drives it from rank 0 (`RankGroup`, `rank_group`); what travels between the ranks
is in transport.py, what each rank does for an operation in operations.py (and trainer/distributed.py for a step),
the sharded state on disk in state.py, and the loop of the other ranks in serve.py.

The run's process is rank 0 and drives the group: for every operation it broadcasts a JSON header (and the
bytes it announces), then does its own share like any rank. Operations:

- `adopt`: a policy (and optimizer state) rank 0 holds whole becomes the group's: every rank builds the model
  without weights (meta device), shards it, and takes its shards of rank 0's weights (torch's
  `set_model_state_dict(broadcast_from_rank0=True)`); the policy's `ranks` then names the group.
- `update`: one GRPO step (trainer/distributed.py).
- `sft`: supervised steps (the warm start), each rank training on its share of every batch (sft.py).
- `sample`, `greedy`, `episodes`: each rank decodes its share of the prompts (under fsdp in lockstep rounds, one unit
  gathered at a time: operations.py `decoding`), with row-seeded sampling, so the tokens do not depend on the rank
  count; rank 0 gathers.
- `whole_files`: the whole model as a Hugging Face directory, on rank 0.
- `save_state`, `load_state`: the sharded weights and optimizer state with torch.distributed.checkpoint.

Where the ranks come from. Alone, the run starts ranks 1..N-1 itself, forked from a warm interpreter that imported
what a rank needs once (zygote.py; `python -m rlvr.trainer.ranks.launch` starts one rank as a fresh process), and
they live until it ends and exit within a second of its death. Under torchrun (RANK and WORLD_SIZE set,
any number of machines), torchrun started every rank: rank 0 runs the flow and the others serve
(`serve_torchrun`). A rank that dies ends the run: rank 0's watchdog names it on one line and stops the run,
then ends the process if a collective keeps it waiting.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlvr.child_guard import exit_when_gone, start_time
from rlvr.errors import Stopped, UserError, stop_with
from rlvr.startup_objects import freeze_startup_objects
from rlvr.trainer.distributed import distributed_grpo_step, payload_text
from rlvr.trainer.episodes import Trajectory
from rlvr.trainer.generation import Sample
from rlvr.trainer.grpo import GRPOConfig, RolloutBatch
from rlvr.trainer.policy import Policy, policy_files, static_files
from rlvr.trainer.ranks.operations import (
    RankState,
    build_sharded,
    episodes_share,
    greedy_share,
    plain_policy,
    rlpr_share,
    sample_share,
)
from rlvr.trainer.ranks.serve import serve
from rlvr.trainer.ranks.sft import sft_share
from rlvr.trainer.ranks.state import adopt_share, load_share, reference_share, save_share, write_weights_share
from rlvr.trainer.ranks.transport import broadcast_bytes, gather_bytes, pack_files
from rlvr.trainer.ranks.zygote import RankProcess, start_rank
from rlvr.trainer.rlpr import ReferenceProbability
from rlvr.trainer.sft import SftSequence
from rlvr.trainer.sharding import DecodeWeights, Sharding, full_state, held_bytes, plain_optimizer_state
from rlvr.verifiers.rlpr import ReferenceText

TIMEOUT = timedelta(minutes=30)  # a collective waits this long for a rank (rank 0 verifying a large step)
WATCH_S = 0.5  # how often rank 0 looks at the ranks it started
DEATH_WAIT_S = 10.0  # after a collective failed: how long a dying rank may take to be seen dead (a loaded machine)
EXIT_GRACE_S = 15.0  # after a rank died: how long the run may take to stop before its process is ended


# --- memory ---------------------------------------------------------------------------------------------------

MMAP_THRESHOLD = 1 << 20  # bytes: glibc maps allocations this large on their own and unmaps them when freed


def return_freed_memory() -> None:
    """On a CPU rank or a run's process (Linux, glibc): tensors of MMAP_THRESHOLD bytes and more get pages of their
    own, given back to the system when freed. By default glibc raises that threshold after each large free, up to
    32 MiB, and serves later large tensors from its heap, which it rarely returns: a rank's resident memory then
    keeps the high-water mark of every step's transient buffers (about 1 GB more per rank at SmolLM2-135M:
    docs/benchmarks.md), the memory sharding is meant to save, and a single-process SmolLM2 RLPR run held 12.8 GB
    (with a 4 MiB threshold: peaks of 9.8-10.3 GB, under 5.5 GB half the time; docs/rewards.md). At 4 MiB most of
    SmolLM2's per-layer tensors (1.3-3.5 MB) still came from the heap; 1 MiB took a further 240 MB (11%) off a
    two-rank fsdp update's peak and 190 MB off replicate's (docs/benchmarks.md). Elsewhere (no glibc) nothing
    changes."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_mmap_threshold = -3  # glibc's M_MMAP_THRESHOLD; setting it also stops the threshold's growth
    libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD)


# --- rank 0: the group ---------------------------------------------------------------------------------------


class RankLost(Stopped):
    """A data-parallel rank died: the run stops, as on SIGTERM (its committed work is intact, the message says
    which rank and how, and the run's stop line says how to resume)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 128 + signal.SIGTERM)


class RankGroup:
    """Rank 0's side: the process group, the ranks it started (none under torchrun), and its own RankState."""

    def __init__(self, world_size: int, sharding: Sharding, device: torch.device, threads: int = 1) -> None:
        self.world_size, self.device = world_size, device
        self.state = RankState(device, sharding, threads)
        self.workers: list[RankProcess] = []
        self.lost: str | None = None
        self.broken = False  # an operation failed part way: the ranks are out of step
        self.closing = False  # the ranks are being stopped: their exits are expected
        self.reference_id: str | None = None  # the checkpoint the group's KL reference was read from
        self.current: str | None = None  # the operation the ranks are in (named when one of them dies)
        self._losing = threading.Lock()
        self._in_op = threading.local()
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cpu":
            return_freed_memory()
        if torchrun_rank() is not None:
            launched = int(os.environ["WORLD_SIZE"])
            if launched != world_size:
                raise UserError(
                    f"train.data_parallel is {world_size} but torchrun started {launched} ranks; "
                    "set train.data_parallel to torchrun's total (--nnodes x --nproc-per-node)"
                )
            dist.init_process_group(backend, timeout=TIMEOUT)
        else:
            init = f"tcp://127.0.0.1:{_free_port()}"
            me = [str(os.getpid()), str(start_time(os.getpid()) or 0)]
            for rank in range(1, world_size):  # forked by the process's warm zygote: no imports to wait for
                self.workers.append(start_rank([init, str(rank), str(world_size), str(threads), device.type, *me]))
            dist.init_process_group(backend, init_method=init, rank=0, world_size=world_size, timeout=TIMEOUT)
            threading.Thread(target=self._watch, name="rlvr-rank-watchdog", daemon=True).start()

    # ----- the protocol --------------------------------------------------------------------------------------

    @contextmanager
    def op(self, name: str, header: dict[str, Any] | None = None, *blobs: bytes) -> Iterator[None]:
        """Announce operation `name` to every rank, then run rank 0's share inside (the policy's forward is
        allowed only here: outside, rank 0 alone would wait forever for the others' weights)."""
        self._check()
        try:  # the announcement too: a rank that died since the last operation fails its broadcast
            broadcast_bytes(json.dumps({"op": name, **(header or {})}).encode(), self.device)
            for blob in blobs:
                broadcast_bytes(blob, self.device)
            self._in_op.active, self.current = True, name
            yield
        except Stopped:
            self.broken = True  # the ranks may be anywhere in the operation: no further collective can match
            raise
        except Exception:  # a collective fails when a rank died: that death is the error to report
            self.broken = True
            died = self._dead_rank(wait_s=DEATH_WAIT_S)
            if died is None:
                raise
            self._lose(died, signal_run=False)
            raise RankLost(died) from None
        finally:
            self._in_op.active, self.current = False, None
        self._check()

    @property
    def in_op(self) -> bool:
        return bool(getattr(self._in_op, "active", False))

    def _check(self) -> None:
        if self.lost is not None:
            raise RankLost(self.lost)

    def _watch(self) -> None:
        """Rank 0's watchdog over the ranks it started: when one dies, the run is stopped (SIGTERM to this process,
        which unwinds the run and says which rank died), and the process ended if a collective holds it longer
        than EXIT_GRACE_S."""
        while self.lost is None and not self.closing:
            time.sleep(WATCH_S)
            died = self._dead_rank()
            if died is not None:
                self._lose(died, signal_run=True)

    def _dead_rank(self, wait_s: float = 0.0) -> str | None:
        """How the first rank this process started that has died ended (None while all live), looking for up to
        `wait_s` seconds."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, worker in enumerate(self.workers, start=1):
                code = worker.poll()
                if code is not None and not self.closing:
                    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
                    during = f" during operation {self.current!r}" if self.current else ""
                    return f"stopped: data-parallel rank {rank} (pid {worker.pid}) {how}{during}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _lose(self, reason: str, signal_run: bool) -> None:
        """Record the group lost (once); with `signal_run`, stop the run's main thread by SIGTERM, naming
        `reason`, and end the process if it is still here after the grace."""
        with self._losing:
            if self.lost is not None:
                return
            self.lost = reason
        if signal_run:
            stop_with(signal.SIGTERM, reason)
            os.kill(os.getpid(), signal.SIGTERM)
        timer = threading.Timer(EXIT_GRACE_S, self._end_process)
        timer.daemon = True
        timer.start()

    def _end_process(self) -> None:
        if self.closing:  # the run unwound and stopped its ranks: nothing holds the process
            return
        print(f"error: run {self.lost}; ended after {EXIT_GRACE_S:g} s", file=sys.stderr, flush=True)
        for worker in self.workers:
            if worker.poll() is None:
                worker.kill()
        os._exit(1)

    # ----- operations ----------------------------------------------------------------------------------------

    def adopt(
        self, policy: Policy, optimizer: torch.optim.Optimizer | None, lr: float, weight_decay: float
    ) -> tuple[Policy, torch.optim.Optimizer]:
        """The group's sharded copy of `policy` (whole on rank 0) and an optimizer over it holding `optimizer`'s
        state (None or empty: fresh)."""
        static = static_files(policy)
        dtype = next(policy.model.parameters()).dtype
        has_state = optimizer is not None and bool(optimizer.state)
        header = {"dtype": str(dtype).removeprefix("torch."), "lr": lr, "weight_decay": weight_decay, "train": True}
        header["sharding"] = self.state.sharding
        with self.op("adopt", header, pack_files(static)):
            optimizer_state = plain_optimizer_state(policy.model, optimizer) if has_state and optimizer else None
            sharded, sharded_optimizer = build_sharded(
                self.state, static, dtype, policy.model, optimizer_state, lr, weight_decay, trainable=True
            )
        assert sharded_optimizer is not None
        self.state.policy, self.state.optimizer, self.state.static = sharded, sharded_optimizer, static
        self._guard(sharded)
        sharded.ranks = self
        return sharded, sharded_optimizer

    def adopt_reference(self, reference: Policy) -> Policy:
        """The group's sharded, frozen copy of the KL reference."""
        static = static_files(reference)
        dtype = next(reference.model.parameters()).dtype
        header = {"dtype": str(dtype).removeprefix("torch."), "lr": None, "weight_decay": 0.0, "train": False}
        header["sharding"] = self.state.sharding
        with self.op("reference", header, pack_files(static)):
            sharded, _ = build_sharded(self.state, static, dtype, reference.model, None, None, 0.0, trainable=False)
        self.state.reference = sharded
        self._guard(sharded)
        return sharded

    def read_reference(self, static: dict[str, bytes], dtype: torch.dtype, store_root: str, artifact_id: str) -> None:
        """The KL reference read by every rank as slices of checkpoint `artifact_id`'s weights file (no process
        holds it whole), frozen, and kept by the group for the updates that follow."""
        if self.reference_id == artifact_id:
            return
        header = self._reading(dtype, store_root, artifact_id, None, 0.0)
        with self.op("read_reference", header, pack_files(static)):
            self.state.reference = reference_share(self.state, static, header)
        self.reference_id = artifact_id
        self._guard(self.state.reference)

    def update(self, batch: RolloutBatch, cfg: GRPOConfig, reference: Policy | None) -> dict[str, float]:
        """One GRPO step of the group's policy, against the reference the group holds (`read_reference`) or rank
        0's whole `reference`, which the group then keeps sharded."""
        policy, optimizer = self._held()
        use_reference = cfg.kl_beta > 0 and (reference is not None or self.state.reference is not None)
        if use_reference and self.state.reference is None:
            assert reference is not None
            self.adopt_reference(reference)
        with self.op("step", {"reference": use_reference}, payload_text(batch, cfg).encode()):
            return distributed_grpo_step(policy, optimizer, batch, cfg, self.state.reference if use_reference else None)

    def sft_steps(
        self, optimizer: torch.optim.Optimizer, sequences: list[SftSequence], settings: dict[str, int]
    ) -> list[float]:
        """`sft.sft_steps` of the group's policy over the ranks (`settings`: steps, batch_size, seed), each rank
        training on its share of every batch: rank 0 steps `optimizer`, a fresh AdamW over its shards, and every
        other rank one it makes alike, dropped after (the policy's own optimizer is left untouched). Returns each
        step's loss over the whole batch."""
        self._held()
        if not isinstance(optimizer, torch.optim.AdamW) or optimizer.state:
            raise ValueError("sft steps on the ranks need a fresh AdamW (make_optimizer): the other ranks make theirs")
        hyper = {name: optimizer.param_groups[0][name] for name in ("lr", "weight_decay")}
        request = {"sequences": [dataclasses.asdict(s) for s in sequences], **settings, **hyper}
        with self.op("sft", {}, json.dumps(request).encode()):
            return sft_share(self.state, request, optimizer)

    def sample(
        self, prompts: list[str], counts: list[int], settings: dict[str, Any], keys: list[int] | None = None
    ) -> list[Sample]:
        """`generation.sample` over the ranks: `counts[i]` samples of `prompts[i]`, each rank decoding its share
        with row seeds keyed by `keys[i]` (default: i), so the tokens are those one process draws with the same
        keys. `settings`: sample's other keyword arguments (max_new_tokens, temperature, top_p, seed, cache,
        precision, logprob_temperature)."""
        keys = list(range(len(prompts))) if keys is None else keys
        request = json.dumps({"prompts": prompts, "counts": counts, "settings": settings, "keys": keys}).encode()
        with self.op("sample", {"decode": self.state.decode}, request):
            return sample_share(self.state, prompts, counts, settings, keys)

    def episodes(self, request: dict[str, Any]) -> list[Trajectory]:
        """`episodes.play_episodes` over the ranks (`request`: env, tasks, counts, budgets, settings, keys), each
        rank playing its share of the tasks; on rank 0 every trajectory in the one-process order."""
        with self.op("episodes", {"decode": self.state.decode}, json.dumps(request).encode()):
            return episodes_share(self.state, request)

    def reference_probabilities(
        self, texts: list[ReferenceText], temperature: float, micro_batch_tokens: int, end_cap: float | None
    ) -> list[ReferenceProbability]:
        """RLPR's `reference_probabilities` over the ranks: each rank scores whole micro-batches of the one-process
        split (so every term has the bits one process gives), rank 0 gathers them in order."""
        request = {"texts": [dataclasses.asdict(t) for t in texts], "temperature": temperature}
        request.update(micro_batch_tokens=micro_batch_tokens, end_cap=end_cap)
        with self.op("rlpr", {}, json.dumps(request).encode()):
            return rlpr_share(self.state, request)

    def greedy(self, prompts: list[str], settings: dict[str, Any]) -> list[str]:
        """`generation.greedy` over the ranks (`settings`: max_new_tokens, cache), each rank its share."""
        request = json.dumps({"prompts": prompts, "settings": settings}).encode()
        with self.op("greedy", {"decode": self.state.decode}, request):
            return greedy_share(self.state, prompts, settings)

    def whole_files(self) -> dict[str, bytes]:
        """The policy as a Hugging Face model directory (name -> bytes), built on rank 0 from the gathered weights
        (what a checkpoint stores)."""
        policy, _ = self._held()
        with self.op("whole"):
            weights = full_state(policy.model)
        dtype = next(policy.model.parameters()).dtype
        return policy_files(plain_policy(self.state.static, weights, policy, dtype))

    def write_weights(self, store_root: str, kind: str, artifact_id: str) -> dict[str, Any]:
        """The policy's weights as `model.safetensors` in artifact `artifact_id`'s folder of the store at
        `store_root`, streamed from the shards a tensor at a time (no process holds the whole model; the bytes are
        those `whole_files` would give); the file's manifest entry, for rank 0 to commit."""
        self._held()
        header = {"root": store_root, "kind": kind, "artifact_id": artifact_id}
        with self.op("write_weights", header):
            return write_weights_share(self.state, header)

    def save_state(self, store_root: str, kind: str, artifact_id: str) -> list[dict[str, Any]]:
        """The sharded weights and optimizer state with torch.distributed.checkpoint: every rank writes its own
        files into artifact `artifact_id`'s folder of the store at `store_root` (`Store.place_file`, so the store
        must be reachable from every rank); returns every file's manifest entry for rank 0 to commit."""
        self._held()  # a policy to save
        header = {"root": store_root, "kind": kind, "artifact_id": artifact_id}
        with self.op("save_state", header):
            return save_share(self.state, header)

    def load_state(
        self,
        static: dict[str, bytes],
        dtype: torch.dtype,
        store_root: str,
        artifact_id: str,
        lr: float,
        weight_decay: float,
        whole_file: bool = False,
    ) -> tuple[Policy, torch.optim.Optimizer]:
        """The group's sharded policy and optimizer loaded from a state `save_state` wrote (at any rank count),
        built from the policy's static files (config, tokenizer) in `dtype`. With `whole_file`, artifact_id is
        instead a checkpoint stored whole (its `model.safetensors`), which each rank reads by the slices its shards
        need (no process holds the whole policy), with a fresh optimizer."""
        header = {**self._reading(dtype, store_root, artifact_id, lr, weight_decay), "whole_file": whole_file}
        with self.op("load_state", header, pack_files(static)):
            sharded, optimizer = (adopt_share if whole_file else load_share)(self.state, static, header)
        return self._hold(sharded, optimizer, static)

    def _reading(
        self, dtype: torch.dtype, store_root: str, artifact_id: str, lr: float | None, weight_decay: float
    ) -> dict[str, Any]:
        """The header of an operation in which every rank builds the policy and reads its shards from the store."""
        header = {"dtype": str(dtype).removeprefix("torch."), "lr": lr, "weight_decay": weight_decay}
        header.update(sharding=self.state.sharding, root=store_root, artifact_id=artifact_id)
        return header

    def _hold(
        self, sharded: Policy, optimizer: torch.optim.Optimizer, static: dict[str, bytes]
    ) -> tuple[Policy, torch.optim.Optimizer]:
        """The group's policy from now on: kept by rank 0's state, refusing a forward outside an operation."""
        self.state.policy, self.state.optimizer, self.state.static = sharded, optimizer, static
        self._guard(sharded)
        sharded.ranks = self
        return sharded, optimizer

    def held(self) -> list[dict[str, int]]:
        """Every rank's counted bytes of parameters, gradients and optimizer state (`sharding.held_bytes`)."""
        with self.op("held"):
            policy, optimizer = self._held()
            mine = json.dumps(held_bytes(policy.model, optimizer)).encode()
            return [json.loads(part) for part in gather_bytes(mine, self.device)]

    def _held(self) -> tuple[Policy, torch.optim.Optimizer]:
        if self.state.policy is None or self.state.optimizer is None:
            raise RuntimeError("the group holds no policy yet: adopt one first")
        return self.state.policy, self.state.optimizer

    def _guard(self, policy: Policy) -> None:
        """Rank 0's model refuses a forward outside an operation, which would wait forever for the others."""
        group = self

        def refuse(_module: torch.nn.Module, _args: Any) -> None:
            if not group.in_op:
                raise RuntimeError(
                    f"this policy is sharded over {group.world_size} data-parallel ranks: call it through its "
                    "rank group (trainer/ranks/launch.py), which runs every rank's share"
                )

        policy.model.register_forward_pre_hook(refuse, prepend=True)  # before FSDP2 gathers the weights

    def close(self) -> None:
        """Stop the ranks and leave the process group."""
        self.closing = True
        orderly = self.lost is None and not self.broken and all(worker.poll() is None for worker in self.workers)
        try:
            if orderly:
                broadcast_bytes(json.dumps({"op": "stop"}).encode(), self.device)
        except Exception:  # a rank died after the run's last operation: its work is committed, nothing to report
            orderly = False
        finally:
            if not orderly:  # a rank may wait in a collective that will never complete
                for worker in self.workers:
                    worker.kill()
            dist.destroy_process_group()
            for worker in self.workers:
                try:
                    worker.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    worker.kill()


# --- the process's group -------------------------------------------------------------------------------------

_group: RankGroup | None = None


def torchrun_rank() -> int | None:
    """This process's global rank when torchrun started it, else None."""
    rank = os.environ.get("RANK")
    return (
        int(rank) if rank is not None and "WORLD_SIZE" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ else None
    )


def rank_group(
    world_size: int, sharding: Sharding, device: torch.device, threads: int = 1, decode: DecodeWeights = "units"
) -> RankGroup:
    """This process's group of `world_size` ranks on `device`, started on first use (and started anew when its
    shape changes); `decode` is how its fsdp ranks decode from then on (sent with each decoding request)."""
    global _group
    if _group is not None and (
        _group.world_size != world_size or _group.device != device or _group.state.sharding != sharding
    ):
        close_group()
    if _group is None:
        _group = RankGroup(world_size, sharding, device, threads)
    _group.state.decode = decode
    return _group


def current_group() -> RankGroup | None:
    return _group


@atexit.register
def close_group() -> None:
    """Stop this process's ranks (at exit, or before a group of another shape starts)."""
    global _group
    group, _group = _group, None
    if group is not None:
        group.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- a rank's process ----------------------------------------------------------------------------------------


def name_process(name: str) -> None:
    """The name `ps -o comm`, top and /proc/PID/comm show for this process (Linux; at most 15 bytes), so that a
    rank forked from the zygote, whose command line is the zygote's, says what it is."""
    if sys.platform.startswith("linux"):
        pr_set_name = 15
        ctypes.CDLL(None).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)


def main(argv: Sequence[str]) -> int:
    """A rank the run started: python -m rlvr.trainer.ranks.launch INIT RANK WORLD THREADS DEVICE PID START."""
    parser = argparse.ArgumentParser(prog="python -m rlvr.trainer.ranks.launch", description="one data-parallel rank")
    for name in ("init", "rank", "world_size", "threads", "device", "parent_pid", "parent_start"):
        parser.add_argument(name)
    args = parser.parse_args(argv)
    rank = int(args.rank)

    def gone() -> None:
        print(f"data-parallel rank {rank}: rank 0 (pid {args.parent_pid}) is gone; exiting", file=sys.stderr)

    exit_when_gone(int(args.parent_pid), int(args.parent_start) or None, before_exit=gone)
    name_process(f"rlvr-rank-{rank}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cpu":
        return_freed_memory()
    world = int(args.world_size)
    dist.init_process_group(backend, init_method=args.init, rank=rank, world_size=world, timeout=TIMEOUT)
    freeze_startup_objects()  # a process of its own, its imports done: out of every later collection
    serve(RankState(device, "fsdp", int(args.threads)))
    return 0


def serve_torchrun(device_name: str, threads: int) -> None:
    """A rank other than 0 of a run torchrun started (`torchrun ... -m rlvr.flows.cli run ...` on every machine):
    it joins the group torchrun set up and serves rank 0, which runs the flow. `device_name`: the run's
    policy.device (cpu keeps the ranks on the CPU with gloo; otherwise each takes the GPU of its LOCAL_RANK)."""
    from rlvr.trainer.devices import resolve_device

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    use_cuda = resolve_device(device_name).type == "cuda"
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        return_freed_memory()
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=TIMEOUT)
    serve(RankState(device, "fsdp", threads))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
