"""Rollouts with transformers `generate`: seeded sampling of ragged groups, and greedy decoding for evals.

A sample keeps its token ids (what the loss trains on), its decoded text (what verifiers score) and
why it ended, so that rewards, length statistics and the loss all see the same completion.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import transformers

from rlvr.trainer.graph_decoding import decode, packed_attention, sampler
from rlvr.trainer.kv_caches import CACHE_ARGUMENT, dynamic_cache, static_cache
from rlvr.trainer.lockstep_decoding import Lockstep, Round
from rlvr.trainer.logprobs import keeps_last_logits
from rlvr.trainer.policy import Policy
from rlvr.trainer.prompts import distinct_prompts, padded_positions, prompt_ids
from rlvr.trainer.rng import seeded_rng
from rlvr.trainer.row_sampling import RowSampler, row_key


@dataclass
class Sample:
    """One completion of one prompt.

    `completion_ids` are the generated tokens up to and including the first eos (nothing after it);
    `text` is their decoding without special tokens; `n_tokens` = len(completion_ids);
    `finish_reason` is "stop" when an eos was generated, "length" when max_new_tokens ran out; `logprobs`, when
    set, are the behaviour policy's log-probabilities of the completion tokens (the trainer's π_old).
    """

    prompt_index: int
    sample_index: int
    completion_ids: list[int]
    text: str
    n_tokens: int
    finish_reason: Literal["stop", "length"]
    logprobs: list[float] | None = None  # the sampling policy's per token, when stored (flow.async_level > 0)


def _eos_ids(policy: Policy) -> set[int]:
    eos = policy.model.generation_config.eos_token_id
    if eos is None:
        eos = policy.tokenizer.eos_token_id
    return set(eos) if isinstance(eos, list) else {eos}


Cache = Literal["shared_prompt", "static", "graph"]

# A model's generation_config can carry settings that change what `generate` draws (instruct models ship a
# repetition penalty, top-k or beams). Rollouts must sample from the policy itself at the run's temperature and
# top-p: that is the distribution the loss's π_old and ratios assume (TRL overrides them too). So every call sets
# them to these neutral values (those this transformers has); `min_new_tokens` is left to the model (the
# benchmarks set it to fix lengths).
_NEUTRAL: dict[str, Any] = {
    "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_length": 0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "num_beams": 1, "renormalize_logits": False, "bad_words_ids": None, "sequence_bias": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "min_p": None, "exponential_decay_length_penalty": None, "top_h": None, "guidance_scale": None,
    "watermarking_config": None,
}  # fmt: skip
POLICY_ONLY = {key: value for key, value in _NEUTRAL.items() if hasattr(transformers.GenerationConfig(), key)}
# generation_config keys that the call itself sets (the rest of rollout's settings) or that never change a draw.
_SET_BY_THE_CALL = {
    "do_sample", "temperature", "top_p", "top_k", "max_length", "max_new_tokens", "pad_token_id", "bos_token_id",
    "eos_token_id", "use_cache", "output_attentions", "output_hidden_states", "output_scores", "output_logits",
    "return_dict_in_generate", "cache_implementation", "transformers_version", "_from_model_config",
}  # fmt: skip
Precision = Literal["auto", "weights", "bf16"]


def sampling_autocast(policy: Policy, precision: Precision = "auto") -> torch.autocast:
    """The autocast that decoding runs under. "weights": none, the weights' own dtype. "bf16": bfloat16 autocast
    on the model's device. "auto": bf16 when float32 weights sit on a GPU (as TRL samples with `bf16=True`: half
    the key/value cache, tensor-core matmuls; see docs/training.md), else none, so that CPU sampling, and
    everything that reproduces it, is unchanged.

    Without autocast's cast cache: with it, the bf16 copy of every weight made at the first decoding step
    stays until `generate` returns (0.92 GiB at 0.5B parameters, about what the rollout's peak topped training's
    by on an H200); without it each forward casts again (3 GB of memory traffic a token step at 0.5B: by that
    count about 2% of a decoding step there, not measured), as TRL's sampler does: accelerate enters autocast per
    forward call."""
    device_type = policy.model.device.type
    if precision == "auto":
        precision = "bf16" if device_type == "cuda" and policy.model.dtype == torch.float32 else "weights"
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision == "bf16", cache_enabled=False)


class TokenLogprobs(transformers.LogitsProcessor):
    """Records, while `generate` decodes, each generated token's log-probability under the model's raw logits at
    `temperature` (before top-p and the sampling temperature): the π_old that the train stage would compute,
    without a second forward pass over the completions.

    transformers runs custom processors before its sampling warpers, so `scores` here are the model's logits (the
    model's own processors are set neutral by POLICY_ONLY, all but `min_new_tokens`, which bars eos first).
    A call sees the tokens chosen so far: it scores the previous call's choice, and `finish` the last one.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self._pending: torch.Tensor | None = None  # [B, V] log-probs of the next token, not chosen yet
        self.columns: list[torch.Tensor] = []  # one [B] per generated token

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._pending is not None:
            self._take(input_ids[:, -1])
        self._pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _take(self, chosen: torch.Tensor) -> None:
        assert self._pending is not None
        self.columns.append(self._pending.gather(1, chosen.unsqueeze(1)).squeeze(1))
        self._pending = None

    def finish(self, last_tokens: torch.Tensor) -> list[list[float]]:
        """Every row's log-probs [B][new tokens], given the last generated column."""
        if self._pending is not None:
            self._take(last_tokens)
        return torch.stack(self.columns, dim=1).tolist() if self.columns else []


class RowSampledScores(transformers.LogitsProcessor):
    """Row-seeded sampling inside greedy `generate`: the scores become 0 at the token `choose` draws from them and
    -inf elsewhere, so `generate`'s argmax takes that token. Last in the list: after the model's own processors
    (`min_new_tokens` bars eos first) and the `TokenLogprobs` recorder, which so still sees the raw logits.
    A call's position is the number of tokens generated so far: `input_ids` holds the prompts, left-padded to
    `prompt_width`, and the tokens chosen before."""

    def __init__(self, choose: RowSampler, prompt_width: int) -> None:
        self.choose, self.prompt_width = choose, prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        chosen = self.choose(scores.float(), input_ids.shape[1] - self.prompt_width)
        return torch.full_like(scores, float("-inf")).scatter_(1, chosen[:, None], 0.0)  # type: ignore[return-value]


def _generate(
    policy: Policy,
    prompts: list[str],
    max_new_tokens: int,
    cache: Cache = "shared_prompt",
    precision: Precision = "auto",
    recorder: TokenLogprobs | None = None,
    row_sampler: RowSampler | None = None,
    **sampling: Any,
) -> tuple[list[list[int]], list[list[float]]]:
    """New tokens per prompt row, cut after the first eos (the eos is kept), and, with a `recorder`, their
    log-probs cut the same way (else no rows). With a `row_sampler` each token is its draw (`sampling` then
    asks for greedy decoding, which it replaces). The prompts are read as the model reads them
    (trainer/prompts.py), then decoded by `_generate_ids`.

    `cache`: "shared_prompt" computes each distinct prompt's key/value cache once for all the rows that repeat it
    (`_shared_prompt_cache`); "static" asks transformers for a static key/value cache of the batch's full length,
    which transformers compiles on a GPU (a slow first call, then fast decoding; on the CPU only the cache changes);
    "graph" runs our own loop over a static cache, each token step a CUDA graph on a GPU (trainer/graph_decoding.py).
    `precision`: see `sampling_autocast`.
    """
    if not prompts:
        return [], []
    rows = prompt_ids(policy.tokenizer, prompts)
    return _generate_ids(policy, rows, max_new_tokens, cache, precision, recorder, row_sampler, **sampling)


def _generate_ids(
    policy: Policy,
    rows: list[list[int]],
    max_new_tokens: int,
    cache: Cache = "shared_prompt",
    precision: Precision = "auto",
    recorder: TokenLogprobs | None = None,
    row_sampler: RowSampler | None = None,
    **sampling: Any,
) -> tuple[list[list[int]], list[list[float]]]:
    """`_generate` from token-id rows (each row's whole context, unpadded): what the multi-turn loop
    (trainer/episodes.py) decodes from, since it keeps a conversation's tokens and never re-tokenizes them.
    The rows are left-padded into one batch."""
    if not rows:
        return [], []
    encoded = policy.tokenizer.pad({"input_ids": rows}, return_tensors="pt")
    encoded = encoded.to(policy.model.device)
    with torch.no_grad(), sampling_autocast(policy, precision), packed_attention(policy.model):
        if policy.lockstep is not None and cache == "graph":
            raise ValueError("rollout.cache=graph decodes from whole weights, not in lockstep over sharded units")
        if cache == "graph":
            generated, token_logprobs = _graph_generate(
                policy, encoded, max_new_tokens, recorder, row_sampler, **sampling
            )
        else:
            generated = _transformers_generate(
                policy, encoded, max_new_tokens, cache, recorder, row_sampler, **sampling
            )
            token_logprobs = recorder.finish(generated[:, -1]) if recorder and generated.shape[1] else []
    eos = _eos_ids(policy)
    completions, logprobs = [], []
    for row_index, row in enumerate(generated.tolist()):
        end = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        completions.append(row[:end])
        if token_logprobs:
            logprobs.append(token_logprobs[row_index][:end])
    return completions, logprobs


def _transformers_generate(
    policy: Policy,
    encoded: Any,
    max_new_tokens: int,
    cache: Cache,
    recorder: TokenLogprobs | None,
    row_sampler: RowSampler | None,
    **sampling: Any,
) -> torch.Tensor:
    """`generate`'s new tokens [B, T] (pad after each row's eos) for the padded prompts `encoded`; for a policy
    decoding in lockstep with other ranks (`policy.lockstep`), in one round with them."""
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    agreed = Round(prefills=False, new_tokens=max_new_tokens)
    if policy.lockstep is not None:
        prefills = _prefills(policy, ids, mask, cache)
        agreed = policy.lockstep.open_round(prefills, max_new_tokens)
        if agreed.prefills and not prefills:  # another rank's prefill forward, matched
            policy.lockstep.idle_forward()
    if cache == "static":  # sized for the round: a rank's forwards run on while any rank decodes
        caching: dict[str, Any] = {CACHE_ARGUMENT: static_cache(policy.model, ids.shape[1] + agreed.new_tokens)}
    else:
        caching = {CACHE_ARGUMENT: _shared_prompt_cache(policy, ids, mask)}
    prompt_width = encoded["input_ids"].shape[1]
    processors: list[transformers.LogitsProcessor] = [recorder] if recorder else []
    if row_sampler is not None:
        processors.append(RowSampledScores(row_sampler, prompt_width))
    output = policy.model.generate(
        **encoded,
        max_new_tokens=max_new_tokens,
        pad_token_id=policy.tokenizer.pad_token_id,
        eos_token_id=sorted(_eos_ids(policy)),
        # Each token step synced over the ranks only in a lockstep round (trainer/lockstep_decoding.py); else never,
        # not even for an FSDP-managed model decoding from whole weights (transformers would sync it by default).
        synced_gpus=policy.lockstep is not None,
        **caching,
        **({"logits_processor": transformers.LogitsProcessorList(processors)} if processors else {}),
        **POLICY_ONLY,
        **sampling,
    )
    return output[:, prompt_width:]


def _graph_generate(
    policy: Policy,
    encoded: Any,
    max_new_tokens: int,
    recorder: TokenLogprobs | None,
    row_sampler: RowSampler | None,
    *,
    do_sample: bool,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[torch.Tensor, list[list[float]]]:
    """The new tokens [B, T] and, with a `recorder`, their log-probs [B][T] from our static-cache loop
    (trainer/graph_decoding.py), which draws what `generate` draws for the same sampling settings (with a
    `row_sampler`, its draws)."""
    if top_k:
        raise ValueError("rollout.cache=graph samples without top-k (top_k=0)")
    choose: Callable[[torch.Tensor], torch.Tensor] | RowSampler
    if row_sampler is not None:
        choose = row_sampler
    else:
        choose = sampler(temperature, top_p) if do_sample else (lambda scores: scores.argmax(dim=-1))
    generated, logprobs = decode(
        policy.model,
        encoded["input_ids"],
        encoded["attention_mask"],
        max_new_tokens,
        choose,
        eos_ids=sorted(_eos_ids(policy)),
        pad_id=policy.tokenizer.pad_token_id,
        logprob_temperature=recorder.temperature if recorder else None,
        min_new_tokens=_graph_min_new_tokens(policy),
    )
    return generated, logprobs.tolist() if logprobs is not None else []


def _graph_min_new_tokens(policy: Policy) -> int:
    """The model's `generation_config.min_new_tokens` (0 when unset), the one setting there that `generate` applies
    beyond the call's own and POLICY_ONLY; a one-line error naming any other setting that `generate` might
    apply and the graph loop would not."""
    settings = policy.model.generation_config.to_diff_dict()
    others = sorted(set(settings) - _SET_BY_THE_CALL - set(POLICY_ONLY) - {"min_new_tokens"})
    if others:
        named = ", ".join(f"{key}={settings[key]!r}" for key in others)
        raise ValueError(
            f"rollout.cache=graph does not apply the model's generation_config {named}; use "
            "rollout.cache=shared_prompt, or remove them from the model's generation_config.json"
        )
    return int(settings.get("min_new_tokens") or 0)


def _shared_prompt_cache(policy: Policy, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
    """The key/value cache of every row's prompt but its last token, computed once per distinct prompt and
    copied to the rows that share it; an empty cache when no prompt repeats (or prompts are one token long),
    and None for a model configured not to cache. Its keys are kept in the values' dtype (trainer/kv_caches.py;
    None there too: `generate` or the forward makes the model's own kind of cache).

    A GRPO batch samples each prompt many times; `generate` given this cache runs only the last prompt token
    and the new ones per row, so the prompt's forward pass is paid once per group instead of once per sample.
    The rows' token ids, mask and positions are the ones `generate` itself would use, so sampling draws the
    same tokens (asserted against the uncached path in tests/test_trainer.py).
    """
    if not policy.model.config.use_cache:
        return None
    cache = dynamic_cache(policy.model)
    if not _prefills(policy, input_ids, attention_mask, "shared_prompt"):
        return cache
    first_row, row_to_distinct = distinct_prompts(input_ids, attention_mask)
    mask = attention_mask[first_row, :-1]
    positions = padded_positions(mask)
    keep_last = {"logits_to_keep": 1} if keeps_last_logits(policy.model) else {}  # its logits are not used
    output = policy.model(
        input_ids=input_ids[first_row, :-1],
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        **({CACHE_ARGUMENT: cache} if cache is not None else {}),
        **keep_last,
    )
    prefix = getattr(output, CACHE_ARGUMENT)
    prefix.batch_select_indices(row_to_distinct)
    return prefix


def _prefills(policy: Policy, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: Cache) -> bool:
    """Whether `_shared_prompt_cache` runs a forward of its own for these rows: some prompt, of two tokens or more,
    repeats."""
    if cache != "shared_prompt" or not policy.model.config.use_cache or input_ids.shape[1] < 2:
        return False
    return bool(distinct_prompts(input_ids, attention_mask)[0].shape[0] < input_ids.shape[0])


def lockstep_for(policy: Policy) -> Lockstep:
    """The rounds of a decoding operation over a sharded `policy`, its idle passes on one pad token (trainer/
    lockstep_decoding.py). Set it as `policy.lockstep` for the operation, under `torch.no_grad()`."""
    model, pad_id = policy.model, policy.tokenizer.pad_token_id
    token = torch.full((1, 1), pad_id, dtype=torch.long, device=model.device)

    def idle_forward() -> None:
        model(input_ids=token, use_cache=False)

    def idle_generate() -> None:
        model.generate(
            input_ids=token, attention_mask=torch.ones_like(token), max_new_tokens=1,
            do_sample=False, pad_token_id=pad_id, eos_token_id=sorted(_eos_ids(policy)), synced_gpus=True,
            **POLICY_ONLY,
        )  # fmt: skip

    return Lockstep(model.device, idle_forward, idle_generate)


def _decode(policy: Policy, ids: list[int]) -> str:
    return str(policy.tokenizer.decode(ids, skip_special_tokens=True))


def sample(
    policy: Policy,
    prompts: list[str],
    counts: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    cache: Cache = "shared_prompt",
    precision: Precision = "auto",
    logprob_temperature: float | None = None,
    row_keys: Sequence[int] | None = None,
) -> list[Sample]:
    """`counts[i]` samples of `prompts[i]` (ragged, zero allowed), grouped by prompt in order (`cache`,
    `precision`: see `_generate`). With `logprob_temperature`, each sample carries its tokens' log-probs under
    the raw logits at that temperature (`TokenLogprobs`); the samples drawn are the same either way.

    All rows are generated in one batch. Without `row_keys` they draw from torch's RNG, seeded with `seed`
    inside `fork_rng`: the same call gives the same samples in any process and the caller's RNG state is
    untouched, but a row's tokens depend on the rows beside it. With `row_keys` (one distinct int a prompt, such
    as its index among all of a step's prompts) sample j of prompt i draws with the key (seed, row_keys[i], j)
    (trainer/row_sampling.py): the same tokens in any batch that holds it, given the same logits, which lets
    data-parallel ranks split a step's prompts without changing what is sampled. torch's RNG is not used.

    A policy sharded over data-parallel ranks (`policy.ranks`) is sampled by all of them, each its share of the
    prompts, row-seeded (keys: `row_keys`, else each prompt's index here).
    """
    if policy.ranks is not None and not policy.ranks.in_op:
        settings: dict[str, Any] = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        settings.update(seed=seed, cache=cache, precision=precision, logprob_temperature=logprob_temperature)
        keys = list(row_keys) if row_keys is not None else list(range(len(prompts)))
        return list(policy.ranks.sample(list(prompts), list(counts), settings, keys))
    _check_sampling(prompts, counts, temperature)
    rows = [(prompt_index, sample_index) for prompt_index, count in enumerate(counts) for sample_index in range(count)]
    recorder = None if logprob_temperature is None else TokenLogprobs(logprob_temperature)
    row_prompts = [prompts[prompt_index] for prompt_index, _ in rows]
    if row_keys is None:
        with seeded_rng(seed, policy.model.device):
            completions, logprobs = _generate(
                policy, row_prompts, max_new_tokens, cache, precision, recorder,
                do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
            )  # fmt: skip
    else:
        if len(row_keys) != len(prompts) or len(set(row_keys)) != len(row_keys):
            raise ValueError(f"row_keys must be {len(prompts)} distinct ints, one a prompt; got {list(row_keys)}")
        keys = [row_key(seed, row_keys[prompt_index], sample_index) for prompt_index, sample_index in rows]
        drawn = RowSampler(temperature, top_p, keys)
        completions, logprobs = _generate(
            policy, row_prompts, max_new_tokens, cache, precision, recorder, drawn, do_sample=False
        )
    return _samples(policy, rows, completions, logprobs)


def _check_sampling(prompts: list[str], counts: list[int], temperature: float) -> None:
    if len(prompts) != len(counts):
        raise ValueError(f"{len(prompts)} prompts but {len(counts)} counts")
    if any(count < 0 for count in counts):
        raise ValueError(f"counts must be >= 0, got {counts}")
    if temperature <= 0:
        raise ValueError("temperature must be > 0 for sampling; use greedy() for deterministic decoding")


def _samples(
    policy: Policy, rows: list[tuple[int, int]], completions: list[list[int]], logprobs: list[list[float]]
) -> list[Sample]:
    """Each (prompt index, sample index) row's completion as a `Sample`, decoded, with why it ended."""
    eos = _eos_ids(policy)
    return [
        Sample(
            prompt_index=prompt_index,
            sample_index=sample_index,
            completion_ids=ids,
            text=_decode(policy, ids),
            n_tokens=len(ids),
            finish_reason="stop" if ids and ids[-1] in eos else "length",
            logprobs=logprobs[row] if logprobs else None,
        )
        for row, ((prompt_index, sample_index), ids) in enumerate(zip(rows, completions))
    ]


def greedy(policy: Policy, prompts: list[str], *, max_new_tokens: int, cache: Cache = "shared_prompt") -> list[str]:
    """Greedy completions, decoded and cut at eos: the deterministic answer used for accuracy evals (by every
    data-parallel rank, each its share, for a policy sharded over them)."""
    if policy.ranks is not None and not policy.ranks.in_op:
        return list(policy.ranks.greedy(list(prompts), {"max_new_tokens": max_new_tokens, "cache": cache}))
    completions, _ = _generate(policy, prompts, max_new_tokens, cache, do_sample=False)
    return [_decode(policy, ids) for ids in completions]
