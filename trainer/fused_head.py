"""Completion log-probabilities without vocabulary-sized logits: the LM head applied block by block.

`trainer/logprobs.py` keeps the model's logits [R, T, V] for the backward (and the backward makes a gradient of
that size): at Qwen2.5-0.5B's vocabulary, 32 rows of 257 positions in bf16 are 2.5 GB each, the largest
tensors of a GRPO step on a GPU. Here the decoder's last hidden states [R, T, H] are kept instead; each block
of positions gets its logits from the head's weight, is log-softmaxed, and leaves only the chosen token's
log-prob (and, without gradients, the entropy); the backward recomputes each block's logits and accumulates
the gradients of the hidden states and of the head's weight. Memory for the head drops from O(R·T·V) to
O(block·V + V·H).

It applies to decoders whose logits are exactly `lm_head(final hidden state)`: the architectures listed in
`FUSABLE` (no logit scaling or soft-capping, no bias). The numbers are the logits path's up to the order of
floating-point sums in the matmul (blocks instead of one product); `auto` uses it on CUDA only, so CPU runs
keep their exact figures.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from rlvr.trainer.sharding import is_sharded
from rlvr.trainer.vocab_blocks import block_log_probs, block_positions, position_blocks

FUSABLE = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"})


def head_parts(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """(decoder, LM head) of a model whose logits are the head applied to the decoder's output; None otherwise
    (a LoRA wrapper, another architecture, a head with a bias)."""
    fusable = any(base.__name__ in FUSABLE for base in type(model).__mro__)  # FSDP2 subclasses the model's class
    if not fusable or not isinstance(model, PreTrainedModel):
        return None
    decoder, head = getattr(model, "model", None), model.get_output_embeddings()
    if decoder is None or not isinstance(head, nn.Linear) or head.bias is not None:
        return None
    return decoder, head


def use_fused(model: nn.Module, fused: bool | None) -> bool:
    """`fused` None (auto): on a CUDA model the head's memory matters and exact CPU figures do not."""
    if fused is None:
        return head_parts(model) is not None and next(model.parameters()).is_cuda
    return fused


def causal_inputs(prompt_ids: Tensor, completion_ids: Tensor, pad_id: int) -> dict[str, Tensor | bool]:
    """The forward inputs that score completions: left-padded prompts then completions, position ids restarting
    at each row's first real prompt token (as `generate` numbers them), no cache.

    Only the leading run of `pad_id` is padding: a chat model's pad token is often its end-of-turn token, which
    its template also puts inside the prompt (SmolLM2's `<|im_end|>`), and the sampler attends to those."""
    prompt_attention = ((prompt_ids != pad_id).cumsum(dim=1) > 0).long()
    attention = torch.cat([prompt_attention, torch.ones_like(completion_ids)], dim=1)
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    return {"input_ids": input_ids, "attention_mask": attention, "position_ids": position_ids, "use_cache": False}


def completion_hidden(decoder: nn.Module, prompt_ids: Tensor, completion_ids: Tensor, pad_id: int) -> Tensor:
    """The decoder's last hidden states [R, T, H] at the positions that predict the T completion tokens (the
    prompt's last token to the completion's second last)."""
    hidden = decoder(**causal_inputs(prompt_ids, completion_ids, pad_id)).last_hidden_state
    start = prompt_ids.shape[1] - 1
    return hidden[:, start : start + completion_ids.shape[1]]


def sharded_completion_hidden(
    model: nn.Module, head: nn.Linear, prompt_ids: Tensor, completion_ids: Tensor, pad_id: int
) -> Tensor:
    """`completion_hidden` of a model sharded with FSDP2, whose root unit (embeddings, final norm, LM head) is
    gathered only by the model's own forward: that forward runs with the head set aside (an identity), so its
    "logits" are the last hidden states, and FSDP2 keeps the root gathered from its forward to the end of its
    backward, so `head.weight` is then the whole gathered weight, whose gradient FSDP2 reduces with the root's."""
    causal_lm: Any = model  # a PreTrainedModel (head_parts checked): its output embeddings can be set
    causal_lm.set_output_embeddings(nn.Identity())
    try:
        keep = completion_ids.shape[1] + 1  # from the prompt's last token to the end
        hidden = causal_lm(**causal_inputs(prompt_ids, completion_ids, pad_id), logits_to_keep=keep).logits
    finally:
        causal_lm.set_output_embeddings(head)
    return hidden[:, : completion_ids.shape[1]]


def _block(hidden: Tensor, dtype: torch.dtype | None) -> Tensor:
    """One block's hidden states as a [P, H] matrix in the matmul's dtype: a block that is part of a row is not
    contiguous in [R, T, H], and a 3-d operand that cannot be flattened as a view sends `matmul` to a batched
    product over the head's expanded weight; `[P, H] @ [H, V]` is always one matrix product."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return flat if dtype is None else flat.to(dtype)


class _FusedSelectiveLogSoftmax(torch.autograd.Function):
    """log softmax(head(hidden) / T)[token] per position, and the entropy when asked (no gradient; else an empty
    tensor); the backward recomputes each block's logits. `dtype`: the autocast dtype of the forward (None: off),
    under which the head's weight is cast once per pass."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        tokens: Tensor,
        temperature: float,
        dtype: torch.dtype | None,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(hidden, weight, tokens)
        ctx.temperature, ctx.dtype = temperature, dtype
        rows, columns = tokens.shape
        logp = torch.empty(rows, columns, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        cast = weight.to(dtype) if dtype is not None else weight
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
            for r, c in position_blocks(rows, columns, block_positions(weight.shape[0], weight.device)):
                shape = tokens[r, c].shape
                log_probs = block_log_probs(_block(hidden[r, c], dtype) @ cast.t(), temperature)
                logp[r, c] = log_probs.gather(-1, tokens[r, c].reshape(-1, 1)).reshape(shape)
                if with_entropy:
                    entropy[r, c] = -log_probs.exp().mul_(log_probs).sum(dim=-1).reshape(shape)
                del log_probs
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor, _: Tensor) -> tuple[Tensor, Tensor, None, None, None, None]:
        hidden, weight, tokens = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        rows, columns = tokens.shape
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
            cast = weight.to(ctx.dtype) if ctx.dtype is not None else weight
            for r, c in position_blocks(rows, columns, block_positions(weight.shape[0], weight.device)):
                block = _block(hidden[r, c], ctx.dtype)
                grad_logits = _logit_gradient(
                    block @ cast.t(), tokens[r, c].reshape(-1), grad[r, c].reshape(-1), ctx.temperature
                )
                grad_hidden[r, c] = (grad_logits @ cast).reshape(hidden[r, c].shape)
                grad_weight += grad_logits.t() @ block  # float32 sums of the (possibly bf16) block gradients
                del grad_logits
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def _logit_gradient(logits: Tensor, tokens: Tensor, grad: Tensor, temperature: float) -> Tensor:
    """The gradient of Σ grad · log softmax(logits / T)[token] in the logits: grad / T · (onehot(token) -
    softmax(logits / T)), in the logits' dtype. Written out rather than left to autograd, which makes a
    vocabulary-sized gradient for the gather, another for the log-softmax and a third for the cast (at one
    256-token row of 151,936 tokens the backward added 209 MiB over the forward's peak, now 61: docs/methods.md),
    for the same numbers up to rounding."""
    scale = (grad / temperature).unsqueeze(-1)
    probs = block_log_probs(logits, temperature).exp_()
    probs.mul_(-scale).scatter_add_(-1, tokens.unsqueeze(-1), scale)
    return probs.to(logits.dtype)


def fused_logprobs_and_entropy(
    model: nn.Module,
    prompt_ids: Tensor,
    completion_ids: Tensor,
    pad_id: int,
    temperature: float,
    with_entropy: bool,
    fp32_head: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log π(completion token) [R, T] (differentiable in the decoder and the head when gradients are on) and,
    with `with_entropy`, each position's entropy [R, T]; the numbers of `completion_logprobs(_and_entropy)`.
    `fp32_head`: each block's matmul in float32 under autocast, not the autocast dtype."""
    parts = head_parts(model)
    if parts is None:
        raise ValueError(f"the fused LM head needs one of {sorted(FUSABLE)}, got {type(model).__name__}")
    decoder, head = parts
    if is_sharded(model):
        hidden = sharded_completion_hidden(model, head, prompt_ids, completion_ids, pad_id)
    else:
        hidden = completion_hidden(decoder, prompt_ids, completion_ids, pad_id)
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    if fp32_head and dtype is not None:
        dtype = torch.float32
    logp, entropy = _FusedSelectiveLogSoftmax.apply(
        hidden, head.weight, completion_ids, temperature, dtype, with_entropy
    )
    return logp, entropy if with_entropy else None
