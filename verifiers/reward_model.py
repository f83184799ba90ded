"""A reward model as a verifier: problems whose verifier is `reward_model` are scored by the servers of
`reward.model` over OpenRLHF's /get_reward (`rlvr serve-rm`, or any server with that shape; docs/rewards.md).

Each answer is sent as OpenRLHF's `query` (the question, a newline, the response), with the question as its
`prompts` entry and the reference as its `labels` entry; the reward is the server's number as it is, and the
verdict's status is `ok` when it is at least `threshold`. A batch the servers fail (after the client's retries)
is a verdict with status `error` for each of its answers, never a 0: left out of the update like a judge's.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from rlvr.verifiers.base import Score, Verifier
from rlvr.verifiers.judge import JudgeItem
from rlvr.verifiers.reward_client import RewardClientConfig, RewardModelClient, RewardServerError

QUERY = "{question}\n{response}"


class RewardModelConfig(RewardClientConfig):
    """Where the reward model is served (`reward.model`): the client's settings, the model's name and the
    threshold of an `ok` verdict."""

    name: str = Field(min_length=1, description="names the reward model in the reward cache (e.g. its model id)")
    threshold: float = Field(0.0, description="a reward at least this is an `ok` verdict, below it `wrong`")

    def identity(self) -> dict[str, Any]:
        """What decides the verdicts (not where the servers are or how long to wait)."""
        return {"name": self.name, "threshold": self.threshold, "query": QUERY}

    def version(self) -> str:
        digest = hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:12]
        return f"{RewardModelVerifier.version}+{digest}"


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
    """The reward model's verdict on each item, in order, and the seconds the batch took."""
    if not items:
        return [], 0.0
    queries = [QUERY.format(question=i.question, response=i.response) for i in items]
    labels = [None if i.reference is None else label_text(i.reference) for i in items]
    started = time.monotonic()
    try:
        with RewardModelClient(cfg) as client:
            rewards = client.get_reward(queries, [i.question for i in items], labels)
    except RewardServerError as exc:
        return [Score(0.0, "error", reason=str(exc))] * len(items), time.monotonic() - started
    seconds = time.monotonic() - started
    return [
        Score(r, "ok" if r >= cfg.threshold else "wrong", components={"reward_model": r}, extracted=f"{r:.6g}")
        for r in rewards
    ], seconds


def label_text(reference: Any) -> str:
    return reference if isinstance(reference, str) else json.dumps(reference, sort_keys=True)
