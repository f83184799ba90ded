"""Calling model endpoints over HTTP: one retry policy for the remote rollout engine (trainer/remote.py), the judge
(verifiers/judge.py) and the reward-model client (verifiers/reward_client.py), a circuit breaker over a moving window
of calls, and the measured rate of calls that estimates how long a stage will ask.

The policy (`RetryPolicy`, `EndpointClient.call`):
- a try fails and is tried again on a transport error (no connection, a connection dropped mid-answer), a timeout,
  HTTP 408, 429 or any 5xx, or an answer the caller cannot read (its `read` raises `Unreadable`); any other 4xx is
  the request's fault and is not asked again, nor is an answer over the size cap (the same request gets it again);
- before retry n (1, 2, ...) it waits `backoff_s * 2**(n-1)`;
- each try has a wall-clock deadline, `timeout_s`, for the whole answer: httpx bounds connecting, sending and each
  read, and the body is read in chunks against the deadline, so a server that sends a byte a second is cut off
  within a second of it;
- an answer over `max_reply_bytes` is cut off there and fails;
- a key goes as `Authorization: Bearer KEY`, read from the environment variable a config names (`bearer_header`):
  only the variable's name is ever in a config, so the key reaches no stored config, row, cache entry or log.

It sits in the package root because the engine (trainer/) and the verifiers both call endpoints, and verifiers/
may not import trainer/.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from rlvr.errors import UserError

T = TypeVar("T")
RETRIED_STATUSES = frozenset({408, 429})  # and every 5xx
MAX_REPLY_BYTES = 64 << 20
BREAKER_WINDOW = 200  # a breaker at max_error_rate 0.1 trips on the 21st failure among an endpoint's last 200


def one_line(text: str, limit: int = 200) -> str:
    return " ".join(text.split())[:limit]


def bearer_header(api_key_env: str | None, setting: str) -> dict[str, str]:
    """The `Authorization: Bearer` header of the key in the environment variable `api_key_env` (none without one);
    `setting` names the config key in the one-line error of a variable that is not set."""
    if api_key_env is None:
        return {}
    key = os.environ.get(api_key_env)
    if not key:
        raise UserError(f"{setting} names {api_key_env!r}, but that environment variable is not set")
    return {"Authorization": f"Bearer {key}"}


def missing_key(api_key_env: str | None) -> bool:
    """Whether a config names a key's environment variable that is not set (for its validator: the run stops before
    any work)."""
    return api_key_env is not None and not os.environ.get(api_key_env)


@dataclass(frozen=True)
class RetryPolicy:
    """How long one try may take (`timeout_s`, the whole answer), how many tries follow a failed one (`retries`),
    the wait before the first of them (`backoff_s`, doubled before each next) and the largest answer read."""

    timeout_s: float
    retries: int
    backoff_s: float
    max_reply_bytes: int = MAX_REPLY_BYTES


class Unreadable(ValueError):
    """Raised by a caller's `read` for an answer it cannot use (not JSON, the wrong shape): asked again."""


class CallFailed(Exception):
    """A call that failed for good: `url`, what went wrong the last time (`problem`, one line), how many tries it
    took, and whether the server refused it (a 4xx, not asked again) or it was tried `retries + 1` times."""

    def __init__(self, url: str, problem: str, tries: int, refused: bool, status: int | None = None) -> None:
        self.url, self.problem, self.tries = url, one_line(problem, 400), tries
        self.refused, self.status = refused, status
        super().__init__(f"{url}: {self.problem}")


class _TryFailed(Exception):
    def __init__(self, problem: str, retry: bool, status: int | None = None) -> None:
        super().__init__(problem)
        self.retry, self.status = retry, status


class Pace:
    """At most `per_minute` starts a minute, evenly spaced, across threads (None: no limit)."""

    def __init__(self, per_minute: float | None) -> None:
        self.interval = 0.0 if per_minute is None else 60.0 / per_minute
        self.next_start = 0.0
        self.lock = threading.Lock()

    def wait(self) -> None:
        if not self.interval:
            return
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next_start)
            self.next_start = start + self.interval
        time.sleep(max(0.0, start - now))


class EndpointClient:
    """One connection pool to an endpoint (`concurrency` connections), calls made under `policy`. Use it as a
    context manager, or call `close`."""

    def __init__(
        self,
        policy: RetryPolicy,
        headers: dict[str, str] | None = None,
        concurrency: int = 8,
        requests_per_minute: float | None = None,
    ) -> None:
        self.policy = policy
        self.pace = Pace(requests_per_minute)
        self._client = httpx.Client(
            timeout=httpx.Timeout(policy.timeout_s),
            headers=headers or {},
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        )

    def __enter__(self) -> EndpointClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def call(self, method: str, url: str, body: Any, read: Callable[[bytes], T]) -> T:
        """`read(answer body)` of a 2xx answer to `method url` (with `body` as JSON, unless None), after the
        retries the policy allows; `CallFailed` otherwise."""
        policy, problem = self.policy, ""
        for attempt in range(policy.retries + 1):
            if attempt:
                time.sleep(policy.backoff_s * 2 ** (attempt - 1))
            self.pace.wait()
            try:
                status, content = self._answer(method, url, body)
                if status >= 400:
                    retry = status in RETRIED_STATUSES or status >= 500
                    raise _TryFailed(f"HTTP {status}: {error_message(content)}", retry, status)
                try:
                    return read(content)
                except Unreadable as exc:
                    raise _TryFailed(str(exc), retry=True) from None
            except _TryFailed as failure:
                problem = str(failure)
                if not failure.retry:
                    raise CallFailed(url, problem, attempt + 1, failure.status is not None, failure.status) from None
        raise CallFailed(url, problem, policy.retries + 1, refused=False)

    def _answer(self, method: str, url: str, body: Any) -> tuple[int, bytes]:
        """Status and body of one try, read whole within `timeout_s` of its start and at most `max_reply_bytes`."""
        policy = self.policy
        deadline = time.monotonic() + policy.timeout_s
        try:
            with self._client.stream(method, url, json=body) as response:
                chunks, size = [], 0
                for chunk in response.iter_bytes():
                    chunks.append(chunk)
                    size += len(chunk)
                    if time.monotonic() > deadline:
                        raise _TryFailed(f"no whole answer within {policy.timeout_s:g} s", retry=True)
                    if size > policy.max_reply_bytes:
                        raise _TryFailed(f"answer over {policy.max_reply_bytes} bytes", retry=False)
                return response.status_code, b"".join(chunks)
        except httpx.TimeoutException:
            raise _TryFailed(f"timed out after {policy.timeout_s:g} s", retry=True) from None
        except httpx.TransportError as exc:
            raise _TryFailed(f"{type(exc).__name__}: {exc}", retry=True) from None


def error_message(content: bytes) -> str:
    """An error answer's message: OpenAI's {"error": {"message": ...}}, FastAPI's {"detail": ...}, else the body's
    first 200 characters, on one line."""
    try:
        answer = json.loads(content)
    except ValueError:
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict) and "message" in answer["error"]:
        return one_line(str(answer["error"]["message"]))
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        return one_line(answer["error"])
    if isinstance(answer, dict) and "detail" in answer:
        return one_line(str(answer["detail"]))
    return one_line(content[:400].decode("utf-8", "replace"))


def json_answer(content: bytes) -> Any:
    """The answer as JSON; `Unreadable` when it is not."""
    try:
        return json.loads(content)
    except ValueError:
        raise Unreadable(f"answer is not JSON: {one_line(content[:120].decode('utf-8', 'replace'), 120)!r}") from None


# --- the circuit breaker --------------------------------------------------------------------------------------


class EndpointDown(UserError):
    """A circuit breaker that tripped: too many of an endpoint's recent calls failed (the message says which)."""


class CircuitBreaker:
    """Trips when more than `max_error_rate` of a moving window of `window` calls failed: that is, when the last
    `window` calls hold more than `max_error_rate * window` failures. It trips as soon as that many have failed,
    before the window is full, so an endpoint that fails every call stops its callers after
    `floor(max_error_rate * window) + 1` calls, however many they meant to make. Thread-safe; a trip empties the
    window, and every caller that started before it sees it (`tripped_since`)."""

    def __init__(self, name: str, max_error_rate: float, window: int, unit: str = "calls") -> None:
        self.name, self.max_error_rate, self.window, self.unit = name, max_error_rate, window, unit
        self._outcomes: deque[bool] = deque(maxlen=window)  # True: failed
        self._lock = threading.Lock()
        self.trips = 0
        self.message = ""

    def record(self, failed: bool, reason: str | None = None) -> None:
        """Note one call's outcome; trips (raising `EndpointDown`) when the window holds too many failures."""
        with self._lock:
            self._outcomes.append(failed)
            failures = sum(self._outcomes)
            if not failed or failures <= self.max_error_rate * self.window:
                return
            calls = len(self._outcomes)
            self._outcomes.clear()
            self.trips += 1
            self.message = (
                f"{self.name} failed {failures} of its last {calls} {self.unit} (more than reward.max_error_rate "
                f"{self.max_error_rate:g} of a {self.window}-{self.unit[:-1]} window), so the run stops asking it; "
                f"last: {reason}"
            )
            raise EndpointDown(self.message)

    def tripped_since(self, trips: int) -> None:
        """Raise the last trip's `EndpointDown` if it tripped after `trips` (a caller's `trips` when it started)."""
        if self.trips != trips:
            raise EndpointDown(self.message)


# --- the measured rate of calls -------------------------------------------------------------------------------


class CallRate:
    """How fast an endpoint answers a planned number of calls: `plan` says how many a stage will make, `done`
    counts the answered ones, and once `sample` of them are answered `done` returns the estimate of the rest (once
    a plan), measured from the first call's start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0
        self.sample = 0
        self.answered = 0
        self.first_start: float | None = None
        self.what = ""

    def plan(self, what: str, total: int, sample: int) -> None:
        with self._lock:
            self.what, self.total, self.sample, self.answered, self.first_start = what, total, sample, 0, None

    def started(self, at: float) -> None:
        with self._lock:
            if self.total and self.first_start is None:
                self.first_start = at

    def done(self, calls: int = 1) -> tuple[str, int, float, int, float] | None:
        """(what, calls answered, their seconds, calls left, their estimated seconds) when this answer completes the
        sample; else None."""
        with self._lock:
            if not self.total or self.first_start is None or self.answered >= self.sample:
                self.answered += calls
                return None
            self.answered += calls
            if self.answered < self.sample:
                return None
            seconds = time.monotonic() - self.first_start
            left = max(0, self.total - self.answered)
            return self.what, self.answered, seconds, left, left * seconds / self.answered


_breakers: dict[str, CircuitBreaker] = {}
_rates: dict[str, CallRate] = {}
_registry_lock = threading.Lock()


def breaker_for(name: str, max_error_rate: float, window: int, unit: str = "calls") -> CircuitBreaker:
    """The process's breaker of the endpoint `name` (one per name, so every stage and thread asking it shares its
    window); a changed threshold starts a new one."""
    with _registry_lock:
        found = _breakers.get(name)
        if found is None or (found.max_error_rate, found.window, found.unit) != (max_error_rate, window, unit):
            found = _breakers[name] = CircuitBreaker(name, max_error_rate, window, unit)
        return found


def rate_of(name: str) -> CallRate:
    """The process's measured rate of the endpoint `name`."""
    with _registry_lock:
        return _rates.setdefault(name, CallRate())


def duration(seconds: float) -> str:
    """A rough duration: '40 s', '12 min', '2 h 25 min'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"
