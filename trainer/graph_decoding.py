"""Decoding over a static key/value cache with a loop of our own, each token step replayed as a CUDA graph on a GPU.

Why: at a GRPO batch (512 rows of a 0.5B model) `generate` took 6.8 s for 256 token steps on an H200
(docs/benchmarks.md), about 26 ms a step, where by its arithmetic and memory traffic a step needs a few
milliseconds (an estimate: not measured). `generate` launches every kernel of every layer from Python at each
token step, and transformers before 5.24 also copies the key/value cache per query head (`_packed_sdpa`).
A CUDA graph records one token step's kernels once and replays them with one launch. That needs every tensor the
step reads or writes at a fixed address: transformers' `StaticCache`, and buffers for the step's tokens, positions
and attention mask, which the loop updates in place between replays. transformers' own static cache path compiles
the step with torch.compile instead, which costs tens of seconds for each new batch shape (2026-11-26 in
docs/benchmarks.md); a capture costs two warm-up steps.

On the CPU the same loop runs eagerly, without a graph: that is how the tests check that it samples what
`generate` samples. Sampling itself (temperature, top-p, the multinomial draw) stays outside the graph, on the
same RNG and in the same order as `generate`, so a seed draws the same tokens on either path; row-seeded
sampling (trainer/row_sampling.py) is told each token's index, as `generate` tells its processor.
"""

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from torch import Tensor
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from rlvr.trainer.kv_caches import CACHE_ARGUMENT, static_cache
from rlvr.trainer.logprobs import forward_takes, keeps_last_logits
from rlvr.trainer.prompts import distinct_prompts, padded_positions
from rlvr.trainer.row_sampling import RowSampler

PACKED_SDPA = "rlvr_packed_sdpa"  # the name `packed_attention` registers `_packed_sdpa` under
_MASKS = ("sdpa", "eager", PACKED_SDPA)  # attention implementations whose 4D mask this module builds


def _packed_sdpa(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' sdpa attention, but for one query token a row with grouped key/value heads (Qwen2.5-0.5B: 14
    query heads over 2) it packs each group's query heads along the query axis, [B, H, 1, D] -> [B, KVH, G, D],
    and attends to the cache as it is. transformers before 5.24 repeats the keys and values for every query head
    whenever a mask is given (sdpa's GQA mode takes no mask on CUDA): at 512 rows and a 320-token cache that is
    several GB of copies a token step (an estimate, not measured). Query head h reads key/value head h // G,
    as the repeated cache has it, so the result is the same attention; anything else (more query tokens, one
    head a group, a soft cap, a position bias or attention sinks) goes to transformers'."""
    groups = getattr(module, "num_key_value_groups", 1)
    changes_the_math = any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux"))
    if query.shape[2] != 1 or groups == 1 or changes_the_math:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    rows, heads, _, dim = query.shape
    packed = query.reshape(rows, heads // groups, groups, dim)
    output = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return output.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous(), None


@contextmanager
def packed_attention(model: transformers.PreTrainedModel) -> Iterator[None]:
    """The model's sdpa attention routed through `_packed_sdpa` inside (models on eager attention unchanged; a
    nested call leaves it to the outer one). transformers looks the function up by `config._attn_implementation`
    at every forward, so a CUDA graph captured inside keeps it; training, outside, never sees it (and would get
    plain sdpa from it: it has more than one query token a row). `generate` (the shared-prompt cache) decodes
    inside it too, its 2D masks made into sdpa's 4D ones as before."""
    if model.config._attn_implementation != "sdpa":
        yield
        return
    transformers.AttentionInterface.register(PACKED_SDPA, _packed_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.config._attn_implementation = PACKED_SDPA
    try:
        yield
    finally:
        model.config._attn_implementation = "sdpa"


class _TokenStep:
    """One token step of every row over a static cache, reading only buffers of fixed address: `ids` [B, 1]
    (the tokens fed), `positions` [B, 1] (their position ids), `allowed` [B, 1, 1, L] (which cache slots each row
    attends to) and, for transformers versions whose cache takes it, `slot` [1] (the cache slot written)."""

    def __init__(
        self, model: transformers.PreTrainedModel, cache: transformers.StaticCache, rows: int, length: int
    ) -> None:
        device = next(model.parameters()).device
        self.model, self.cache = model, cache
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.allowed = torch.zeros(rows, 1, 1, length, dtype=torch.bool, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)

    def __call__(self) -> Tensor:
        """The next-token logits [B, V] after `ids`, in the model's output dtype."""
        return last_logits(self.model, self.cache, self.ids, self.positions, self.allowed, self.slot)


def last_logits(
    model: transformers.PreTrainedModel,
    cache: transformers.StaticCache,
    ids: Tensor,
    positions: Tensor,
    allowed: Tensor,
    slots: Tensor,
) -> Tensor:
    """The next-token logits [B, V] of the model on `ids` [B, Q] at `positions` [B, Q], writing cache slots
    `slots` [Q], each query attending to the slots `allowed` [B, 1, Q, L] marks (the other positions' logits
    are not computed where the model can skip them)."""
    extra: dict[str, object] = {"logits_to_keep": 1} if keeps_last_logits(model) else {}
    if forward_takes(model, "cache_position"):
        extra["cache_position"] = slots  # where the forward takes it (5.0's static cache writes where it is told)
    output = model(
        input_ids=ids,
        attention_mask=attention_mask(model, allowed),
        position_ids=positions,
        use_cache=True,
        **{CACHE_ARGUMENT: cache},
        **extra,
    )
    return output.logits[:, -1, :]


def attention_mask(model: transformers.PreTrainedModel, allowed: Tensor) -> Tensor:
    """`allowed` [B, 1, Q, L] as the 4D mask the model's attention takes (transformers passes a 4D mask through
    as it is): boolean for sdpa, additive (0 or float32's minimum) for eager attention."""
    if model.config._attn_implementation in ("sdpa", PACKED_SDPA):
        return allowed
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed, torch.finfo(torch.float32).min)


def check_supported(model: transformers.PreTrainedModel) -> None:
    """A one-line error when the model needs what this loop does not build: another attention implementation's
    mask, or sliding-window layers (whose masks differ per layer)."""
    implementation = model.config._attn_implementation
    if implementation not in _MASKS:
        raise ValueError(
            f"rollout.cache=graph supports sdpa and eager attention, not {implementation!r}; "
            "use rollout.cache=shared_prompt for this model"
        )
    layer_types = getattr(model.config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        raise ValueError("rollout.cache=graph supports models whose layers all use full attention")


def _prompt_inputs(attention_mask_2d: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """Position ids [B, P] of left-padded prompts (as `generate` numbers them) and the slots each prompt
    position may attend to [B, 1, P, L]: the real prompt tokens up to itself. A padding position attends to
    itself only, so that no attention row is empty (an empty one gives NaN, which the cache would keep)."""
    real = attention_mask_2d.bool()
    rows, prompt_length = real.shape
    positions = padded_positions(attention_mask_2d)
    query = torch.arange(prompt_length, device=real.device)
    key = torch.arange(length, device=real.device)
    causal = key[None, :] <= query[:, None]  # [P, L]
    key_real = torch.zeros(rows, length, dtype=torch.bool, device=real.device)
    key_real[:, :prompt_length] = real
    allowed = (causal[None] & key_real[:, None, :]) | (key[None, None, :] == query[None, :, None])
    return positions, allowed.unsqueeze(1)


# One warm-up stream a device, kept: torch keeps a cuBLAS workspace for every stream that ran a matmul.
_warm_up_streams: dict[torch.device, torch.cuda.Stream] = {}
# One capture at a time in the process: with flow.sampler=thread the sampler thread and the trainer's (evaluating)
# can both decode through this loop, and every `torch.cuda.graph` without a stream of its own captures on
# torch's one default capture stream; the warm-up stream is shared too. Replays need no lock.
_capture_lock = threading.Lock()


def _replayable(step: _TokenStep, capture: bool) -> Callable[[], Tensor]:
    """`step` itself, or with `capture` a CUDA graph of it: two warm-up calls on a side stream (they allocate
    the static cache and let cuBLAS pick its kernels), one capture, and the cache emptied again after (the
    warm-up wrote to it; the capture ran nothing). The capture is thread-local: with `flow.sampler=thread` the
    trainer's thread goes on using the GPU meanwhile, which a global capture would refuse, and one thread
    captures at a time (`_capture_lock`). Without `capture` one eager call allocates the cache, emptied after
    the same way."""
    if not capture:
        step()
        step.cache.reset()
        return step
    device = step.ids.device
    with _capture_lock:
        if device not in _warm_up_streams:
            _warm_up_streams[device] = torch.cuda.Stream(device)
        side = _warm_up_streams[device]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = step()
    step.cache.reset()

    def replay() -> Tensor:
        graph.replay()
        return logits

    return replay


def _prefilled(
    model: transformers.PreTrainedModel,
    input_ids: Tensor,
    attention_mask_2d: Tensor,
    max_new_tokens: int,
    capture: bool | None,
) -> tuple[_TokenStep, Callable[[], Tensor], Tensor]:
    """A token step over a new static cache, what runs it (its CUDA graph when captured), and the prompts'
    next-token logits [B, V], the prompts written to the cache and the step's buffers set for the first new token."""
    rows, prompt_length = input_ids.shape
    length = prompt_length + max_new_tokens
    cache = static_cache(model, length)
    step = _TokenStep(model, cache, rows, length)
    run = _replayable(step, input_ids.device.type == "cuda" if capture is None else capture)
    logits = _prefill_distinct(model, cache, input_ids, attention_mask_2d)
    step.allowed[:, 0, 0, :prompt_length] = attention_mask_2d.bool()
    # the last prompt token's position and slot: each step adds one first
    step.positions.copy_(padded_positions(attention_mask_2d)[:, -1:])
    step.slot.fill_(prompt_length - 1)
    return step, run, logits


def _prefill_distinct(
    model: transformers.PreTrainedModel, cache: transformers.StaticCache, input_ids: Tensor, attention_mask_2d: Tensor
) -> Tensor:
    """The prompts [B, P] written to the first P slots of `cache` (allocated, empty), and their next-token logits
    [B, V], each distinct prompt computed once (a GRPO batch samples every prompt many times: at 64 x 8 rows
    that is an eighth of the prefill's work and of its activations' memory) and copied to the rows that repeat it.

    The copy writes transformers' cache layers directly (`keys`, `values`, and the write position that 5.17 and
    later keep in the cache, `cumulative_length`): tests/test_graph_decoding.py holds the result to `generate`'s
    at 5.0, 5.17 and 5.24."""
    prompt_length = input_ids.shape[1]
    first_row, row_to_distinct = distinct_prompts(input_ids, attention_mask_2d)
    ids, mask = input_ids[first_row], attention_mask_2d[first_row]
    prompts = static_cache(model, prompt_length)
    positions, allowed = _prompt_inputs(mask, prompt_length)
    slots = torch.arange(prompt_length, device=input_ids.device)
    logits = last_logits(model, prompts, ids, positions, allowed, slots)
    # static layers both; typed Any, as mypy sees the union of every layer kind transformers has
    layers: list[Any] = list(cache.layers)
    computed_layers: list[Any] = list(prompts.layers)
    for layer, computed in zip(layers, computed_layers, strict=True):
        layer.keys[:, :, :prompt_length].copy_(computed.keys.index_select(0, row_to_distinct))
        layer.values[:, :, :prompt_length].copy_(computed.values.index_select(0, row_to_distinct))
        if isinstance(getattr(layer, "cumulative_length", None), Tensor):
            layer.cumulative_length.fill_(prompt_length)
    return logits.index_select(0, row_to_distinct)


def decode(
    model: transformers.PreTrainedModel,
    input_ids: Tensor,
    attention_mask_2d: Tensor,
    max_new_tokens: int,
    choose: Callable[[Tensor], Tensor] | RowSampler,
    *,
    eos_ids: list[int],
    pad_id: int,
    logprob_temperature: float | None = None,
    min_new_tokens: int = 0,
    capture: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Generated tokens [B, T <= max_new_tokens] after the left-padded prompts `input_ids` [B, P], each row
    padded with `pad_id` after its first eos (as `generate` pads), and, with `logprob_temperature`, each token's
    log-probability [B, T] under the raw logits at that temperature (else None).

    `choose` maps the float32 next-token logits [B, V] to the chosen tokens [B] (`sampler` or an argmax); a
    `RowSampler` is given the token's index among the new ones too.
    No eos is chosen before `min_new_tokens` (as `generate`'s processor bars it, before the log-probs).
    The loop stops when every row has ended, looked at every 8 steps (each look waits for the GPU).
    `capture`: replay the token step as a CUDA graph (default: when the model is on a GPU; False runs the same
    loop eagerly there, which the GPU tests compare it with).
    Call it under `torch.no_grad()` and the sampling autocast, which the graph's capture records.
    """
    check_supported(model)
    with packed_attention(model):
        step, run, logits = _prefilled(model, input_ids, attention_mask_2d, max_new_tokens, capture)
        rows, prompt_length = input_ids.shape
        eos = torch.tensor(eos_ids, device=input_ids.device)
        unfinished = torch.ones(rows, dtype=torch.bool, device=input_ids.device)
        tokens, logprobs = [], []
        for index in range(max_new_tokens):
            if index:
                logits = run()
            scores = logits.float()
            if index < min_new_tokens:
                scores[:, eos] = float("-inf")
            drawn = choose(scores, index) if isinstance(choose, RowSampler) else choose(scores)
            chosen = torch.where(unfinished, drawn, pad_id)
            if logprob_temperature is not None:
                logprobs.append(
                    torch.log_softmax(scores / logprob_temperature, dim=-1).gather(1, chosen[:, None])[:, 0]
                )
            tokens.append(chosen)
            unfinished &= ~torch.isin(chosen, eos)
            if index + 1 == max_new_tokens or (index % 8 == 7 and not bool(unfinished.any())):
                break
            step.ids[:, 0] = chosen
            step.allowed[:, 0, 0, prompt_length + index] = True
            step.positions += 1
            step.slot += 1
        return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1) if logprobs else None


def sampler(temperature: float, top_p: float) -> Callable[[Tensor], Tensor]:
    """The draw `generate` makes with `do_sample=True, top_k=0`: the temperature warper (when not 1), top-p (when
    below 1), softmax, one multinomial sample a row, on torch's RNG for the logits' device."""
    warpers = transformers.LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(transformers.TemperatureLogitsWarper(temperature))
    if top_p < 1.0:
        warpers.append(transformers.TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))

    def choose(scores: Tensor) -> Tensor:
        probs = torch.softmax(warpers(None, scores), dim=-1)
        return torch.multinomial(probs, num_samples=1)[:, 0]

    return choose
