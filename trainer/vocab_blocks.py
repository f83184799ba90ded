"""Full-vocabulary log-softmax in blocks of positions: how many positions a block holds, the tiles of a
[rows, columns] grid of positions, and one block's float32 log-softmax. Shared by the logits path
(trainer/logprobs.py) and the fused LM head (trainer/fused_head.py)."""

import torch
from torch import Tensor

BLOCK_BYTES = 32 * 2**20  # float32 bytes of one block of full-vocabulary log-probs (a few such temporaries live)
# On a GPU each block of the fused head costs a pass over the LM head's weight (forward, recomputation, and a
# [V, H] gradient added to a float32 sum), whatever its size. At Qwen2.5-0.5B's 151,936 tokens 32 MiB blocks are
# 55 positions, 160 per 32-row micro-batch: about 2 GB of traffic a block, 5-6 TB a step of 16 micro-batches,
# about 1.2 s at an H200's 4.8 TB/s, close to the 1.5 s by which its training trailed TRL's (2026-11-27).
# 256 MiB blocks hold one 256-token row (32 blocks, 5x fewer; under 1 GB of temporaries in the backward, beside
# the 2.5 GB of logits the fused head saves). Not yet measured on a GPU.
CUDA_BLOCK_BYTES = 256 * 2**20


def block_positions(vocab_size: int, device: torch.device | str = "cpu") -> int:
    """Positions per block, so that one block's float32 log-probs take about `BLOCK_BYTES` (on a CUDA device
    `CUDA_BLOCK_BYTES`)."""
    budget = CUDA_BLOCK_BYTES if torch.device(device).type == "cuda" else BLOCK_BYTES
    return max(1, budget // (4 * vocab_size))


def position_blocks(rows: int, columns: int, positions: int) -> list[tuple[slice, slice]]:
    """(row slice, column slice) tiles of an [rows, columns] grid with at most `positions` cells each: whole
    rows when a row fits, else pieces of one row."""
    if columns <= positions:
        step = positions // max(columns, 1)
        return [(slice(r, r + step), slice(0, columns)) for r in range(0, rows, step)]
    pieces = range(0, columns, positions)
    return [(slice(r, r + 1), slice(c, min(c + positions, columns))) for r in range(rows) for c in pieces]


def block_log_probs(logits: Tensor, temperature: float) -> Tensor:
    """The full-vocabulary log-softmax of one block: log_softmax(logits.float() / temperature), with one float32
    temporary at most (x / 1 is x exactly, so temperature 1 divides nothing)."""
    if temperature == 1.0:
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log_softmax(logits.to(torch.float32, copy=True).div_(temperature), dim=-1)
