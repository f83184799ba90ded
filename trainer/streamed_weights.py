"""A sharded model's weights written as one safetensors file a tensor at a time, never whole in any process.

Every rank walks the model's tensors in the file's order and gathers each (`DTensor.full_tensor`, a collective);
rank 0 turns them into the file's bytes as they come: first the header, which needs only names, dtypes and shapes
(known from the shards), then each tensor's bytes. The most any process holds beyond its shards is one tensor
whole (at most one FSDP unit's). The bytes are those `safetensors.torch.save` writes for the whole state
(`policy.weights_bytes`): tensors ordered by element size (largest first), then by name; a compact JSON header
padded with spaces to a multiple of 8 bytes; tied tensors once, under their first name.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator

import torch
import torch.distributed as dist

from rlvr.trainer.state_tensors import first_names

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def file_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's state tensors (sharded ones as DTensors), each shared tensor once under its first name, in the
    order safetensors lays them out."""
    return safetensors_order(list(first_names(model.state_dict()).items()))


def safetensors_order(found: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Named tensors in the order safetensors lays them out: largest element first, then by name."""
    sizes = {t.dtype: t.element_size() for _, t in found}
    if len({(sizes[dtype], dtype) for dtype in sizes}) != len({sizes[dtype] for dtype in sizes}):
        raise ValueError(f"weights of two dtypes of one size ({sorted(map(str, sizes))}): not streamed")
    return sorted(found, key=lambda item: (-item[1].element_size(), item[0]))


def header_bytes(tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    """The file's first bytes: the header's length (8 bytes, little-endian) and the header itself."""
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors:
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {tensor.dtype} is not streamed")
        size = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def whole_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Each state tensor whole, on the CPU, in the file's order (a collective: every rank walks them all)."""
    for name, tensor in file_tensors(model):
        whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        yield name, whole.detach().to("cpu").contiguous()
        del whole


def safetensors_chunks(model: torch.nn.Module) -> Iterator[bytes]:
    """The model's weights as safetensors bytes, a tensor at a time (a collective: on the other ranks this yields
    nothing but gathers every tensor with rank 0)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        yield header_bytes(file_tensors(model), {"format": "pt"})
    for _, whole in whole_tensors(model):
        data = whole.view(torch.uint8).numpy().tobytes() if rank == 0 and whole.numel() else b""
        del whole  # gone before the next tensor is gathered, as its bytes are once written (Store.place_file)
        if rank == 0:
            yield data
        del data
