"""Seeded torch randomness that leaves the caller's RNG state as it was."""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

CPU = torch.device("cpu")


@contextmanager
def seeded_rng(seed: int, device: torch.device = CPU) -> Iterator[None]:
    """Torch's RNG of the CPU (and of `device` when it is a GPU) seeded with `seed` inside, restored after.

    Not `torch.manual_seed`: on a machine without CUDA it still queues a lazy CUDA seeding call and formats a
    stack trace for it, a cost paid on every RL step; on a GPU it would leave the caller's CUDA RNG reseeded.
    """
    gpu = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpu):
        torch.random.default_generator.manual_seed(seed)
        if gpu:
            torch.cuda.manual_seed_all(seed)
        yield
