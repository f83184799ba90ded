"""A data-parallel rank's loop (every rank but 0): it waits for rank 0's next announced operation and does its share
(trainer/ranks/operations.py, state.py, sft.py, and trainer/distributed.py for a GRPO step), until rank 0 says stop.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from rlvr.trainer.distributed import distributed_grpo_step, parse_payload
from rlvr.trainer.ranks.operations import (
    RankState,
    build_sharded,
    episodes_share,
    greedy_share,
    rlpr_share,
    sample_share,
)
from rlvr.trainer.ranks.sft import sft_share
from rlvr.trainer.ranks.state import adopt_share, load_share, reference_share, save_share, write_weights_share
from rlvr.trainer.ranks.transport import broadcast_bytes, gather_bytes, unpack_files
from rlvr.trainer.sharding import full_state, held_bytes


def serve(state: RankState) -> None:
    """Do every operation rank 0 announces, until it says stop (the process group is initialised)."""
    device = state.device
    try:
        while (header := json.loads(broadcast_bytes(None, device)))["op"] != "stop":
            serve_one(state, header)
    finally:
        dist.destroy_process_group()


def serve_one(state: RankState, header: dict[str, Any]) -> None:
    device, op = state.device, header["op"]
    state.decode = header.get("decode", state.decode)  # a decoding request says how
    if op in ("adopt", "reference"):
        static = unpack_files(broadcast_bytes(None, device))
        dtype = getattr(torch, header["dtype"])
        train = bool(header["train"])
        state.sharding = header["sharding"]
        policy, optimizer = build_sharded(
            state, static, dtype, None, None, header["lr"], header["weight_decay"], trainable=train
        )
        if train:
            state.policy, state.optimizer, state.static = policy, optimizer, static
        else:
            state.reference = policy
    elif op == "step":
        batch, cfg = parse_payload(broadcast_bytes(None, device).decode())
        assert state.policy is not None and state.optimizer is not None, "rank 0 adopts a policy before a step"
        distributed_grpo_step(
            state.policy, state.optimizer, batch, cfg, state.reference if header["reference"] else None
        )
    elif op == "sft":
        sft_share(state, json.loads(broadcast_bytes(None, device)))
    elif op == "sample":
        request = json.loads(broadcast_bytes(None, device))
        sample_share(state, request["prompts"], request["counts"], request["settings"], request["keys"])
    elif op == "episodes":
        episodes_share(state, json.loads(broadcast_bytes(None, device)))
    elif op == "rlpr":
        rlpr_share(state, json.loads(broadcast_bytes(None, device)))
    elif op == "greedy":
        request = json.loads(broadcast_bytes(None, device))
        greedy_share(state, request["prompts"], request["settings"])
    elif op == "save_state":
        save_share(state, header)
    elif op == "write_weights":
        write_weights_share(state, header)
    elif op == "load_state":
        static = unpack_files(broadcast_bytes(None, device))
        state.sharding = header["sharding"]
        read = adopt_share if header.get("whole_file") else load_share
        state.policy, state.optimizer = read(state, static, header)
        state.static = static
    elif op == "read_reference":
        state.reference = reference_share(state, unpack_files(broadcast_bytes(None, device)), header)
    elif op == "whole":
        assert state.policy is not None
        full_state(state.policy.model)
    elif op == "held":
        assert state.policy is not None
        gather_bytes(json.dumps(held_bytes(state.policy.model, state.optimizer)).encode(), device)
    else:
        raise RuntimeError(f"unknown rank operation {op!r}")
