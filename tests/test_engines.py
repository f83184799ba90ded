"""Rollout engines chosen by `rollout.type`: the `openai` engine against a real HTTP server (the tiny model
behind `http.server`, sampled with our transformers engine), and the registry wiring of `openai` and `vllm`."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from rlvr.errors import UserError
from rlvr.storage.store import Store
from rlvr.storage.views import query
from rlvr.trainer.engine_base import SamplingParams, request_seed
from rlvr.trainer.engines import ENGINES, TransformersEngine, TransformersEngineConfig
from rlvr.trainer.generation import Sample, greedy, sample
from rlvr.trainer.policy import Policy, PolicyConfig, init_policy, policy_from_files
from rlvr.trainer.remote import OpenAIEngine, OpenAIEngineConfig
from rlvr.trainer.vllm_engine import VLLMEngineConfig
from tests.cli_helpers import cli_env, rlvr
from tests.conftest import TINY_OVERRIDES

PROMPTS = ["1+2=", "3+4=", "5+5=", "9-2="]


# --- the server ---------------------------------------------------------------------------------


@dataclass
class ServerState:
    """What the server does (`fail_first` 503s, `delay_s` per request, token ids or not, an API key)
    and what it saw (requests, the most in flight at once, reloaded directories)."""

    policy: Policy
    fail_first: int = 0
    delay_s: float = 0.0
    token_ids: bool = True
    api_key: str | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    failed: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    reloads: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    sampling_lock: threading.Lock = field(default_factory=threading.Lock)


def completions_answer(state: ServerState, body: dict[str, Any]) -> dict[str, Any]:
    """`n` seeded samples of one prompt, as OpenAI's completions endpoint answers (torch's RNG is
    process-global, hence the lock: requests may overlap, sampling may not)."""
    prompt = body["prompt"]
    if isinstance(prompt, list):  # token ids: the text they spell (`sample` tokenizes it back, BOS included)
        prompt = state.policy.tokenizer.decode(prompt, skip_special_tokens=True)
    with state.sampling_lock:
        if float(body["temperature"]) == 0:  # greedy, as vLLM's server decodes at temperature 0
            text = greedy(state.policy, [prompt], max_new_tokens=int(body["max_tokens"]))[0]
            choice = {"index": 0, "text": text, "finish_reason": "length"}
            return {"object": "text_completion", "model": "tiny", "choices": [choice] * int(body["n"])}
        samples = sample(
            state.policy,
            [prompt],
            [int(body["n"])],
            max_new_tokens=int(body["max_tokens"]),
            temperature=float(body["temperature"]),
            top_p=float(body["top_p"]),
            seed=int(body["seed"]),
        )
    choices = []
    for s in samples:
        choice: dict[str, Any] = {"index": s.sample_index, "text": s.text, "finish_reason": s.finish_reason}
        if state.token_ids and body.get("return_token_ids"):
            choice["token_ids"] = s.completion_ids
        choices.append(choice)
    return {"object": "text_completion", "model": "tiny", "choices": choices[::-1]}  # any order: index says


def reload_answer(state: ServerState, body: dict[str, Any]) -> dict[str, Any]:
    """The `sync=reload` hook: serve the checkpoint directory the engine wrote."""
    assert body["method"] == "reload_directory"
    path = Path(body["args"][0])
    files = {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    with state.sampling_lock:
        state.policy = policy_from_files(files, source=str(path))
    state.reloads.append(str(path))
    return {"results": [None]}


class Handler(BaseHTTPRequestHandler):
    server: Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def authorized(self) -> bool:
        key = self.server.state.api_key
        return key is None or self.headers.get("Authorization") == f"Bearer {key}"

    def do_GET(self) -> None:
        if not self.authorized():
            return self.reply(401, {"error": "bad key"})
        self.reply(200, {"data": [{"id": "tiny"}]} if self.path == "/v1/models" else {"error": "no route"})

    def do_POST(self) -> None:
        state = self.server.state
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not self.authorized():
            return self.reply(401, {"error": "bad key"})
        with state.lock:
            state.requests.append(body)
            if state.failed < state.fail_first:
                state.failed += 1
                return self.reply(503, {"error": "warming up"})
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            time.sleep(state.delay_s)
            routes = {"/v1/completions": completions_answer, "/collective_rpc": reload_answer}
            self.reply(200, routes[self.path](state, body))
        finally:
            with state.lock:
                state.in_flight -= 1


class Server(ThreadingHTTPServer):
    # server_close() joins the request threads: one still sleeping (a timed-out request) would otherwise sample
    # later, reseeding torch's global RNG under whichever test runs next.
    daemon_threads = False
    block_on_close = True

    def __init__(self, state: ServerState) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.state = state


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
    with pytest.raises(UserError, match=r"failed after 2 tries \(timed out after 0.2s\)"):
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


@pytest.mark.slow
def test_evaluation_and_difficulty_sample_through_the_runs_engine(server, tmp_path, prefect_api) -> None:
    """A run with rollout.type=openai: its evaluations ask the server for greedy answers, its difficulty pass
    for difficulty.k samples a problem at difficulty.temperature; nothing samples on the side. With
    flow.async_level=1 the server gives no log-probs: the rollout stage computes the sampling policy's."""
    url, state = server
    overrides = [*TINY_OVERRIDES, "rollout.type=openai", f"rollout.base_url={url}", "difficulty.temperature=0.7"]
    overrides.append("flow.async_level=1")
    sets = [arg for o in overrides for arg in ("--set", o)]
    done = rlvr(
        "run", "--store", str(tmp_path / "store"), "--run-id", "a", *sets, env=cli_env(PREFECT_API_URL=prefect_api)
    )
    assert done.returncode == 0, done.stderr
    store = Store.open(str(tmp_path / "store"))
    evals = query(store, "SELECT sum(n) AS answered, count(*) AS evals FROM evals").to_pylist()[0]
    difficulty = query(store, "SELECT count(*) AS problems FROM difficulty").to_pylist()[0]["problems"]
    rollouts = query(store, "SELECT count(DISTINCT (step, slot)) AS groups FROM rollouts").to_pylist()[0]["groups"]
    stored = query(store, "SELECT count(logprobs) AS n FROM rollouts WHERE staleness = 1").to_pylist()[0]["n"]
    assert stored == 4 * 5 * 4  # steps 2-6 sample a step behind: 4 groups of allocate.n = 4, every one stored
    kinds = Counter((r["n"], r["temperature"]) for r in state.requests)
    assert kinds[(1, 0.0)] == evals["answered"] and evals["evals"] == 4  # init, warm start, steps 3 and 6
    assert kinds[(2, 0.7)] == difficulty  # difficulty.k = 2
    assert kinds[(4, 1.0)] == rollouts  # allocate.n = 4
    assert sum(kinds.values()) == len(state.requests)


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
