"""Completion log-probabilities under a causal LM in bounded memory: the forward pass that scores completions
(`completion_logprobs`, `completion_logprobs_and_entropy`) and the selective log-softmax under it.

A full-vocabulary float32 log-softmax is 4 x V bytes per token (600 KB at Qwen's 151,936 tokens), and autograd
would keep it for the backward. Here the logits are read in blocks of positions: each block is cast to float32,
log-softmaxed, and only the chosen token's value (and, without gradients, the entropy) leaves it. Autograd keeps
the logits as the model produced them and the backward recomputes each block, so the float32 copies exist for
one block at a time. Per position the numbers are those of `log_softmax(logits.float() / T).gather(...)`: the
same operations on the same rows, in blocks.
"""

import inspect
from typing import Any

import torch
from torch import Tensor

from rlvr.trainer.fused_head import (
    FUSABLE,
    causal_inputs,
    completion_hidden,
    fused_logprobs_and_entropy,
    head_parts,
    use_fused,
)
from rlvr.trainer.vocab_blocks import block_log_probs, block_positions, position_blocks


def _blockwise(
    logits: Tensor, tokens: Tensor, temperature: float, positions: int, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """log π(token) [R, T] at the first T positions of `logits` [R, W >= T, V], and π's entropy when asked."""
    rows, columns = tokens.shape
    logp = torch.empty(rows, columns, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logp) if with_entropy else None
    with torch.no_grad():
        for r, c in position_blocks(rows, columns, positions):
            log_probs = block_log_probs(logits[r, c], temperature)
            logp[r, c] = log_probs.gather(-1, tokens[r, c].unsqueeze(-1)).squeeze(-1)
            if entropy is not None:
                entropy[r, c] = -log_probs.exp().mul_(log_probs).sum(dim=-1)
            del log_probs
    return logp, entropy


class _SelectiveLogSoftmax(torch.autograd.Function):
    """log softmax(logits / T)[token] whose backward recomputes each block's log-softmax instead of keeping it;
    with `with_entropy`, also each position's entropy from the same block (no gradient; else an empty tensor)."""

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, tokens: Tensor, temperature: float, positions: int, with_entropy: bool
    ) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(logits, tokens)
        ctx.temperature, ctx.positions = temperature, positions
        logp, entropy = _blockwise(logits, tokens, temperature, positions, with_entropy)
        entropy = entropy if entropy is not None else logp.new_empty(0)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor, _: Tensor) -> tuple[Tensor, None, None, None, None]:
        logits, tokens = ctx.saved_tensors
        grad_logits = torch.zeros_like(logits)
        rows, columns = tokens.shape
        for r, c in position_blocks(rows, columns, ctx.positions):
            with torch.enable_grad():
                block = logits[r, c].detach().requires_grad_()
                chosen = block_log_probs(block, ctx.temperature).gather(-1, tokens[r, c].unsqueeze(-1)).squeeze(-1)
                (grad_block,) = torch.autograd.grad(chosen, block, grad[r, c])
            grad_logits[r, c] = grad_block
        return grad_logits, None, None, None, None


def selective_log_softmax(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, positions: int | None = None
) -> Tensor:
    """log softmax(logits / temperature)[token] in float32 [R, T], for `tokens` [R, T] and the first T
    positions of `logits` [R, W >= T, V] (any float dtype), `positions` per block (default `block_positions`).
    Differentiable in `logits`; autograd keeps `logits` itself, no float32 full-vocabulary copy."""
    positions = positions or block_positions(logits.shape[-1], logits.device)
    return _SelectiveLogSoftmax.apply(logits, tokens, temperature, positions, False)[0]


def log_probs_and_entropy(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, positions: int | None = None
) -> tuple[Tensor, Tensor]:
    """`selective_log_softmax` (differentiable, when gradients are on) and the entropy -Σ_v π log π [R, T] of each
    position's distribution (never differentiable), both from the same block, which is freed before the next."""
    positions = positions or block_positions(logits.shape[-1], logits.device)
    logp, entropy = _SelectiveLogSoftmax.apply(logits, tokens, temperature, positions, True)
    return logp, entropy


def keeps_last_logits(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes `logits_to_keep` (transformers' causal LMs do): logits for the last
    positions only, so the prompt's positions never get vocabulary-sized logits."""
    return forward_takes(model, "logits_to_keep")


def forward_takes(model: torch.nn.Module, argument: str) -> bool:
    """Whether the model's forward has a parameter named `argument`: looked up once a model class and argument
    (the graph loop asks at every token step)."""
    model_class = type(model)
    if model_class not in _forward_parameters:
        _forward_parameters[model_class] = frozenset(inspect.signature(model.forward).parameters)
    return argument in _forward_parameters[model_class]


_forward_parameters: dict[type, frozenset[str]] = {}  # `forward_takes`'s, by model class


def next_token_logits(model: torch.nn.Module, prompt_ids: Tensor, completion_ids: Tensor, pad_id: int) -> Tensor:
    """Logits [R, W >= T, V] whose first T positions predict the T completion tokens (position t sees the prompt
    and the completion tokens before t), in the model's dtype."""
    inputs = causal_inputs(prompt_ids, completion_ids, pad_id)
    prompt_length, completion_length = prompt_ids.shape[1], completion_ids.shape[1]
    if keeps_last_logits(model):  # the last T + 1 positions: from the prompt's last token to the end
        return model(**inputs, logits_to_keep=completion_length + 1).logits
    logits = model(**inputs).logits
    return logits[:, prompt_length - 1 : prompt_length - 1 + completion_length].contiguous()


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    completion_ids: Tensor,
    pad_id: int,
    completion_mask: Tensor | None = None,
    temperature: float = 1.0,
    fused: bool | None = None,
    fp32_head: bool = False,
) -> tuple[Tensor, Tensor]:
    """log π(completion token | prompt, earlier tokens) per position, and which positions are real.

    `prompt_ids` [R, P] are left-padded with `pad_id` (as the tokenizer pads for generation) and
    `completion_ids` [R, T] right-padded. Logits are divided by `temperature` first. Position ids restart
    at 0 on each row's first real prompt token, as `generate` numbers them, so these logprobs match the
    sampler's. The mask defaults to
    `completion_ids != pad_id`; pass `completion_mask` when a pad id can be a real token (a model whose
    pad token is its eos, or a sampled pad), as `grpo_step` does. `fused`: the LM head block by block, never
    the whole logits (trainer/fused_head.py); None: on CUDA for the architectures it supports. `fp32_head`: the
    head's matmul in float32 under autocast (the decoder stays in the autocast dtype).
    """
    if completion_mask is None:
        completion_mask = completion_ids != pad_id
    if use_fused(model, fused):
        logp = fused_logprobs_and_entropy(model, prompt_ids, completion_ids, pad_id, temperature, False, fp32_head)[0]
    else:
        logits = head_logits(model, prompt_ids, completion_ids, pad_id, fp32_head)
        logp = selective_log_softmax(logits, completion_ids, temperature)
    return logp, completion_mask.to(logp.dtype)


def completion_logprobs_and_entropy(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    completion_ids: Tensor,
    pad_id: int,
    temperature: float,
    fused: bool | None = None,
    fp32_head: bool = False,
) -> tuple[Tensor, Tensor]:
    """`completion_logprobs` (same numbers; differentiable when gradients are on) and the entropy -Σ_v π log π of
    the next-token distribution at each completion position [R, T] (no gradient), from one forward pass; entropy
    collapse is GRPO's best-known failure."""
    if use_fused(model, fused):
        logp, entropy = fused_logprobs_and_entropy(
            model, prompt_ids, completion_ids, pad_id, temperature, True, fp32_head
        )
        assert entropy is not None
        return logp, entropy
    logits = head_logits(model, prompt_ids, completion_ids, pad_id, fp32_head)
    return log_probs_and_entropy(logits, completion_ids, temperature)


def head_logits(model: torch.nn.Module, prompt_ids: Tensor, completion_ids: Tensor, pad_id: int, fp32: bool) -> Tensor:
    """`next_token_logits`; with `fp32` the decoder's hidden states go through the LM head in float32 with autocast
    off (prime-rl's and AReaL's FP32 head: under bf16 the head's rounding is the largest share of the log-probs'
    error). Needs a model whose logits are its head on the decoder's output (trainer/fused_head.py `head_parts`)."""
    if not fp32:
        return next_token_logits(model, prompt_ids, completion_ids, pad_id)
    parts = head_parts(model)
    if parts is None:
        raise ValueError(f"train.grpo.fp32_head needs one of {sorted(FUSABLE)}, got {type(model).__name__}")
    decoder, head = parts
    hidden = completion_hidden(decoder, prompt_ids, completion_ids, pad_id)
    with torch.autocast(hidden.device.type, enabled=False):
        return torch.nn.functional.linear(hidden.float(), head.weight.float())
