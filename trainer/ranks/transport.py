"""Bytes between the data-parallel ranks (trainer/ranks/launch.py): rank 0 broadcasts a byte string to every rank
or gathers one from each, over the process group's collectives (gloo on the CPU, NCCL on GPUs); a model directory
travels as one byte string (`pack_files`).
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def broadcast_bytes(data: bytes | None, device: torch.device) -> bytes:
    """Rank 0 sends `data`; every rank returns it (the others pass None)."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if data is not None:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else _empty(0, device)
    else:
        buffer = _empty(int(size.item()), device)
    if buffer.numel():
        dist.broadcast(buffer, src=0)
    return data if data is not None else buffer.cpu().numpy().tobytes()


def gather_bytes(data: bytes, device: torch.device) -> list[bytes]:
    """Every rank's `data`, in rank order, on rank 0 (the other ranks get an empty list)."""
    world = dist.get_world_size()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    buffer = _empty(longest, device)
    if data:
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    parts = [_empty(longest, device) for _ in range(world)] if dist.get_rank() == 0 else None
    dist.gather(buffer, parts, dst=0)
    if parts is None:
        return []
    return [part[: int(s.item())].cpu().numpy().tobytes() for part, s in zip(parts, sizes)]


def _empty(size: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(size, dtype=torch.uint8, device=device)


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
