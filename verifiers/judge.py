"""An LLM judge: a verifier whose verdict is a model's, asked over an OpenAI-compatible chat completions endpoint
(`reward.judge`, docs/rewards.md).

The judge reads a template over the question, the reference and the response, and its reply is parsed: "yes_no"
(the first yes or no), "score_10" (the first number from 0 to 10, divided by 10) or "json" (an object with a
`score` in [0, 1] or a boolean `correct`). A call that fails (no connection, a timeout, an HTTP error after the
retries, a body that is not a chat completion, a reply the parser cannot read) is a verdict with status `error`:
the train stage leaves it out of the update rather than train on a 0 it never earned, and the label stage stops
the run when a step's share of them passes `reward.max_error_rate`.

Every call has a finite deadline (`timeout_s`, for the whole answer, however slowly the server sends it) and
retries back off exponentially; `concurrency` calls run at once, at most `requests_per_minute` started a minute.
Verdicts go through the reward cache under a version that names the judge's model, the template's hash, the
parser and the sampling settings, so changing any of them asks the judge again and re-running does not.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from rlvr.verifiers.base import Score, Verifier, one_line

DEFAULT_TEMPLATE = (
    "You are grading an answer to a question.\n"
    "Question: {question}\n"
    "Reference answer: {reference}\n"
    "Answer to grade: {response}\n"
    "Does the answer to grade agree with the reference answer? Reply with just yes or no."
)
RETRIED_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class JudgeConfig(BaseModel):
    """Where the judge is and how it is asked (`reward.judge`)."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = Field(description="the OpenAI-compatible API root, e.g. http://127.0.0.1:8000/v1")
    model: str = Field(description="the model name the server serves; it names the judge in the cache")
    template: str = Field(DEFAULT_TEMPLATE, description="the user message, with {question} {reference} {response}")
    parser: Literal["yes_no", "score_10", "json"] = "yes_no"
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    concurrency: int = Field(4, ge=1, description="calls at once")
    requests_per_minute: float | None = Field(None, gt=0, description="None: no limit")
    timeout_s: float = Field(30.0, gt=0, description="deadline of one call, the whole answer included")
    retries: int = Field(2, ge=0, description="tries after the first, on transport errors, timeouts and 429/5xx")
    backoff_s: float = Field(0.5, ge=0, description="the wait before the first retry; doubled before each next")

    def identity(self) -> dict[str, Any]:
        """What decides the verdicts (not where or how fast they are asked)."""
        return {
            "model": self.model,
            "template_sha": template_hash(self.template),
            "parser": self.parser,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }

    def version(self) -> str:
        """The judge verifier's version under this config: the cache key's version."""
        digest = hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:12]
        return f"{JudgeVerifier.version}+{digest}"


def template_hash(template: str) -> str:
    return hashlib.sha256(template.encode("utf-8")).hexdigest()[:16]


class JudgeVerifier(Verifier):
    """The registered name of the judge. It scores through the label stage, which gives it the question and the
    endpoint (`judge_verdicts`); asked alone (`rlvr verify`), it has neither and says so."""

    name = "judge"
    domain = "open"
    version = "1"
    needs = "endpoint"

    def score(self, response: str, reference: Any) -> Score:
        return Score(0.0, "error", reason="the judge scores in a run, with reward.judge set (docs/rewards.md)")

    def reference_error(self, reference: Any) -> str | None:
        """Any text or JSON value, or none at all: the judge reads it as text (`render`)."""
        if reference is None or isinstance(reference, str):
            return None
        try:
            json.dumps(reference)
        except (TypeError, ValueError, RecursionError) as exc:
            return one_line(f"a judge's reference must be text or JSON: {exc}")
        return None


def judged_reference(question: str, reference: Any) -> dict[str, Any]:
    """What the judge's verdict depends on besides the response: its cache key hashes both."""
    return {"question": question, "reference": reference}


@dataclass(frozen=True)
class JudgeItem:
    question: str
    reference: Any
    response: str


@dataclass(frozen=True)
class JudgeVerdict:
    """A verdict and how it was given: the judge's raw reply (None when the call failed) and the seconds taken."""

    score: Score
    raw: str | None
    seconds: float


def render(template: str, item: JudgeItem) -> str:
    """The template with the item's fields; a reference that is not text is given as JSON."""
    reference = item.reference if isinstance(item.reference, str) else json.dumps(item.reference, sort_keys=True)
    return template.format(question=item.question, reference=reference or "", response=item.response)


def parse_reply(text: str, parser: str) -> Score:
    """The verdict in a judge's reply; `error` when it holds none (never a 0 the judge did not give)."""
    shown = one_line(text)[:120]
    if parser == "yes_no":
        found = re.search(r"\b(yes|no)\b", text, re.IGNORECASE)
        if found is None:
            return Score(0.0, "error", reason=f"the judge's reply has no yes or no: {shown!r}")
        yes = found.group(1).lower() == "yes"
        return Score(1.0 if yes else 0.0, "ok" if yes else "wrong", extracted=found.group(1).lower())
    if parser == "score_10":
        found = re.search(r"(?<![\d.])(10(?:\.0+)?|\d(?:\.\d+)?)(?![\d.])", text)
        if found is None:
            return Score(0.0, "error", reason=f"the judge's reply has no score from 0 to 10: {shown!r}")
        value = float(found.group(1)) / 10
        return Score(value, "ok" if value >= 0.5 else "wrong", components={"judge": value}, extracted=found.group(1))
    return _parse_json(text, shown)


def _parse_json(text: str, shown: str) -> Score:
    start, end = text.find("{"), text.rfind("}")
    try:
        data = json.loads(text[start : end + 1]) if 0 <= start < end else None
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("correct"), bool):
        value = 1.0 if data["correct"] else 0.0
    elif isinstance(data, dict) and isinstance(data.get("score"), int | float) and 0 <= data["score"] <= 1:
        value = float(data["score"])
    else:
        return Score(0.0, "error", reason=f"the judge's reply has no JSON score in [0, 1] or 'correct': {shown!r}")
    return Score(value, "ok" if value >= 0.5 else "wrong", components={"judge": value}, extracted=json.dumps(data))


class _Pace:
    """At most `per_minute` starts a minute, evenly spaced, across threads."""

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


class _CallFailed(Exception):
    """One try failed; `retry` says whether another try may succeed."""

    def __init__(self, problem: str, retry: bool) -> None:
        super().__init__(problem)
        self.retry = retry


class JudgeClient:
    """Asks the judge for many verdicts at once (`verdicts`), each within its deadline."""

    def __init__(self, cfg: JudgeConfig) -> None:
        self.cfg = cfg
        self.url = f"{cfg.base_url.rstrip('/')}/chat/completions"
        self.pace = _Pace(cfg.requests_per_minute)

    def verdicts(self, items: Sequence[JudgeItem]) -> list[JudgeVerdict]:
        """One verdict per item, in order."""
        if not items:
            return []
        limits = httpx.Limits(max_connections=self.cfg.concurrency, max_keepalive_connections=self.cfg.concurrency)
        workers = min(self.cfg.concurrency, len(items))
        with (
            httpx.Client(timeout=httpx.Timeout(self.cfg.timeout_s), limits=limits) as client,
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="judge") as pool,
        ):
            return list(pool.map(lambda item: self._verdict(client, item), items))

    def _verdict(self, client: httpx.Client, item: JudgeItem) -> JudgeVerdict:
        started = time.monotonic()
        body = {
            "model": self.cfg.model,
            "messages": [{"role": "user", "content": render(self.cfg.template, item)}],
            "max_tokens": self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
            "seed": 0,
        }
        problem = ""
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                time.sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
            self.pace.wait()
            try:
                raw = self._call(client, body)
            except _CallFailed as failure:
                problem = str(failure)
                if failure.retry:
                    continue
                break
            score = parse_reply(raw, self.cfg.parser)
            if score.status != "error":  # the judge's own words are the verdict's reason (and cached with it)
                score = replace(score, reason=raw)
            return JudgeVerdict(score, raw, time.monotonic() - started)
        tries = f" after {attempt + 1} tries" if attempt else ""
        reason = one_line(f"judge {self.url}: {problem}{tries}")
        return JudgeVerdict(Score(0.0, "error", reason=reason), None, time.monotonic() - started)

    def _call(self, client: httpx.Client, body: dict[str, Any]) -> str:
        """The reply's text, read within the deadline however slowly it arrives."""
        deadline = time.monotonic() + self.cfg.timeout_s
        try:
            with client.stream("POST", self.url, json=body) as response:
                content = b""
                for chunk in response.iter_bytes():
                    content += chunk
                    if time.monotonic() > deadline:
                        raise _CallFailed(f"no whole answer within {self.cfg.timeout_s:g}s", retry=True)
        except httpx.TimeoutException:
            raise _CallFailed(f"timed out after {self.cfg.timeout_s:g}s", retry=True) from None
        except httpx.TransportError as exc:
            raise _CallFailed(f"{type(exc).__name__}: {exc}", retry=True) from None
        if response.status_code >= 400:
            text = one_line(content.decode("utf-8", "replace"))[:200]
            raise _CallFailed(f"HTTP {response.status_code}: {text}", retry=response.status_code in RETRIED_STATUSES)
        try:
            return str(json.loads(content)["choices"][0]["message"]["content"])
        except (ValueError, KeyError, IndexError, TypeError):
            shown = one_line(content.decode("utf-8", "replace"))[:120]
            raise _CallFailed(f"the answer is not a chat completion: {shown!r}", retry=True) from None
