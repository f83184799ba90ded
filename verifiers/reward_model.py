"""A reward model as a verifier: problems whose verifier is `reward_model` are scored by the servers of
`reward.model` over OpenRLHF's /get_reward (`rlvr serve-rm`, or any server with that shape; docs/rewards.md).

Each answer is sent as OpenRLHF's `query` (the question, a newline, the response), with the question as its
`prompts` entry and the reference as its `labels` entry; the reward is the server's number as it is, and the
verdict's status is `ok` when it is at least `threshold`. A batch the servers fail (after the client's retries)
is a verdict with status `error` for each of its answers, never a 0: left out of the update like a judge's. In a
run, the servers' circuit breaker (rlvr/endpoints.py) counts each answer's verdict, as the judge's counts its calls.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from typing import Any

from pydantic import Field, PrivateAttr

from rlvr.endpoints import BREAKER_WINDOW, CircuitBreaker, breaker_for, rate_of
from rlvr.progress import report
from rlvr.verifiers.base import Score, Verifier
from rlvr.verifiers.judge import JudgeItem, estimate_line
from rlvr.verifiers.reward_client import RewardClientConfig, RewardModelClient, RewardServerError

QUERY = "{question}\n{response}"


class RewardModelConfig(RewardClientConfig):
    """Where the reward model is served (`reward.model`): the client's settings, the model's name and the
    threshold of an `ok` verdict."""

    name: str = Field(min_length=1, description="names the reward model in the reward cache (e.g. its model id)")
    threshold: float = Field(0.0, description="a reward at least this is an `ok` verdict, below it `wrong`")
    _max_error_rate: float | None = PrivateAttr(None)  # reward.max_error_rate, given by RewardConfig

    def identity(self) -> dict[str, Any]:
        """What decides the verdicts (not where the servers are or how long to wait)."""
        return {"name": self.name, "threshold": self.threshold, "query": QUERY}

    def version(self) -> str:
        digest = hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:12]
        return f"{RewardModelVerifier.version}+{digest}"

    def endpoint_name(self) -> str:
        """How a stop, a warning and the breaker name these servers."""
        return f"the reward model at {', '.join(self.urls)}"

    def hold_error_rate(self, max_error_rate: float | None) -> None:
        """Give the servers the run's reward.max_error_rate: their circuit breaker trips past it (RewardConfig)."""
        self._max_error_rate = max_error_rate

    def breaker(self) -> CircuitBreaker | None:
        """The process's breaker of these servers, in a run; None outside one."""
        if self._max_error_rate is None:
            return None
        return breaker_for(self.endpoint_name(), self._max_error_rate, BREAKER_WINDOW, unit="verdicts")


class RewardModelVerifier(Verifier):
    """The registered name of the reward model; it scores in a run, which gives it the question and the servers."""

    name = "reward_model"
    domain = "open"
    version = "1"
    needs = "endpoint"

    def score(self, response: str, reference: Any) -> Score:
        return Score(0.0, "error", reason="the reward model scores in a run, with reward.model set (docs/rewards.md)")

    def reference_error(self, reference: Any) -> str | None:
        return None  # any reference or none: it is sent as a label, as text


def reward_model_scores(cfg: RewardModelConfig, items: Sequence[JudgeItem]) -> tuple[list[Score], float]:
    """The reward model's verdict on each item, in order, and the seconds the batch took. In a run, `EndpointDown`
    (one line naming the servers) once their breaker trips."""
    if not items:
        return [], 0.0
    breaker, rate = cfg.breaker(), rate_of(cfg.endpoint_name())
    queries = [QUERY.format(question=i.question, response=i.response) for i in items]
    labels = [None if i.reference is None else label_text(i.reference) for i in items]
    started = time.monotonic()
    rate.started(started)
    try:
        with RewardModelClient(cfg) as client:
            rewards = client.get_reward(queries, [i.question for i in items], labels)
    except RewardServerError as exc:
        scores = [Score(0.0, "error", reason=str(exc))] * len(items)
    else:
        scores = [
            Score(r, "ok" if r >= cfg.threshold else "wrong", components={"reward_model": r}, extracted=f"{r:.6g}")
            for r in rewards
        ]
    seconds = time.monotonic() - started
    estimate = rate.done(len(items))
    if estimate is not None:
        report("warning", message=estimate_line(cfg.endpoint_name(), *estimate))
    if breaker is not None:
        for score in scores:
            breaker.record(score.status == "error", score.reason)
    return scores, seconds


def label_text(reference: Any) -> str:
    return reference if isinstance(reference, str) else json.dumps(reference, sort_keys=True)
