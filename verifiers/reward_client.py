"""A client of reward-model servers: OpenRLHF's `/get_reward` and vLLM's `/classify` (the shapes, and where they
were read: serving/server.py, which serves both), with a batch sharded over several servers.

Sharding is OpenRLHF's: with k servers, server i gets the contiguous rows [i*s, (i+1)*s), s = ceil(n / k), so
equal servers get equal shares (a batch smaller than k leaves the last servers idle). Each shard goes in requests
of at most `rows_per_request` rows (servers bound their request size), and all requests run at once, up to
`max_concurrency`; the results come back in input order.

Requests follow the one retry policy of rlvr/endpoints.py: a finite wall-clock budget, `timeout_s`, for the whole
answer; retried after a connection error, a timeout, a server dying mid-answer, a 408, 429 or 5xx, or an answer
that is not what was asked for (not JSON, the wrong number of rows, a value that is not a finite number), waiting
`backoff_s`, then twice that, and so on; an answer over 64 MiB fails. A 4xx is the request's fault and is not
retried. With `api_key_env`, the key in that environment variable goes as a bearer token. A request that still
fails raises `RewardServerError`, one line naming the server and what went wrong: a caller (a verifier) turns it
into `error` rows, never into a reward of 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from rlvr.endpoints import CallFailed, EndpointClient, RetryPolicy, Unreadable, bearer_header, json_answer, missing_key
from rlvr.errors import UserError

T = TypeVar("T")


class RewardServerError(UserError):
    """A reward server that failed a request for good (after its retries) or refused it: `url` is the endpoint,
    `problem` what went wrong, and the message one line holding both."""

    def __init__(self, url: str, problem: str) -> None:
        self.url = url
        self.problem = " ".join(problem.split())
        super().__init__(f"reward server {url}: {self.problem}")


class RewardClientConfig(BaseModel):
    """Where the servers are and how long to wait for them. `urls`: the servers' base URLs (the client appends
    /get_reward or /classify). `model`: the `model` sent to /classify (vLLM checks it), none by default."""

    model_config = ConfigDict(extra="forbid")

    urls: list[str] = Field(min_length=1)
    timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False, description="wall-clock limit of one request")
    max_retries: int = Field(2, ge=0, description="retries of a failed request")
    backoff_s: float = Field(0.5, ge=0, allow_inf_nan=False, description="wait before the first retry; doubles")
    max_concurrency: int = Field(8, ge=1, description="requests in flight at once, over all servers")
    rows_per_request: int = Field(256, ge=1, description="rows in one request at most")
    model: str | None = None
    api_key_env: str | None = Field(
        None, description="environment variable with the API key, sent as a bearer token (the key is never stored)"
    )

    @field_validator("api_key_env")
    @classmethod
    def _key_is_set(cls, name: str | None) -> str | None:
        if missing_key(name):
            raise PydanticCustomError(
                "key_not_set", f"the environment variable {name} is not set: export it with the API key"
            )
        return name

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"reward server URL {url!r} must start with http:// or https://")
        return [url.rstrip("/") for url in urls]


@dataclass(frozen=True)
class Classification:
    """One input's result from /classify: the probability of each class, and the most probable one's label."""

    label: str | None
    probs: list[float]


class RewardModelClient:
    """Calls reward servers (`RewardClientConfig`); one instance keeps one connection pool. Use it as a context
    manager, or call `close`."""

    def __init__(self, cfg: RewardClientConfig) -> None:
        self.cfg = cfg
        self._client = EndpointClient(
            RetryPolicy(cfg.timeout_s, cfg.max_retries, cfg.backoff_s),
            bearer_header(cfg.api_key_env, "reward.model.api_key_env"),
            cfg.max_concurrency,
        )

    def __enter__(self) -> RewardModelClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def get_reward(
        self, queries: Sequence[str], prompts: Sequence[str] | None = None, labels: Sequence[str | None] | None = None
    ) -> list[float]:
        """One reward per query, in order (OpenRLHF's body: `query` is the prompt and response as one text)."""
        for name, given in (("prompts", prompts), ("labels", labels)):
            if given is not None and len(given) != len(queries):
                raise ValueError(f"{len(given)} {name} for {len(queries)} queries")

        def body(start: int, stop: int) -> dict[str, Any]:
            sent: dict[str, Any] = {"query": list(queries[start:stop])}
            if prompts is not None:
                sent["prompts"] = list(prompts[start:stop])
            if labels is not None:
                sent["labels"] = list(labels[start:stop])
            return sent

        return self._sharded("/get_reward", len(queries), body, _rewards)

    def classify(self, inputs: Sequence[str]) -> list[Classification]:
        """Each input's class probabilities and label, in order (vLLM's /classify)."""

        def body(start: int, stop: int) -> dict[str, Any]:
            sent: dict[str, Any] = {"input": list(inputs[start:stop])}
            if self.cfg.model is not None:
                sent["model"] = self.cfg.model
            return sent

        return self._sharded("/classify", len(inputs), body, _classifications)

    # --- sharding ---------------------------------------------------------------------------------------------

    def requests(self, rows: int) -> list[tuple[str, int, int]]:
        """(server URL, first row, end row) of each request for a batch of `rows` rows (the module docstring)."""
        share = math.ceil(rows / len(self.cfg.urls)) if rows else 0
        planned = []
        for index, url in enumerate(self.cfg.urls):
            start, stop = index * share, min(rows, (index + 1) * share)
            for first in range(start, stop, self.cfg.rows_per_request):
                planned.append((url, first, min(stop, first + self.cfg.rows_per_request)))
        return planned

    def _sharded(
        self,
        path: str,
        rows: int,
        body: Callable[[int, int], dict[str, Any]],
        parse: Callable[[Any, int], list[T]],
    ) -> list[T]:
        planned = self.requests(rows)
        if not planned:
            return []

        def call(request: tuple[str, int, int]) -> list[T]:
            url, start, stop = request
            return self._post(url + path, body(start, stop), lambda answer: parse(answer, stop - start))

        with ThreadPoolExecutor(max_workers=min(self.cfg.max_concurrency, len(planned))) as pool:
            futures = [pool.submit(call, request) for request in planned]
            done = [future.exception() for future in futures]  # every request ends, each within its budget
        failed = next((problem for problem in done if problem is not None), None)
        if failed is not None:
            raise failed
        return [row for future in futures for row in future.result()]

    # --- one request ------------------------------------------------------------------------------------------

    def _post(self, url: str, body: dict[str, Any], parse: Callable[[Any], list[T]]) -> list[T]:
        """The parsed answer of `url`, after up to `max_retries` retries; a RewardServerError otherwise."""

        def read(content: bytes) -> list[T]:
            try:
                return parse(json_answer(content))
            except Unreadable:
                raise
            except ValueError as exc:  # the wrong shape: asked again, as an answer that is not JSON is
                raise Unreadable(str(exc)) from None

        try:
            return self._client.call("POST", url, body, read)
        except CallFailed as failure:
            if failure.refused:
                raise RewardServerError(url, f"refused the request: {failure.problem}") from None
            if failure.tries == 1:
                raise RewardServerError(url, failure.problem) from None
            raise RewardServerError(url, f"failed {failure.tries} times; the last time: {failure.problem}") from None


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} is {value!r}, not a finite number")
    return float(value)


def _rewards(answer: Any, expected: int) -> list[float]:
    """OpenRLHF's answer: `rewards`, one finite number per query sent."""
    found = answer.get("rewards") if isinstance(answer, dict) else None
    if not isinstance(found, list):
        raise ValueError("answer has no 'rewards' list")
    if len(found) != expected:
        raise ValueError(f"answered {len(found)} rewards for {expected} queries")
    return [_number(value, f"reward {index}") for index, value in enumerate(found)]


def _classifications(answer: Any, expected: int) -> list[Classification]:
    """vLLM's answer: `data`, one item per input with its `index`, `label` and `probs`, in any order."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise ValueError("answer has no 'data' list")
    if len(data) != expected:
        raise ValueError(f"answered {len(data)} classifications for {expected} inputs")
    found: dict[int, Classification] = {}
    for item in data:
        index = item.get("index") if isinstance(item, dict) else None
        probs = item.get("probs") if isinstance(item, dict) else None
        if not isinstance(index, int) or not 0 <= index < expected or index in found:
            raise ValueError(f"classification index {index!r} is not one of 0..{expected - 1} once each")
        if not isinstance(probs, list) or not probs:
            raise ValueError(f"classification {index} has no 'probs' list")
        label = item.get("label")
        found[index] = Classification(
            None if label is None else str(label), [_number(p, f"classification {index}'s prob") for p in probs]
        )
    return [found[index] for index in range(expected)]
