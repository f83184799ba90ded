"""Rewards given by models, in the label stage: the `reward` section (one place for the endpoints), the judge's
verdicts through the reward cache with their provenance, and the stops when too many calls fail: a step's share
(`check_error_rate`, in the label stage) and, in every stage that asks, the endpoints' circuit breakers over their
last calls (rlvr/endpoints.py), which `reward.max_error_rate` sets. A stage about to ask a model many times says how
many, and after its first calls how long the rest will take (`announce_calls`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlvr.endpoints import rate_of
from rlvr.errors import UserError
from rlvr.progress import report
from rlvr.storage.store import Store
from rlvr.verifiers.cache import MODEL_VERIFIERS, VerifierConfig, cache_for, cache_key, stage_entries
from rlvr.verifiers.judge import (
    JudgeClient,
    JudgeConfig,
    JudgeItem,
    JudgeVerdict,
    JudgeVerifier,
    judged_reference,
    template_hash,
)
from rlvr.verifiers.reward_model import RewardModelConfig, reward_model_scores


class RewardConfig(BaseModel):
    """The `reward` section: the endpoints of model-given rewards, and how many failed verdicts a step bears."""

    model_config = ConfigDict(extra="forbid")

    judge: JudgeConfig | None = Field(None, description="the LLM judge that problems naming verifier 'judge' get")
    model: RewardModelConfig | None = Field(
        None, description="the reward-model servers (/get_reward) that problems naming verifier 'reward_model' get"
    )
    max_error_rate: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="a step whose share of failed model verdicts passes it stops the run, and so does an endpoint "
        "whose failures among its last 200 calls pass it, in any stage",
    )

    @model_validator(mode="after")
    def _breakers_hold_the_threshold(self) -> RewardConfig:
        """The endpoints' circuit breakers trip past max_error_rate, wherever their config is handed on to."""
        for endpoint in (self.judge, self.model):
            if endpoint is not None:
                endpoint.hold_error_rate(self.max_error_rate)
        return self

    @property
    def given(self) -> bool:
        """Whether the run has a model-given reward (else the section is left out of dumps, so ids stay)."""
        return self.judge is not None or self.model is not None

    def label_params(self) -> dict[str, Any]:
        """What the label stage is given besides its section (which carries the endpoints: `VerifierConfig.judge`
        and `.reward_model`): nothing without one, so ids stay those of runs without one."""
        return {"max_error_rate": self.max_error_rate} if self.given else {}


def model_given(verifier: str) -> bool:
    """Whether `verifier` (a rewards row's) is a model's, whose failed verdicts are left out of the update."""
    from rlvr.verifiers.registry import registered

    cls = registered().get(verifier)
    return cls is not None and cls.needs != "nothing"


def model_rollouts(
    store: Store | None,
    cfg: VerifierConfig,
    name: str,
    rollouts: Sequence[Mapping[str, Any]],
    references: Mapping[str, Any],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The `rewards` columns of each rollout (`prompt`, `response`, `problem_id`) scored by the model verifier
    `name` (the judge, `cfg.judge`, or the reward model, `cfg.reward_model`): cached verdicts first, the misses
    asked; and the new cache entries (failed calls are never cached)."""
    version = cfg.endpoint_version(name)
    assert version is not None, name
    items = [JudgeItem(str(r["prompt"]), references[r["problem_id"]], str(r["response"])) for r in rollouts]
    keys = [cache_key(name, version, i.response, judged_reference(i.question, i.reference)) for i in items]
    cache = cache_for(store)
    cached = cache.lookup(keys)
    misses = [k for k, score in enumerate(cached) if score is None]
    asked = dict(zip(misses, ask(cfg, name, [items[k] for k in misses]), strict=True))
    scores = [asked[k].score if score is None else score for k, score in enumerate(cached)]
    entries = stage_entries(cache, keys, scores, [score is not None for score in cached])
    cache.add_entries(entries)
    provenance = json.dumps(provenance_of(cfg, name), sort_keys=True)
    rows = []
    for k, score in enumerate(cached):
        verdict = asked[k] if score is None else JudgeVerdict(score, score.reason, 0.0)
        rows.append(_row(name, version, verdict, hit=score is not None, provenance=provenance))
    return rows, entries


def ask(cfg: VerifierConfig, name: str, items: list[JudgeItem]) -> list[JudgeVerdict]:
    """The model's verdicts on `items`: each judge call's own seconds; a reward model's batch shared out evenly."""
    if name == JudgeVerifier.name:
        assert cfg.judge is not None
        return JudgeClient(cfg.judge).verdicts(items)
    assert cfg.reward_model is not None
    scores, seconds = reward_model_scores(cfg.reward_model, items)
    return [JudgeVerdict(score, score.extracted, seconds / len(items)) for score in scores]


def provenance_of(cfg: VerifierConfig, name: str) -> dict[str, Any]:
    """Where a model verifier's rewards come from, as the rewards table records it."""
    if name == JudgeVerifier.name:
        assert cfg.judge is not None
        return {
            "endpoint": cfg.judge.base_url,
            "model": cfg.judge.model,
            "template_sha": template_hash(cfg.judge.template),
        }
    assert cfg.reward_model is not None
    return {"endpoints": cfg.reward_model.urls, "model": cfg.reward_model.name}


def endpoint_of(cfg: VerifierConfig, name: str) -> str:
    """The endpoint a stop names."""
    if name == JudgeVerifier.name:
        assert cfg.judge is not None
        return cfg.judge.endpoint_name()
    assert cfg.reward_model is not None
    return cfg.reward_model.endpoint_name()


MANY_CALLS = 100  # a stage planning at least this many calls of a model says so before it asks


def announce_calls(stage: str, cfg: VerifierConfig, verifiers: Sequence[str | None], per_problem: int) -> None:
    """Before `stage` asks: for each model that scores some of the problems (whose own verifiers are `verifiers`),
    `per_problem` times each, a warning with the number of calls when they are many, and a plan for the model's
    measured rate, which gives the estimate of the rest once the first calls are answered (2 rounds of the judge's
    `concurrency`, or a reward model's first batch)."""
    names = [cfg.verifier_of(name) for name in verifiers]
    for name in sorted(MODEL_VERIFIERS.intersection(names)):
        if cfg.endpoint_version(name) in (None, verifier_class_version(name)):
            continue  # no endpoint set: the stage's verdicts say so
        problems = names.count(name)
        calls = problems * per_problem
        if calls < MANY_CALLS:
            continue
        endpoint = endpoint_of(cfg, name)
        sample = 2 * cfg.judge.concurrency if name == JudgeVerifier.name and cfg.judge is not None else 1
        rate_of(endpoint).plan(stage, calls, sample)
        report(
            "warning",
            message=f"{stage} will ask {endpoint} for up to {calls:,} verdicts ({problems:,} problems x "
            f"{per_problem}; the reward cache answers the ones it holds)",
        )


def verifier_class_version(name: str) -> str:
    from rlvr.verifiers.registry import verifier_class

    return verifier_class(name).version


def _row(name: str, version: str, verdict: JudgeVerdict, hit: bool, provenance: str) -> dict[str, Any]:
    score = verdict.score
    return {
        "verifier": name,
        "verifier_version": version,
        "score": score.value,
        "status": score.status,
        "extracted": score.extracted,
        "reason": score.reason,  # the judge's own words, or why there is no verdict
        "components": json.dumps(score.components, sort_keys=True),
        "cache_hit": hit,
        "latency_s": verdict.seconds,
        "provenance": provenance,
    }


def check_error_rate(rows: Sequence[Mapping[str, Any]], endpoint: str, max_error_rate: float) -> None:
    """Stop the run, in one line naming the endpoint and an error, when the step's failed share is too high."""
    failed = [r for r in rows if r["status"] == "error"]
    if not rows or len(failed) / len(rows) <= max_error_rate:
        return
    raise UserError(
        f"{endpoint} failed {len(failed)} of {len(rows)} verdicts this step "
        f"(more than reward.max_error_rate {max_error_rate:g}); first: {failed[0]['reason']}"
    )


def split_by_model(
    cfg: VerifierConfig, rollouts: Sequence[dict[str, Any]], references: Mapping[str, tuple[str | None, Any]]
) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    """The rollouts a model scores, by model verifier (the judge, a reward model), and the rest, for the verifiers'
    pool; `references` maps problem ids to (verifier, reference)."""
    judged: dict[str, list[dict[str, Any]]] = {name: [] for name in MODEL_VERIFIERS}
    plain: list[dict[str, Any]] = []
    for r in rollouts:
        judged.get(cfg.verifier_of(references[r["problem_id"]][0]), plain).append(r)
    return judged, plain


def model_verdicts(
    store: Store | None,
    cfg: VerifierConfig,
    judged: dict[str, list[dict[str, Any]]],
    references: Mapping[str, tuple[str | None, Any]],
    max_error_rate: float | None,
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """rollout_id -> its rewards columns for the rollouts each model scores (`split_by_model`; the endpoints are
    the run's reward section, carried by `cfg`), and the new cache entries. With `max_error_rate` (a run's label
    stage), a model whose failed share passes it stops the run; without (a relabelling), failures stay `error` rows."""
    from rlvr.verifiers.registry import verifier_class

    found: dict[str, dict[str, Any]] = {}
    entries: list[dict[str, Any]] = []
    answers = {pid: ref for pid, (_, ref) in references.items()}
    for name, mine in sorted(judged.items()):
        if not mine:
            continue
        if cfg.endpoint_version(name) in (None, verifier_class(name).version):
            setting = "reward.judge" if name == JudgeVerifier.name else "reward.model"
            raise UserError(f"problems name the {name!r} verifier but {setting} is not set (docs/rewards.md)")
        rows, made = model_rollouts(store, cfg, name, mine, answers)
        if max_error_rate is not None:
            check_error_rate(rows, endpoint_of(cfg, name), max_error_rate)
        found |= {r["rollout_id"]: row for r, row in zip(mine, rows, strict=True)}
        entries += made
    return found, entries
