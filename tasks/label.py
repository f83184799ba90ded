"""label: score every rollout with its problem's verifier (or `label.verifier` for all); statuses, not silent zeros.

Verdicts come from the store's reward cache when this (verifier version, response, reference) was
scored before, otherwise from the verifier pool (worker processes with a hard timeout). The new
cacheable verdicts are committed as a `reward_cache` artifact beside the step's `rewards`.

A step with more than `verify_chunk` rollouts scores its cache misses in chunks of that size, each a
unit of the run's fan-out (`params["fan_out"]`, flows/executors.py): on another backend the chunks are
verified on the workers. Which verdicts are cache hits is decided here, before any chunk runs, so the
rows are the same wherever the chunks ran.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.storage.store import Store
from rlvr.verifiers.base import Score
from rlvr.verifiers.cache import (
    CACHEABLE,
    CacheKey,
    VerifierConfig,
    cache_key,
    problem_references,
    reward_cache,
    score_cached,
    score_rollouts,
    score_to_entry,
    verifier_identity,
    version_of,
)


@dataclass(frozen=True)
class VerifyJob:
    """A chunk of cache misses: (response, reference) pairs and the verifier that scores each."""

    cfg: VerifierConfig
    pairs: list[tuple[Any, Any]]
    names: list[str]


def verify_chunk(job: VerifyJob) -> list[Score]:
    """Verdicts of one chunk (in the worker's process, through its verifier pool)."""
    scores, _, _ = score_cached(None, job.cfg, job.pairs, job.names)
    return scores


def score_in_chunks(
    store: Store,
    cfg: VerifierConfig,
    rollouts: Sequence[dict[str, Any]],
    problems: Mapping[str, tuple[str | None, Any]],
    fan_out: Callable[..., Iterator[list[Score]]],
    chunk: int,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What `score_rollouts` returns (verdict columns per rollout, new cache entries), with the misses
    verified by `fan_out` in chunks of `chunk` pairs."""
    pairs = [(r["response"], problems[r["problem_id"]][1]) for r in rollouts]
    names = [cfg.verifier_of(problems[r["problem_id"]][0]) for r in rollouts]
    keys = [cache_key(name, version_of(name), response, ref) for name, (response, ref) in zip(names, pairs)]
    cache = reward_cache(store)
    scores = cache.lookup(keys)
    hits = [score is not None for score in scores]
    misses = [i for i, score in enumerate(scores) if score is None]
    chunks = [misses[at : at + chunk] for at in range(0, len(misses), chunk)]
    jobs = [VerifyJob(cfg, [pairs[i] for i in part], [names[i] for i in part]) for part in chunks]
    entries: dict[CacheKey, dict[str, Any]] = {}
    for part, fresh in zip(chunks, fan_out(verify_chunk, jobs)):
        for i, score in zip(part, fresh):
            scores[i] = score
            if score.status in CACHEABLE and keys[i] not in entries:
                entries[keys[i]] = score_to_entry(keys[i], score)
                cache.remember(keys[i], score)
    verdicts = [
        {
            "verifier": name,
            "verifier_version": version_of(name),
            "score": score.value,
            "status": score.status,
            "extracted": score.extracted,
            "reason": score.reason,
            "components": json.dumps(score.components, sort_keys=True),
            "cache_hit": hit,
        }
        for name, score, hit in zip(names, scores, hits)
        if score is not None
    ]
    return verdicts, list(entries.values())


def build(inputs: Inputs, cfg: VerifierConfig, ctx: StageContext) -> dict[str, Built]:
    """params: `fan_out` and `verify_chunk` (where chunks of verifications run when a step has more than
    `verify_chunk` rollouts; in place, in one piece, without them)."""
    rollouts = inputs.rows("rollouts", ["rollout_id", "problem_id", "response"])
    references = problem_references(inputs.table("problems", ["problem_id", "verifier", "reference"]))
    chunk = ctx.params.get("verify_chunk")
    if ctx.store is not None and "fan_out" in ctx.params and chunk and len(rollouts) > chunk:
        verdicts, entries = score_in_chunks(ctx.store, cfg, rollouts, references, ctx.params["fan_out"], chunk)
    else:
        verdicts, entries = score_rollouts(ctx.store, cfg, rollouts, references)
    rows = [
        {"rollout_id": r["rollout_id"], "run_id": ctx.run_id, "step": ctx.step, "problem_id": r["problem_id"], **v}
        for r, v in zip(rollouts, verdicts)
    ]
    return {
        "reward_cache": Built(rows_to_table("reward_cache", entries)),
        "rewards": Built(rows_to_table("rewards", rows)),
    }


LABEL: Stage[VerifierConfig] = Stage(
    name="label",
    code_version="3",
    section="label",
    config=VerifierConfig,
    inputs=("rollouts", "problems"),
    outputs={"reward_cache": Output("reward_cache"), "rewards": Output("rewards")},
    build=build,
    identity=verifier_identity,
)
