"""A model state's tensors as this process holds them: a distributed tensor's local part, and each shared (tied)
tensor once. Shared by the plain policy's files (policy.py), the ranks' shards (sharding.py) and the streamed
safetensors file (streamed_weights.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly distributed) tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def first_names(state: Mapping[str, Any]) -> dict[str, Any]:
    """`state` with each shared (tied) tensor once, under its first name, as `save_pretrained` stores it: tensors
    are the same when their (local) storage is."""
    seen: set[int] = set()
    unique: dict[str, Any] = {}
    for name, tensor in state.items():
        pointer = local(tensor).untyped_storage().data_ptr()
        if pointer not in seen:
            seen.add(pointer)
            unique[name] = tensor
    return unique
