"""Rollout engines chosen by `rollout.type`: the `openai` engine against a real HTTP server (the tiny model
behind `http.server`, sampled with our transformers engine), and the registry wiring of `openai` and `vllm`."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from rlvr.environments.registry import EnvConfig
from rlvr.errors import UserError
from rlvr.storage.store import Store
from rlvr.storage.views import query
from rlvr.trainer.engine_base import SamplingParams, request_seed
from rlvr.trainer.engines import ENGINES, TransformersEngine, TransformersEngineConfig
from rlvr.trainer.episodes import Budgets, Trajectory, play_episodes, turn_key
from rlvr.trainer.generation import Sample, greedy, sample
from rlvr.trainer.policy import Policy, PolicyConfig, init_policy
from rlvr.trainer.prompts import prompt_ids
from rlvr.trainer.remote import OpenAIEngine, OpenAIEngineConfig
from rlvr.trainer.row_sampling import row_key
from rlvr.trainer.turn_decoding import engine_seed
from rlvr.trainer.vllm_engine import VLLMEngineConfig
from tests.conftest import TINY_OVERRIDES
from tests.local_servers import Server, ServerState, completions_answer
from tests.test_multi_turn import eos_bias

PROMPTS = ["1+2=", "3+4=", "5+5=", "9-2="]


@pytest.fixture
def policy() -> Policy:
    return init_policy(PolicyConfig(), seed=0)


@pytest.fixture
def server(policy: Policy) -> Iterator[tuple[str, ServerState]]:
    """(base_url ending in /v1, the server's state), on a free localhost port."""
    state = ServerState(policy=policy)
    httpd = Server(state)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    host, port = httpd.server_address[:2]
    yield f"http://{host!s}:{port}/v1", state
    httpd.shutdown()
    httpd.server_close()


def engine_at(url: str, policy: Policy, **settings: Any) -> OpenAIEngine:
    engine = OpenAIEngine(OpenAIEngineConfig(base_url=url, backoff_s=0.01, **settings))
    engine.update_weights(policy, "policy-0")
    return engine


SAMPLING = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0, seed=7)


# --- the tests ----------------------------------------------------------------------------------


def test_samples_are_the_servers_grouped_by_prompt(server, policy) -> None:
    url, state = server
    counts = [3, 0, 8, 5]
    samples = engine_at(url, policy).generate(PROMPTS, counts, SAMPLING)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (i, k) for i, n in enumerate(counts) for k in range(n)
    ]
    assert len(state.requests) == 3  # one request per prompt with samples, `n` of them
    assert {r["model"] for r in state.requests} == {"tiny"}  # asked /v1/models, as cfg.model is empty
    bos = policy.tokenizer.bos_token_id
    sent = {r["seed"]: r["prompt"] for r in state.requests}  # each prompt as its token ids, one BOS
    assert sent == {request_seed(7, i): policy.tokenizer(PROMPTS[i])["input_ids"] for i in (0, 2, 3)}
    assert all(ids.count(bos) == 1 for ids in sent.values())
    for index in (0, 2, 3):  # exactly what transformers gives for the request's seed
        expected = sample(
            policy,
            [PROMPTS[index]],
            [counts[index]],
            max_new_tokens=4,
            temperature=1.0,
            top_p=1.0,
            seed=request_seed(7, index),
        )
        assert [s for s in samples if s.prompt_index == index] == [
            type(e)(index, e.sample_index, e.completion_ids, e.text, e.n_tokens, e.finish_reason) for e in expected
        ]
    assert {s.finish_reason for s in samples} == {"stop", "length"}
    for s in samples:
        assert s.n_tokens == len(s.completion_ids) <= 4
        assert (s.finish_reason == "stop") == (s.completion_ids[-1] == policy.tokenizer.eos_token_id)
        assert s.text == policy.tokenizer.decode(s.completion_ids, skip_special_tokens=True)
    assert engine_at(url, policy).generate(PROMPTS, counts, SAMPLING) == samples  # same seed, same samples


def test_samples_carry_the_servers_log_probs_asked_at_temperature_1_and_none_at_another(server, policy) -> None:
    """An engine's log-probs are of the raw logits (vLLM's and its server's default): asked for at temperature 1
    (`logprobs: 0`, the sampled token's alone) they are the server's, here the policy's own shifted by a known
    amount; at another temperature they are not asked for, and the rollout stage computes them."""
    from rlvr.trainer.logprobs import completion_logprobs

    url, state = server
    state.logprob_shift = -0.25
    samples = engine_at(url, policy).generate(PROMPTS, [3, 0, 2, 1], replace(SAMPLING, logprob_temperature=1.0))
    assert {r["logprobs"] for r in state.requests} == {0}
    for s in samples:
        row = policy.tokenizer(PROMPTS[s.prompt_index])["input_ids"]
        own, _ = completion_logprobs(policy.model, torch.tensor([row]), torch.tensor([s.completion_ids]), -1)
        assert s.logprobs is not None and len(s.logprobs) == s.n_tokens
        assert s.logprobs == pytest.approx([v - 0.25 for v in own[0].tolist()], abs=1e-5)
    state.requests.clear()
    for temperature in (0.7, None):
        samples = engine_at(url, policy).generate(
            PROMPTS, [2, 0, 0, 0], replace(SAMPLING, logprob_temperature=temperature)
        )
        assert all(s.logprobs is None for s in samples) and all("logprobs" not in r for r in state.requests)


@pytest.mark.slow
def test_a_run_on_a_server_measures_its_log_probs_against_the_trainers(server, tmp_path, prefect_api) -> None:
    """rollout.type=openai with a correction (train.grpo.correction=tis) and the server given each new policy
    (sync=reload): the rollouts store the server's log-probs, and each step's mismatch is exactly the server's shift
    (its weights are the trainer's), below tis's bound, so no token is truncated."""
    url, state = server
    state.logprob_shift = -0.05
    overrides = [*TINY_OVERRIDES, "train.steps=3", "evaluate.every=3", "allocate.n=8", "rollout.type=openai"]
    overrides += [f"rollout.base_url={url}", "rollout.sync=reload", f"rollout.sync_dir={tmp_path / 'sync'}"]
    overrides += ["train.grpo.correction=tis", "warmstart.steps=60"]  # a policy that solves some: groups that train
    run_here(str(tmp_path / "store"), ["run_id=m", *overrides])
    store = Store.open(str(tmp_path / "store"))
    stored = query(store, "SELECT count(*) AS n, count(logprobs) AS given FROM rollouts").to_pylist()[0]
    assert stored["n"] == stored["given"] == 3 * 4 * 8
    sql = "SELECT mismatch_mean, mismatch_max, corrected_share FROM train_steps WHERE updates > 0"
    steps = query(store, sql).to_pylist()
    assert steps, "no step trained"
    for step in steps:
        assert step["mismatch_mean"] == pytest.approx(0.05, abs=1e-4)
        assert step["mismatch_max"] == pytest.approx(0.05, abs=1e-4) and step["corrected_share"] == 0.0


def test_prompt_as_text_sends_the_prompt_text(server, policy) -> None:
    url, state = server
    by_ids = engine_at(url, policy).generate(PROMPTS[:2], [2, 2], SAMPLING)
    assert engine_at(url, policy, prompt_as="text").generate(PROMPTS[:2], [2, 2], SAMPLING) == by_ids
    assert sorted(r["prompt"] for r in state.requests[2:]) == sorted(PROMPTS[:2])


def test_text_is_retokenized_when_the_server_gives_no_ids(server, policy) -> None:
    url, state = server
    with_ids = engine_at(url, policy).generate(PROMPTS, [8] * 4, SAMPLING)
    state.token_ids = False
    retokenized = engine_at(url, policy).generate(PROMPTS, [8] * 4, SAMPLING)
    special = set(policy.tokenizer.all_special_ids)

    def printable(s: Sample) -> bool:  # every token shows in the text (the random model also emits <pad>, <unk>)
        return not special & set(s.completion_ids[:-1] if s.finish_reason == "stop" else s.completion_ids)

    round_trips = [(a, b) for a, b in zip(with_ids, retokenized) if printable(a)]
    assert len(round_trips) >= 8 and {a.finish_reason for a, _ in round_trips} == {"stop", "length"}
    for a, b in round_trips:
        assert (b.completion_ids, b.finish_reason, b.text) == (a.completion_ids, a.finish_reason, a.text)


def test_requests_run_concurrently(server, policy) -> None:
    url, state = server
    state.delay_s = 0.3  # long enough for all four requests to be in the server at once
    engine_at(url, policy, concurrency=4).generate(PROMPTS, [2] * 4, SAMPLING)
    assert state.max_in_flight == 4


def test_503s_are_retried_then_answered(server, policy) -> None:
    url, state = server
    state.fail_first = 2
    samples = engine_at(url, policy, concurrency=1, max_retries=2).generate(PROMPTS[:1], [2], SAMPLING)
    assert len(samples) == 2 and len(state.requests) == 3


def test_408_and_429_are_retried_as_the_judge_and_the_reward_client_retry_them(server, policy) -> None:
    url, state = server
    for status in (408, 429):
        state.fail_first, state.failed, state.fail_status, state.requests = 1, 0, status, []
        samples = engine_at(url, policy, concurrency=1, max_retries=1).generate(PROMPTS[:1], [2], SAMPLING)
        assert len(samples) == 2 and len(state.requests) == 2


def test_a_server_that_keeps_failing_is_one_user_error(server, policy) -> None:
    url, state = server
    state.fail_first = 100
    with pytest.raises(UserError, match=r"failed after 2 tries \(HTTP 503: .*warming up") as caught:
        engine_at(url, policy, max_retries=1).generate(PROMPTS[:1], [2], SAMPLING)
    assert "\n" not in str(caught.value)


def test_a_slow_server_times_out(server, policy) -> None:
    url, state = server
    state.delay_s = 2.0
    start = time.perf_counter()
    with pytest.raises(UserError, match=r"failed after 2 tries \(timed out after 0.2 s\)"):
        engine_at(url, policy, model="tiny", timeout_s=0.2, max_retries=1).generate(PROMPTS[:1], [1], SAMPLING)
    assert time.perf_counter() - start < 1.5


def test_an_unreachable_server_is_one_user_error(policy) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(UserError) as caught:
        engine_at(url, policy, model="tiny", max_retries=2).generate(PROMPTS[:1], [1], SAMPLING)
    message = str(caught.value)
    assert "\n" not in message
    assert f"{url}/completions failed after 3 tries (ConnectError" in message
    assert "rollout.base_url" in message


def test_the_api_key_comes_from_the_named_environment_variable(server, policy, monkeypatch) -> None:
    url, state = server
    state.api_key = "s3cret"
    monkeypatch.setenv("RLVR_TEST_KEY", "s3cret")
    assert len(engine_at(url, policy, api_key_env="RLVR_TEST_KEY").generate(PROMPTS[:1], [1], SAMPLING)) == 1
    with pytest.raises(UserError, match="HTTP 401"):
        engine_at(url, policy).generate(PROMPTS[:1], [1], SAMPLING)
    monkeypatch.delenv("RLVR_TEST_KEY")
    with pytest.raises(UserError, match="RLVR_TEST_KEY.*not set"):
        engine_at(url, policy, api_key_env="RLVR_TEST_KEY")


def test_reload_sync_serves_each_new_policy(server, policy, tmp_path) -> None:
    url, state = server
    state.policy = init_policy(PolicyConfig(), seed=1)  # the server starts on other weights
    engine = engine_at(url, policy, sync="reload", sync_dir=str(tmp_path))
    assert state.reloads == [str(tmp_path / "policy-0")]
    ours = sample(policy, PROMPTS[:1], [8], max_new_tokens=4, temperature=1.0, top_p=1.0, seed=request_seed(7, 0))
    assert [s.completion_ids for s in engine.generate(PROMPTS[:1], [8], SAMPLING)] == [s.completion_ids for s in ours]
    engine.update_weights(policy, "policy-0")  # same reference: nothing to send
    engine.update_weights(init_policy(PolicyConfig(), seed=2), "run/step 1")
    assert state.reloads[1:] == [str(tmp_path / "run_step_1")]
    assert [p.name for p in tmp_path.iterdir()] == ["run_step_1"]  # only the served checkpoint is kept


def test_requests_ask_for_the_policys_own_draw_unless_told_not_to(server, policy) -> None:
    """vLLM's server fills what a request leaves out from the model's generation_config (an instruct model's
    top-k and repetition penalty): each request sets them neutral, unless `policy_sampling` is off for a
    server that refuses fields OpenAI's API does not have."""
    url, state = server
    engine_at(url, policy).generate(PROMPTS[:2], [2, 1], SAMPLING)
    engine_at(url, policy, policy_sampling=False).generate(PROMPTS[:1], [2], SAMPLING)
    sent = [
        {k: r.get(k) for k in ("top_k", "min_p", "repetition_penalty", "temperature", "top_p")} for r in state.requests
    ]
    policy_own = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0}
    assert sent == [
        policy_own,
        policy_own,
        {**dict.fromkeys(("top_k", "min_p", "repetition_penalty")), "temperature": 1.0, "top_p": 1.0},
    ]


def test_reload_needs_a_directory() -> None:
    with pytest.raises(ValueError, match="sync_dir"):
        OpenAIEngineConfig(sync="reload")


def test_greedy_is_one_temperature_0_request_a_prompt(server, policy) -> None:
    url, state = server
    answers = engine_at(url, policy).greedy(PROMPTS, 4)
    assert answers == greedy(policy, PROMPTS, max_new_tokens=4)
    assert [(r["n"], r["temperature"], r["max_tokens"]) for r in state.requests] == [(1, 0.0, 4)] * len(PROMPTS)
    local = TransformersEngine(TransformersEngineConfig())
    local.update_weights(policy, "policy-0")
    assert local.greedy(PROMPTS, 4) == answers  # the built-in engine: transformers' greedy on the policy


# --- episodes of an environment through the server ------------------------------------------------

RETRY = EnvConfig(type="retry", max_turns=3, verifier="arithmetic", options={"feedback": "-0-"})
EPISODE_BUDGETS = Budgets(max_turns=3, max_tokens=30, max_new_tokens=4, max_tool_output_tokens=8)


def retry_episodes(policy: Policy, engine: OpenAIEngine | None, temperature: float) -> list[Trajectory]:
    """Retry episodes of four sums answered wrong (the tiny model never writes 99), seed 7, task keys 3 to 6."""
    tasks = [{"prompt": prompt, "reference": "99"} for prompt in PROMPTS]
    settings = {"temperature": temperature, "top_p": 1.0, "seed": 7}
    return play_episodes(
        policy, RETRY, tasks, [2, 1, 3, 2], budgets=EPISODE_BUDGETS, settings=settings, row_keys=[3, 4, 5, 6],
        engine=engine,
    )  # fmt: skip


def test_an_episode_is_the_servers_sampled_ids_and_the_environments_tokens_each_turn_sent_as_ids(server, policy):
    """Each assistant turn is one request (n=1) whose prompt is the episode's ids so far, exactly, with its turn's
    seed; its answer's ids are the turn's tokens; the environment's tokens between turns are its rendered message."""
    url, state = server
    eos_bias(policy, 3.0)  # turns end with eos, so episodes go on to the environment's feedback
    trajectories = retry_episodes(policy, engine_at(url, policy, concurrency=4), 1.0)
    assert max(len(t.turns) for t in trajectories) == 5  # three assistant turns, the feedback between them
    requests = {(tuple(r["prompt"]), r["seed"]): r for r in state.requests}
    assert len(requests) == len(state.requests) == sum(u.role == "assistant" for t in trajectories for u in t.turns)
    feedback = policy.tokenizer("\n-0-", add_special_tokens=False)["input_ids"]
    for t in trajectories:
        assert t.prompt_ids == prompt_ids(policy.tokenizer, [PROMPTS[t.prompt_index]])[0]
        key = row_key(7, 3 + t.prompt_index, t.sample_index)
        for k, turn in enumerate(u for u in t.turns if u.role == "assistant"):
            sent = requests[(tuple(t.prompt_ids + t.completion_ids[: turn.start]), engine_seed(turn_key(key, k)))]
            assert (sent["n"], sent["max_tokens"], sent["return_token_ids"]) == (1, min(4, 30 - turn.start), True)
            (choice,) = completions_answer(state, sent)["choices"]
            assert t.completion_ids[turn.start : turn.end] == choice["token_ids"]
            assert t.loss_mask[turn.start : turn.end] == [1] * (turn.end - turn.start)
        for turn in (u for u in t.turns if u.role == "user"):
            assert (t.completion_ids[turn.start : turn.end], turn.text) == (feedback, "-0-")
            assert t.loss_mask[turn.start : turn.end] == [0] * len(feedback)
        assert t.logprobs is None  # the server gives none: the rollout stage computes them when a run needs them


def test_greedy_episodes_through_the_server_are_the_policys_own(server, policy) -> None:
    url, state = server
    eos_bias(policy, 0.9)  # greedy turns that end with eos on some prompts and run to their budget on others
    served = retry_episodes(policy, engine_at(url, policy), 0.0)
    local = retry_episodes(policy, None, 0.0)
    assert [(t.completion_ids, t.loss_mask, t.stop_reason) for t in served] == [
        (t.completion_ids, t.loss_mask, t.stop_reason) for t in local
    ]
    assert max(len(t.turns) for t in served) == 5 and len({tuple(t.completion_ids) for t in served}) > 1
    assert {(r["temperature"], r["n"]) for r in state.requests} == {(0.0, 1)}


def test_continuing_rows_needs_prompts_sent_as_token_ids(server, policy) -> None:
    url, _ = server
    with pytest.raises(UserError, match=r"^env episodes send each conversation as token ids.*prompt_as=token_ids$"):
        engine_at(url, policy, prompt_as="text").continue_rows([[1, 5]], [2], 1.0, 1.0, [0])


def run_here(store: str, overrides: list[str]) -> dict[str, Any]:
    """A whole run in this process, beside the test's server: the tests read the server's requests and the store,
    not the command line (a subprocess would cost ~7 CPU-s of imports)."""
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute

    return execute(store, load_config(None, overrides))


@pytest.mark.slow
def test_evaluation_and_difficulty_sample_through_the_runs_engine(server, tmp_path, prefect_api) -> None:
    """A run with rollout.type=openai: its evaluations ask the server for greedy answers, its difficulty pass
    for difficulty.k samples a problem at difficulty.temperature; nothing samples on the side. With
    flow.async_level=1 the rollouts a step behind store log-probs (the server's, asked at temperature 1)."""
    url, state = server
    overrides = [*TINY_OVERRIDES, "train.steps=3", "rollout.type=openai", f"rollout.base_url={url}"]
    overrides.append("difficulty.temperature=0.7")  # 3 RL steps, not the tiny run's 6: one evaluation after them
    overrides.append("flow.async_level=1")
    run_here(str(tmp_path / "store"), ["run_id=a", *overrides])
    store = Store.open(str(tmp_path / "store"))
    evals = query(store, "SELECT sum(n) AS answered, count(*) AS evals FROM evals").to_pylist()[0]
    difficulty = query(store, "SELECT count(*) AS problems FROM difficulty").to_pylist()[0]["problems"]
    rollouts = query(store, "SELECT count(DISTINCT (step, slot)) AS groups FROM rollouts").to_pylist()[0]["groups"]
    stored = query(store, "SELECT count(logprobs) AS n FROM rollouts WHERE staleness = 1").to_pylist()[0]["n"]
    assert stored == 4 * 2 * 4  # steps 2-3 sample a step behind: 4 groups of allocate.n = 4, every one stored
    kinds = Counter((r["n"], r["temperature"]) for r in state.requests)
    assert kinds[(1, 0.0)] == evals["answered"] and evals["evals"] == 3  # init, warm start, step 3
    assert kinds[(2, 0.7)] == difficulty  # difficulty.k = 2
    assert kinds[(4, 1.0)] == rollouts  # allocate.n = 4
    assert sum(kinds.values()) == len(state.requests)


@pytest.mark.slow
def test_a_retry_run_plays_its_episodes_through_the_server(server, tmp_path, prefect_api) -> None:
    """A whole 2-step run of the retry environment on rollout.type=openai, sampled a step ahead (flow.async_level=1):
    every assistant turn of a stored episode was one request of the episode's ids so far, and the log-probs the
    server does not give are computed from the sampling policy, 0.0 on the environment's tokens. The sampler is the
    default sampler process: the openai engine, environment episodes and that process together are tested here only."""
    url, state = server
    overrides = [*TINY_OVERRIDES, "train.steps=2", "evaluate.every=2", "checkpoint.every=2", "flow.async_level=1"]
    overrides += ["env.type=retry", "env.max_turns=3", "rollout.type=openai", f"rollout.base_url={url}"]
    run_here(str(tmp_path / "store"), ["run_id=retry", *overrides])
    store = Store.open(str(tmp_path / "store"))
    episodes = query(
        store, "SELECT prompt_ids, completion_ids, loss_mask, turn_starts, logprobs, staleness, env FROM rollouts"
    ).to_pylist()
    assert len(episodes) == 2 * 4 * 4 and {e["env"] for e in episodes} == {"retry@1"}
    assert max(len(e["turn_starts"]) for e in episodes) > 1  # some episodes heard the feedback and answered again
    sent = {tuple(r["prompt"]) for r in state.requests if r["n"] == 1 and r["temperature"] == 1.0}
    for e in episodes:
        for start in e["turn_starts"]:
            assert tuple(e["prompt_ids"] + e["completion_ids"][:start]) in sent
    ahead = [e for e in episodes if e["staleness"] == 1]
    assert ahead and all(len(e["logprobs"]) == len(e["completion_ids"]) for e in ahead)
    for e in ahead:
        assert all((lp == 0.0) == (m == 0) for lp, m in zip(e["logprobs"], e["loss_mask"]))
    assert all(isinstance(r["prompt"], list) for r in state.requests)  # every prompt went as token ids


def test_rollout_type_chooses_the_engine(tiny_config) -> None:
    cfg = tiny_config(
        "engines", "rollout.type=openai", "rollout.base_url=http://10.0.0.5:8000/v1", "rollout.concurrency=3"
    )
    assert isinstance(cfg.rollout, OpenAIEngineConfig)
    assert (cfg.rollout.base_url, cfg.rollout.concurrency, cfg.rollout.sync) == ("http://10.0.0.5:8000/v1", 3, "none")
    assert isinstance(tiny_config("engines", "rollout.type=vllm").rollout, VLLMEngineConfig)
    assert isinstance(tiny_config("engines").rollout, TransformersEngineConfig)
    assert isinstance(ENGINES.make(TransformersEngineConfig()), TransformersEngine)
    assert {"openai", "transformers", "vllm"} <= set(ENGINES.names())


def test_registering_the_engines_does_not_import_vllm() -> None:
    """This module imported both engines' configs; only starting the `vllm` engine imports vllm."""
    ENGINES.config_type()
    assert "vllm" not in sys.modules


def test_the_static_cache_samples_what_the_shared_prompt_cache_samples():
    """`rollout.cache=static` (transformers' static key/value cache, compiled on a GPU) draws the same tokens as
    the default shared-prompt cache on the CPU, for the same seed; the key stays out of the config's dump (and
    so of every id) at its default."""
    from rlvr.trainer.generation import sample
    from rlvr.trainer.policy import PolicyConfig, init_policy

    policy = init_policy(PolicyConfig(), seed=3)
    prompts, counts = ["12+3=", "7*8=", "5-2="], [8, 5, 1]
    settings = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, seed=11)
    shared = sample(policy, prompts, counts, **settings)
    static = sample(policy, prompts, counts, **settings, cache="static")
    assert [s.completion_ids for s in static] == [s.completion_ids for s in shared]
    assert len({tuple(s.completion_ids) for s in shared}) > 3  # the samples differ from one another
    engine = ENGINES.make(TransformersEngineConfig(cache="static"))
    engine.update_weights(policy, "p")
    drawn = engine.generate(prompts, counts, SamplingParams(6, 1.0, 1.0, 11))
    assert [s.completion_ids for s in drawn] == [s.completion_ids for s in shared]
    assert "cache" not in TransformersEngineConfig().model_dump()
    assert TransformersEngineConfig(cache="static").model_dump()["cache"] == "static"


def test_sampling_precision_is_the_weights_on_the_cpu_unless_bf16_is_asked():
    """`rollout.precision=auto` autocasts only float32 weights on a GPU: on the CPU it draws exactly what
    `weights` draws; `bf16` autocasts on the CPU too; the key stays out
    of the config's dump at its default."""
    import torch

    from rlvr.trainer.generation import sample, sampling_autocast
    from rlvr.trainer.policy import PolicyConfig, init_policy

    policy = init_policy(PolicyConfig(), seed=3)
    prompts, counts = ["12+3=", "7*8=", "5-2="], [8, 5, 1]
    settings = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, seed=11)
    auto = [s.completion_ids for s in sample(policy, prompts, counts, **settings)]
    weights = [s.completion_ids for s in sample(policy, prompts, counts, **settings, precision="weights")]
    bf16 = [s.completion_ids for s in sample(policy, prompts, counts, **settings, precision="bf16")]
    assert auto == weights and len(bf16) == len(auto) == 14
    assert not torch.is_autocast_enabled("cpu")
    with sampling_autocast(policy, "bf16"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert not torch.is_autocast_cache_enabled()  # no bf16 copy of the weights held through decoding
    with sampling_autocast(policy):
        assert not torch.is_autocast_enabled("cpu")
    assert "precision" not in TransformersEngineConfig().model_dump()
    assert TransformersEngineConfig(precision="weights").model_dump()["precision"] == "weights"


class RecordingLLM:
    """Records the calls the vllm engine makes on its `vllm.LLM` (vllm itself is not installed here)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> None:
        self.calls.append((method, len(kwargs["weights_iterator"])))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache", None))

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", tuple(tags)))


def test_vllm_sleep_mode_reloads_the_newest_weights_when_it_wakes(policy) -> None:
    """rollout.sleep (CUDA only, so the order of calls is what is checked here): a weight sync resets the
    prefix cache; asleep, a new policy is only noted; waking allocates the weights, loads the newest policy's,
    then the KV cache."""
    from rlvr.trainer.vllm_engine import VLLMEngine

    engine = VLLMEngine(VLLMEngineConfig(sleep=True))
    engine.llm = recorder = RecordingLLM()
    engine.update_weights(policy, "a")
    tensors = len(dict(policy.model.state_dict()))
    assert recorder.calls == [("reload_weights", tensors), ("reset_prefix_cache", None)]
    recorder.calls.clear()
    engine._sleep()
    engine.update_weights(init_policy(PolicyConfig(), seed=1), "b")
    engine._wake()
    assert recorder.calls == [
        ("sleep", 2),
        ("wake_up", ("weights",)),
        ("reload_weights", tensors),
        ("reset_prefix_cache", None),
        ("wake_up", ("kv_cache",)),
    ]
    assert engine._policy_ref == "b"
    assert "sleep" not in VLLMEngineConfig().model_dump()  # off: rollout ids stay what they were
