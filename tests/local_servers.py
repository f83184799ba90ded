"""HTTP servers the tests run in a thread of their own process: the tiny model behind OpenAI's completions endpoint
(what `rollout.type=openai` samples from; tests/test_engines.py and tests/test_combinations.py), and a scripted judge
and reward model (`reward.judge`, `reward.model`) whose verdicts are a rule, for runs that are about what the
pipeline does with model-given rewards rather than about the models."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from rlvr.trainer.generation import _generate_ids
from rlvr.trainer.logprobs import completion_logprobs
from rlvr.trainer.policy import Policy, policy_from_files
from rlvr.trainer.prompts import prompt_ids
from rlvr.trainer.rng import seeded_rng

# --- the tiny model behind OpenAI's completions endpoint ----------------------------------------


@dataclass
class ServerState:
    """What the server does (`fail_first` 503s, `delay_s` per request, token ids or not, an API key)
    and what it saw (requests, the most in flight at once, reloaded directories)."""

    policy: Policy
    fail_first: int = 0
    fail_status: int = 503
    delay_s: float = 0.0
    token_ids: bool = True
    api_key: str | None = None
    logprob_shift: float = 0.0  # added to every log-prob it gives: another engine's numerics, by a known amount
    requests: list[dict[str, Any]] = field(default_factory=list)
    failed: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    reloads: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    sampling_lock: threading.Lock = field(default_factory=threading.Lock)


def completions_answer(state: ServerState, body: dict[str, Any]) -> dict[str, Any]:
    """`n` seeded samples of one prompt, as OpenAI's completions endpoint answers: token ids are continued as they
    are (as vLLM does), a text is read as the rollouts read a prompt; each draw is `sample`'s for that seed (torch's
    RNG is process-global, hence the lock: requests may overlap, sampling may not)."""
    prompt, n, max_tokens, temperature = body["prompt"], int(body["n"]), int(body["max_tokens"]), body["temperature"]
    with state.sampling_lock:
        policy = state.policy
        row = list(prompt) if isinstance(prompt, list) else prompt_ids(policy.tokenizer, [prompt])[0]
        if float(temperature) == 0:  # greedy, as vLLM's server decodes at temperature 0
            completions = _generate_ids(policy, [row], max_tokens, do_sample=False)[0] * n
        else:
            with seeded_rng(int(body["seed"]), policy.model.device):
                completions, _ = _generate_ids(
                    policy, [row] * n, max_tokens, do_sample=True, temperature=float(temperature),
                    top_p=float(body["top_p"]), top_k=0,
                )  # fmt: skip
    choices = []
    for index, ids in enumerate(completions):
        stopped = bool(ids) and ids[-1] == policy.tokenizer.eos_token_id
        text = policy.tokenizer.decode(ids, skip_special_tokens=True)
        choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": "stop" if stopped else "length"}
        if state.token_ids and body.get("return_token_ids"):
            choice["token_ids"] = ids
        if body.get("logprobs") is not None:  # the sampled tokens' log-probs of the raw logits, as vLLM's server
            choice["logprobs"] = {"token_logprobs": _token_logprobs(policy, row, ids, state.logprob_shift)}
        choices.append(choice)
    return {"object": "text_completion", "model": "tiny", "choices": choices[::-1]}  # any order: index says


def _token_logprobs(policy: Policy, prompt: list[int], ids: list[int], shift: float) -> list[float]:
    if not ids:
        return []
    with torch.no_grad():
        device = policy.model.device
        logp, _ = completion_logprobs(
            policy.model, torch.tensor([prompt], device=device), torch.tensor([ids], device=device), -1
        )
    return [float(v) + shift for v in logp[0]]


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
                return self.reply(state.fail_status, {"error": "warming up"})
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


@contextmanager
def serving(server: ThreadingHTTPServer) -> Iterator[str]:
    """Serve `server` from a thread inside the block, which gets its base URL (http://127.0.0.1:PORT)."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host!s}:{port}"
    finally:
        server.shutdown()
        server.server_close()


# --- a judge and a reward model whose verdict is a rule ------------------------------------------

# What the judge's default template holds (verifiers/judge.py): the reference on its own line, the response fenced
# by a tag the response cannot contain.
REFERENCE_LINE = re.compile(r"^Reference answer: (.*)$", re.M)
FENCED_RESPONSE = re.compile(r"^<(ANSWER-[0-9a-f]{12})>\n(.*)\n</\1>$", re.M | re.S)


def contains_reference(response: str, reference: str) -> bool:
    """The rule of both scripted models: the answer holds the reference's text."""
    return bool(reference.strip()) and reference.strip() in response


class ScriptedModels(ThreadingHTTPServer):
    """OpenAI's chat completions as a judge (`reward.judge`: "yes" when the fenced answer holds the reference line's
    text, else "no") and OpenRLHF's `POST /get_reward` as a reward model (`reward.model`: 1.0 when the response,
    the query after the question's line, holds the label, else 0.0); counts the verdicts each gave."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), ScriptedHandler)
        self.lock = threading.Lock()
        self.verdicts: dict[str, int] = {"judge": 0, "reward_model": 0}

    def counted(self, kind: str, n: int) -> None:
        with self.lock:
            self.verdicts[kind] += n


class ScriptedHandler(BaseHTTPRequestHandler):
    server: ScriptedModels

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/chat/completions":
            text = body["messages"][-1]["content"]
            reference, response = REFERENCE_LINE.search(text), FENCED_RESPONSE.search(text)
            if reference is None or response is None:
                return self.reply(400, {"error": {"message": "not the judge's template"}})
            verdict = "yes" if contains_reference(response.group(2), reference.group(1)) else "no"
            self.server.counted("judge", 1)
            message = {"role": "assistant", "content": verdict}
            return self.reply(200, {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})
        if self.path == "/get_reward":
            responses = [query.split("\n", 1)[-1] for query in body["query"]]
            labels = body.get("labels") or [""] * len(responses)
            rewards = [float(contains_reference(r, label or "")) for r, label in zip(responses, labels)]
            self.server.counted("reward_model", len(rewards))
            return self.reply(200, {"rewards": rewards})
        self.reply(404, {"error": {"message": f"no route {self.path}"}})
