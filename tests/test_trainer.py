"""Trainer library: GRPO algebra against hand-computed values, and the tiny model trained for real."""

import math
import traceback

import pytest
import torch

from rlvr.errors import UserError
from rlvr.trainer.generation import Sample, greedy, sample
from rlvr.trainer.grpo import (
    GRPOConfig,
    RolloutBatch,
    behaviour_logprobs,
    clipped_surrogate_loss,
    completion_logprobs,
    effective_ratio,
    group_advantages,
    grpo_step,
)
from rlvr.trainer.policy import (
    PolicyConfig,
    init_policy,
    load_optimizer_state,
    make_optimizer,
    optimizer_state_bytes,
    policy_files,
    policy_from_files,
)
from rlvr.trainer.sft import sft_warmstart
from rlvr.trainer.tiny_model import VOCAB, TinyModelConfig, build_tiny_model, build_tiny_tokenizer

ADDITION = [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]


@pytest.fixture
def policy():
    return init_policy(PolicyConfig(), seed=0)


# --- group advantages and effective ratio -------------------------------------------------------

# Groups: 0 = {1, 0, 0} (mixed, size 3), 1 = {2, 2} (uniform), 2 = {5} (alone), 3 = {1, 3} (mixed).
RAGGED_REWARDS = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 5.0, 1.0, 3.0])
RAGGED_GROUPS = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3])


def test_group_advantages_ragged_population_std():
    # Group 0: mean 1/3, population std sqrt(2)/3 -> (2/3)/(sqrt(2)/3) = sqrt(2), (-1/3)/(sqrt(2)/3) = -1/sqrt(2).
    # Group 3: mean 2, population std 1 -> -1, +1. Uniform and single groups -> 0.
    expected = torch.tensor([math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2), 0.0, 0.0, 0.0, -1.0, 1.0])
    got = group_advantages(RAGGED_REWARDS, RAGGED_GROUPS)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_group_advantages_without_std_and_with_unordered_ids():
    got = group_advantages(RAGGED_REWARDS, RAGGED_GROUPS, scale="none")
    torch.testing.assert_close(got, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0, -1.0, 1.0]))
    # Group ids need be neither contiguous nor sorted.
    got = group_advantages(torch.tensor([3.0, 0.0, 1.0, 1.0]), torch.tensor([7, 2, 7, 2]), scale="none")
    torch.testing.assert_close(got, torch.tensor([1.0, -0.5, -1.0, 0.5]))


def test_effective_ratio_counts_groups_with_different_rewards():
    assert effective_ratio(RAGGED_REWARDS, RAGGED_GROUPS) == 0.5  # groups 0 and 3 of 4
    assert (
        effective_ratio(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([5, 5, 9, 9])) == 0.5
    )  # absent ids not counted
    assert effective_ratio(torch.tensor([0.0, 0.0]), torch.tensor([0, 0])) == 0.0


# --- clipped surrogate ----------------------------------------------------------------------------

# Sequence 0 has A = +1 and ratios 1.1 (inside), 1.5 (above 1 + 0.2: clipped to 1.2), 0.5 (below, but
# for A > 0 the unclipped 0.5 is the minimum: not clipped). Sequence 1 has A = -1 and ratios 0.5
# (clipped to 0.8, the minimum of -0.5 and -0.8), 1.5 (unclipped -1.5 is the minimum), then padding.
RATIOS = torch.tensor([[1.1, 1.5, 0.5], [0.5, 1.5, 1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADVANTAGES = torch.tensor([1.0, -1.0])


def _surrogate(aggregation, clip_high=0.2):
    logp = RATIOS.log().requires_grad_(True)
    loss, stats = clipped_surrogate_loss(
        logp, torch.zeros(2, 3), ADVANTAGES, MASK, clip_low=0.2, clip_high=clip_high, aggregation=aggregation
    )
    return logp, loss, stats


def test_clipped_surrogate_hand_computed():
    # Per-token losses: seq 0 = [-1.1, -1.2, -0.5], seq 1 = [+0.8, +1.5].
    _, loss, stats = _surrogate("seq-mean-token-mean")
    assert loss.item() == pytest.approx(((-1.1 - 1.2 - 0.5) / 3 + (0.8 + 1.5) / 2) / 2, abs=1e-6)
    assert stats["clip_fraction"] == pytest.approx(2 / 5)
    k3 = [(r - 1) - math.log(r) for r in (1.1, 1.5, 0.5, 0.5, 1.5)]
    assert stats["approx_kl"] == pytest.approx(sum(k3) / 5, abs=1e-6)
    _, loss, _ = _surrogate("token-mean")
    assert loss.item() == pytest.approx((-1.1 - 1.2 - 0.5 + 0.8 + 1.5) / 5, abs=1e-6)


def test_clipped_tokens_and_padding_get_no_gradient():
    logp, loss, _ = _surrogate("token-mean")
    loss.backward()
    grad = logp.grad
    assert grad[0, 1] == 0 and grad[1, 0] == 0  # clipped
    assert grad[1, 2] == 0  # padding
    # d(-ρA)/d logp = -ρA / 5 tokens where unclipped.
    torch.testing.assert_close(grad[0, 0], torch.tensor(-1.1 / 5))
    torch.testing.assert_close(grad[1, 1], torch.tensor(1.5 / 5))


def test_clip_higher_widens_the_upper_bound_only():
    _, loss, stats = _surrogate("seq-mean-token-mean", clip_high=0.6)
    # Ratio 1.5 with A > 0 is now inside [0.8, 1.6]: seq 0 = [-1.1, -1.5, -0.5].
    assert loss.item() == pytest.approx(((-1.1 - 1.5 - 0.5) / 3 + (0.8 + 1.5) / 2) / 2, abs=1e-6)
    assert stats["clip_fraction"] == pytest.approx(1 / 5)


# --- tokenizer, model, policy files, optimizer state ----------------------------------------------


def test_tokenizer_encodes_characters_with_bos_and_round_trips(tmp_path):
    tokenizer = build_tiny_tokenizer()
    assert len(VOCAB) == 18 and tokenizer.vocab_size == 18
    assert tokenizer("3+4=")["input_ids"] == [1, 7, 14, 8, 17]  # <s> 3 + 4 =
    assert tokenizer("7", add_special_tokens=False)["input_ids"] == [11]
    batch = tokenizer(["3+4=", "12*3="], padding=True)["input_ids"]
    assert batch == [[0, 1, 7, 14, 8, 17], [1, 5, 6, 16, 7, 17]]  # left padding with <pad>
    assert tokenizer.decode([1, 11, 2, 0], skip_special_tokens=True) == "7"
    tokenizer.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("3+4=")["input_ids"] == [1, 7, 14, 8, 17]
    assert loaded.padding_side == "left"
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id, loaded.unk_token_id) == (0, 1, 2, 3)


def test_tiny_model_init_depends_on_seed_only_and_keeps_global_rng():
    state = torch.random.get_rng_state()
    first, again, other = (build_tiny_model(TinyModelConfig(), seed) for seed in (0, 0, 1))
    assert torch.equal(state, torch.random.get_rng_state())
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert first.lm_head.weight is first.model.embed_tokens.weight
    assert first.dtype == torch.float32


def test_policy_files_round_trip_identical_weights_and_outputs(policy):
    sft_warmstart(policy, make_optimizer(policy, 3e-3, 0.0), ADDITION[:30], steps=5, batch_size=16, seed=0)
    files = policy_files(policy)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    restored = policy_from_files(files)
    before, after = policy.model.state_dict(), restored.model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert restored.model.lm_head.weight is restored.model.model.embed_tokens.weight
    prompts = [prompt for prompt, _ in ADDITION[::7]]
    assert greedy(restored, prompts, max_new_tokens=3) == greedy(policy, prompts, max_new_tokens=3)


@pytest.mark.parametrize("fused", [False, True])
def test_optimizer_state_round_trip(policy, fused):
    """Saved and loaded into the same kernel, the next steps are exact. Loaded into the fused kernel (a GPU's:
    `make_optimizer`), the state keeps that kernel rather than taking the saving one's, with the same moments and
    step count (the two kernels differ in rounding), and saved again it loads back into the loop."""
    examples = ADDITION[:30]
    optimizer = make_optimizer(policy, 3e-3, 0.01)
    sft_warmstart(policy, optimizer, examples, steps=3, batch_size=8, seed=0)
    files, state = policy_files(policy), optimizer_state_bytes(optimizer)

    restored = policy_from_files(files)
    restored_optimizer = make_optimizer(restored, 3e-3, 0.01)
    if fused:
        params = restored_optimizer.param_groups[0]["params"]
        restored_optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01, fused=True)
    load_optimizer_state(restored_optimizer, state)
    assert restored_optimizer.param_groups[0]["fused"] is (True if fused else None)
    assert {s["step"].item() for s in restored_optimizer.state.values()} == {3.0}

    sft_warmstart(policy, optimizer, examples, steps=2, batch_size=8, seed=1)
    sft_warmstart(restored, restored_optimizer, examples, steps=2, batch_size=8, seed=1)
    tolerance = 1e-5 if fused else 0.0
    for (name, a), b in zip(policy.model.state_dict().items(), restored.model.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=tolerance, msg=name)

    back = make_optimizer(policy, 3e-3, 0.01)
    load_optimizer_state(back, optimizer_state_bytes(restored_optimizer))
    assert back.param_groups[0]["fused"] is None and back.param_groups[0]["foreach"] is None


def test_init_policy_loads_a_local_model_directory(policy, tmp_path):
    for name, data in policy_files(policy).items():
        (tmp_path / name).write_bytes(data)
    loaded = init_policy(PolicyConfig(model=str(tmp_path)), seed=123)  # the seed does not re-initialise weights
    assert loaded.source == str(tmp_path.resolve())
    assert all(
        torch.equal(a, b) for a, b in zip(policy.model.state_dict().values(), loaded.model.state_dict().values())
    )
    assert loaded.tokenizer("3+4=")["input_ids"] == [1, 7, 14, 8, 17]


def test_missing_local_directory_is_a_one_line_user_error(tmp_path):
    with pytest.raises(UserError) as error:
        init_policy(PolicyConfig(model=str(tmp_path / "no-such-model")), seed=0)
    assert "no-such-model" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(UserError) as error:
        init_policy(PolicyConfig(model="no-such-org-rlvr/no-such-model-rlvr"), seed=0)
    assert "download" in str(error.value) and "\n" not in str(error.value)


# --- generation -------------------------------------------------------------------------------------


def test_sample_is_seeded_ragged_and_leaves_global_rng_alone(policy, monkeypatch):
    prompts = ["3+4=", "1+1=", "9+9="]
    state = torch.random.get_rng_state()
    stacks = []  # torch.manual_seed formats one per call for its lazy CUDA seeding, even without CUDA
    monkeypatch.setattr(traceback, "format_stack", lambda *args: stacks.append(1) or [])
    kwargs = dict(max_new_tokens=4, temperature=1.0, top_p=1.0)
    first = sample(policy, prompts, [2, 0, 3], seed=11, **kwargs)
    assert torch.equal(state, torch.random.get_rng_state())
    assert stacks == []
    assert [(s.prompt_index, s.sample_index) for s in first] == [(0, 0), (0, 1), (2, 0), (2, 1), (2, 2)]
    assert sample(policy, prompts, [2, 0, 3], seed=11, **kwargs) == first
    others = [sample(policy, prompts, [2, 0, 3], seed=seed, **kwargs) for seed in (12, 13)]
    assert any([s.completion_ids for s in other] != [s.completion_ids for s in first] for other in others)
    eos = policy.tokenizer.eos_token_id
    for s in first:
        assert s.n_tokens == len(s.completion_ids) and 1 <= s.n_tokens <= 4
        assert eos not in s.completion_ids[:-1]
        assert s.finish_reason == ("stop" if s.completion_ids[-1] == eos else "length")
        assert s.text == policy.tokenizer.decode(s.completion_ids, skip_special_tokens=True)
    assert sample(policy, prompts, [0, 0, 0], seed=11, **kwargs) == []


def test_shared_prompt_cache_draws_the_same_tokens_as_plain_generate(policy, monkeypatch):
    """Prompts of different lengths (left padding), ragged groups, top-p: the per-prompt cache changes no token."""
    import random

    from rlvr.trainer import generation

    rng = random.Random(0)
    cases = []
    for _ in range(12):
        prompts = [f"{rng.randint(0, 999)}+{rng.randint(0, 9)}=" for _ in range(rng.randint(1, 8))]
        cases.append((prompts, [rng.randint(0, 6) for _ in prompts]))
    kwargs = dict(max_new_tokens=5, temperature=1.3, top_p=0.9)
    encoded = policy.tokenizer(["1+1=", "1+1=", "22+3="], return_tensors="pt", padding=True)
    cache = generation._shared_prompt_cache(policy, encoded["input_ids"], encoded["attention_mask"])
    assert cache is not None and cache.get_seq_length() == encoded["input_ids"].shape[1] - 1
    real_cache, used = generation._shared_prompt_cache, []

    def counted(*args):
        built = real_cache(*args)
        used.append(built is not None)
        return built

    monkeypatch.setattr(generation, "_shared_prompt_cache", counted)
    with_cache = [[s.completion_ids for s in sample(policy, p, c, seed=i, **kwargs)] for i, (p, c) in enumerate(cases)]
    assert sum(used) >= 6  # most cases really sampled from a shared cache
    monkeypatch.setattr(generation, "_shared_prompt_cache", lambda *args: None)
    plain = [[s.completion_ids for s in sample(policy, p, c, seed=i, **kwargs)] for i, (p, c) in enumerate(cases)]
    assert with_cache == plain


def test_sampling_records_the_log_probs_the_old_pass_computes(policy):
    """`logprob_temperature` changes no drawn token and records, per sample and token (ragged stops, left padding,
    top-p and a sampling temperature other than the loss's), what the train stage's π_old pass computes."""
    prompts = ["3+4=", "12+9=", "9+9=", "405+1="]
    kwargs = dict(max_new_tokens=5, temperature=1.3, top_p=0.9, seed=4)
    plain = sample(policy, prompts, [3, 1, 0, 4], **kwargs)
    recorded = sample(policy, prompts, [3, 1, 0, 4], logprob_temperature=0.7, **kwargs)
    assert [s.completion_ids for s in recorded] == [s.completion_ids for s in plain]
    assert all(s.logprobs is None for s in plain)
    assert [len(s.logprobs or []) for s in recorded] == [s.n_tokens for s in recorded]
    assert len({s.n_tokens for s in recorded}) > 1  # some stopped early
    again = behaviour_logprobs(policy, prompts, recorded, GRPOConfig(temperature=0.7))
    assert again == [pytest.approx(s.logprobs, abs=1e-5) for s in recorded]
    assert all(lp < 0 for s in recorded for lp in s.logprobs or [])


def test_completion_logprobs_ignore_left_padding(policy):
    tokenizer, model = policy.tokenizer, policy.model
    alone = torch.tensor([tokenizer("3+4=")["input_ids"]])
    padded = torch.tensor([[0, 0] + tokenizer("3+4=")["input_ids"]])
    completion = torch.tensor([[11, 2]])
    with torch.no_grad():
        logp_alone, mask = completion_logprobs(model, alone, completion, 0)
        logp_padded, _ = completion_logprobs(model, padded, completion, 0)
    torch.testing.assert_close(logp_alone, logp_padded, atol=1e-5, rtol=0)
    assert mask.tolist() == [[1.0, 1.0]]


def test_completion_logprobs_divide_logits_by_temperature(policy):
    prompt = torch.tensor([policy.tokenizer("3+4=")["input_ids"]])
    completion = torch.tensor([[11, 2]])
    with torch.no_grad():
        logits = policy.model(input_ids=torch.cat([prompt, completion], dim=1)).logits[0, 4:6] / 2.0
        expected = torch.log_softmax(logits, dim=-1)[[0, 1], [11, 2]]
        logp, _ = completion_logprobs(policy.model, prompt, completion, 0, temperature=2.0)
    torch.testing.assert_close(logp[0], expected, atol=1e-5, rtol=0)


# --- training ---------------------------------------------------------------------------------------


def test_sft_lowers_the_loss(policy):
    losses = sft_warmstart(policy, make_optimizer(policy, 3e-3, 0.0), ADDITION[:30], steps=30, batch_size=32, seed=0)
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


def _answer_logprob(policy, prompt: str, answer_ids: list[int]) -> float:
    prompt_ids = torch.tensor([policy.tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        logp, _ = completion_logprobs(
            policy.model, prompt_ids, torch.tensor([answer_ids]), policy.tokenizer.pad_token_id
        )
    return logp.sum().item()


def test_grpo_steps_raise_the_probability_of_the_rewarded_answer(policy):
    # Two groups of four; in each, the completion "7</s>" is rewarded and the others are not.
    seven, five, nine = [11, 2], [9, 2], [13, 2]
    completions = [seven, five, nine, five]
    samples = [
        Sample(prompt_index=group, sample_index=k, completion_ids=ids, text="", n_tokens=len(ids), finish_reason="stop")
        for group in (0, 1)
        for k, ids in enumerate(completions)
    ]
    batch = RolloutBatch(prompts=["3+4=", "3+4="], samples=samples, rewards=[1.0, 0.0, 0.0, 0.0] * 2)
    cfg = GRPOConfig(lr=1e-3, minibatches=2)
    optimizer = make_optimizer(policy, cfg.lr, cfg.weight_decay)
    before = _answer_logprob(policy, "3+4=", seven)
    for _ in range(5):
        stats = grpo_step(policy, optimizer, batch, cfg)
    assert stats["updates"] == 2 and stats["effective_ratio"] == 1.0
    assert stats["mean_reward"] == 0.25
    assert _answer_logprob(policy, "3+4=", seven) > before + 1.0  # -5.70 -> -2.97 with these weights


def test_grpo_step_skips_uniform_groups(policy):
    samples = [
        Sample(prompt_index=0, sample_index=k, completion_ids=[11, 2], text="7", n_tokens=2, finish_reason="stop")
        for k in range(3)
    ]
    weights = [p.detach().clone() for p in policy.model.parameters()]
    optimizer = make_optimizer(policy, 1e-2, 0.0)
    stats = grpo_step(policy, optimizer, RolloutBatch(["3+4="], samples, [1.0, 1.0, 1.0]), GRPOConfig())
    assert stats["updates"] == 0 and stats["effective_ratio"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(weights, policy.model.parameters()))


def test_fast_policy_files_equal_save_pretrained_after_training():
    from rlvr.trainer.policy import _saved_files, make_optimizer, policy_files
    from rlvr.trainer.sft import sft_warmstart

    policy = init_policy(PolicyConfig(), seed=5)
    first = policy_files(policy)  # slow path, primes the cache
    optimizer = make_optimizer(policy, lr=1e-2, weight_decay=0.0)
    sft_warmstart(policy, optimizer, [("1+2=", "3"), ("4+4=", "8")], steps=3, batch_size=2, seed=0)
    fast = policy_files(policy)
    assert fast == _saved_files(policy)
    assert fast["model.safetensors"] != first["model.safetensors"]  # the weights did change
