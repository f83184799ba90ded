"""Rewards given by models, in the label stage: the `reward` section (one place for the endpoints), the judge's
verdicts through the reward cache with their provenance, and the stop when too many of a step's calls fail.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlvr.errors import UserError
from rlvr.storage.store import Store
from rlvr.verifiers.cache import cache_entries, cache_for, cache_key
from rlvr.verifiers.judge import JudgeClient, JudgeConfig, JudgeItem, JudgeVerdict, JudgeVerifier, judged_reference


class RewardConfig(BaseModel):
    """The `reward` section: the endpoints of model-given rewards, and how many failed verdicts a step bears."""

    model_config = ConfigDict(extra="forbid")

    judge: JudgeConfig | None = Field(None, description="the LLM judge that problems naming verifier 'judge' get")
    max_error_rate: float = Field(
        0.1, ge=0.0, le=1.0, description="a step whose share of failed judge verdicts passes it stops the run"
    )

    def label_params(self) -> dict[str, Any]:
        """What the label stage is given besides its section (which carries the judge, `VerifierConfig.judge`):
        nothing without a judge, so ids stay those of runs without one."""
        return {} if self.judge is None else {"max_error_rate": self.max_error_rate}


def model_given(verifier: str) -> bool:
    """Whether `verifier` (a rewards row's) is a model's, whose failed verdicts are left out of the update."""
    from rlvr.verifiers.registry import registered

    cls = registered().get(verifier)
    return cls is not None and cls.needs != "nothing"


def judge_rollouts(
    store: Store | None, judge: JudgeConfig, rollouts: Sequence[Mapping[str, Any]], references: Mapping[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The `rewards` columns of each rollout (`prompt`, `response`, `problem_id`) by the judge: cached verdicts
    first, the misses asked (`JudgeClient`); and the new cache entries (failed calls are never cached)."""
    version = judge.version()
    items = [JudgeItem(str(r["prompt"]), references[r["problem_id"]], str(r["response"])) for r in rollouts]
    keys = [
        cache_key(JudgeVerifier.name, version, i.response, judged_reference(i.question, i.reference)) for i in items
    ]
    cache = cache_for(store)
    cached = cache.lookup(keys)
    misses = [k for k, score in enumerate(cached) if score is None]
    asked = dict(zip(misses, JudgeClient(judge).verdicts([items[k] for k in misses]), strict=True))
    entries = cache_entries([keys[k] for k in misses], [asked[k].score for k in misses])
    cache.add_entries(entries)
    rows = []
    for k, score in enumerate(cached):
        verdict = asked[k] if score is None else JudgeVerdict(score, score.reason, 0.0)
        rows.append(_row(judge, version, verdict, hit=score is not None))
    return rows, entries


def _row(judge: JudgeConfig, version: str, verdict: JudgeVerdict, hit: bool) -> dict[str, Any]:
    score = verdict.score
    provenance = {"endpoint": judge.base_url, "model": judge.model, "template_sha": judge.identity()["template_sha"]}
    return {
        "verifier": JudgeVerifier.name,
        "verifier_version": version,
        "score": score.value,
        "status": score.status,
        "extracted": score.extracted,
        "reason": score.reason,  # the judge's own words, or why there is no verdict
        "components": json.dumps(score.components, sort_keys=True),
        "cache_hit": hit,
        "latency_s": verdict.seconds,
        "provenance": json.dumps(provenance, sort_keys=True),
    }


def check_error_rate(rows: Sequence[Mapping[str, Any]], judge: JudgeConfig, max_error_rate: float) -> None:
    """Stop the run, in one line naming the endpoint and an error, when the step's failed share is too high."""
    failed = [r for r in rows if r["status"] == "error"]
    if not rows or len(failed) / len(rows) <= max_error_rate:
        return
    raise UserError(
        f"the judge at {judge.base_url} failed {len(failed)} of {len(rows)} verdicts this step "
        f"(more than reward.max_error_rate {max_error_rate:g}); first: {failed[0]['reason']}"
    )
