"""A GRPO step's rows in micro-batches (gradient accumulation), and how many padded tokens a micro-batch may hold on
a GPU: the free memory, less what the update will still allocate, over what one token needs
(`GRPOConfig.micro_batch_tokens`, docs/training.md).
"""

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from rlvr.trainer.grpo_batch import GRPOConfig, TrainingRows


def micro_batches(rows: TrainingRows, selected: Tensor, budget: int | None) -> list[Tensor]:
    """The `selected` rows [R] (bool) as consecutive micro-batches (bool masks) of at most `budget` padded
    tokens each, at least one row each; `budget` None: the whole selection at once. Every row has the same
    padded width (the step's), so the budget is a row count; groups may straddle micro-batches."""
    if budget is None:
        return [selected]
    width = rows.prompt_ids.shape[1] + rows.completion_ids.shape[1]
    indices = selected.nonzero().squeeze(1)
    chunks = torch.split(indices, max(1, budget // width))
    return [torch.zeros_like(selected).index_fill_(0, chunk, True) for chunk in chunks]


MEMORY_SHARE = 0.7  # of the free GPU memory that micro-batches may plan on (the rest: allocator slack, workspaces)


def token_bytes(config: Any, checkpointing: bool) -> int:
    """Memory one padded token of a micro-batch may need in the loss pass, as float32 (under bf16 autocast most
    of it is half that): the logits, their gradient and one more vocabulary-sized buffer in the backward (3V),
    and what each decoder layer keeps for the backward, about 10H + 4I (norm inputs and outputs, q/k/v, the
    attention output, the MLP's gate, up, activation and product); with checkpointing each layer keeps only its
    input (H) and one layer at a time is recomputed."""
    vocab, hidden, layers = int(config.vocab_size), int(config.hidden_size), int(config.num_hidden_layers)
    width = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    per_layer = 10 * hidden + 4 * width
    kept = layers * hidden + per_layer if checkpointing else layers * per_layer
    return 4 * (3 * vocab + kept)


def unallocated_update_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """What the update will still allocate: each trainable parameter's gradient when it has none, and an Adam-style
    optimizer's two moments when it has no state for it yet (always, without an optimizer to ask). A parameter
    sharded over data-parallel ranks (a DTensor) counts this rank's shard only."""
    total = 0
    for param in model.parameters():
        if not param.requires_grad:
            continue
        held = param.to_local() if isinstance(param, DTensor) else param
        size = held.numel() * held.element_size()
        if param.grad is None:
            total += size
        if optimizer is None or not optimizer.state.get(param):
            total += 2 * size
    return total


def micro_batch_budget(
    model: PreTrainedModel, cfg: GRPOConfig, optimizer: torch.optim.Optimizer | None = None
) -> int | None:
    """`cfg.micro_batch_tokens` when set. Unset: on CUDA, the padded tokens that fit in `MEMORY_SHARE` of the free
    GPU memory (the caching allocator's unused reserve counts as free) after what the update will still allocate,
    at `token_bytes` each; elsewhere, and for DisCO, None (the whole minibatch, as the CPU always did)."""
    if cfg.micro_batch_tokens is not None:
        return cfg.micro_batch_tokens
    if cfg.objective == "disco":  # its loss couples the minibatch's rows: one pass (GRPOConfig refuses a budget)
        return None
    device = next(model.parameters()).device
    if device.type != "cuda":
        return None
    return tokens_that_fit(cuda_free_bytes(device), model, cfg, optimizer)


def cuda_free_bytes(device: torch.device) -> int:
    """The device's free memory plus the caching allocator's reserved but unallocated bytes."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def tokens_that_fit(
    free_bytes: int, model: PreTrainedModel, cfg: GRPOConfig, optimizer: torch.optim.Optimizer | None = None
) -> int:
    """Padded tokens of a micro-batch that fit in `MEMORY_SHARE` of `free_bytes` after what the update will still
    allocate, at `token_bytes` each; at least 1."""
    usable = MEMORY_SHARE * (free_bytes - unallocated_update_bytes(model, optimizer))
    per_token = token_bytes(model.config, cfg.gradient_checkpointing)
    return max(1, int(usable // per_token))
