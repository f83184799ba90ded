"""label: score every rollout with its problem's verifier (or `label.verifier` for all); statuses, not silent zeros.

Verdicts come from the store's reward cache when this (verifier version, response, reference) was
scored before, otherwise from the verifier pool (worker processes with a hard timeout). The new
cacheable verdicts are committed as a `reward_cache` artifact beside the step's `rewards`.

A step with more than `flow.executor.verify_chunk` rollouts scores its cache misses in chunks of that
size, each a unit of the run's fan-out (`params["fan_out"]`, flows/executors.py, which carries that
setting): on another backend the chunks are verified on the workers. Which verdicts are cache hits is
decided here, before any chunk runs, so the rows are the same wherever the chunks ran.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.verifiers.base import Score
from rlvr.verifiers.cache import (
    MissScorer,
    VerifierConfig,
    problem_references,
    score_fresh,
    score_rollouts,
    verifier_identity,
)
from rlvr.verifiers.model_rewards import model_verdicts, split_by_model
from rlvr.verifiers.outcomes import DEFAULT_MAX_ERROR_RATE, check_error_share, is_error


@dataclass(frozen=True)
class VerifyJob:
    """A chunk of cache misses: (response, reference) pairs and the verifier that scores each."""

    cfg: VerifierConfig
    pairs: list[tuple[Any, Any]]
    names: list[str]


def score_chunk(job: VerifyJob) -> list[Score]:
    """Verdicts of one chunk (in the worker's process, through its verifier pool)."""
    return score_fresh(job.cfg, job.names, job.pairs)


def chunked(fan_out: Callable[..., Iterator[list[Score]]], chunk: int) -> MissScorer:
    """A `score_misses` that verifies the misses in chunks of `chunk` pairs, each a unit of `fan_out`."""

    def score(cfg: VerifierConfig, names: list[str], pairs: list[tuple[Any, Any]]) -> list[Score]:
        starts = range(0, len(pairs), chunk)
        jobs = [VerifyJob(cfg, pairs[at : at + chunk], names[at : at + chunk]) for at in starts]
        return [verdict for part in fan_out(score_chunk, jobs) for verdict in part]

    return score


def build(inputs: Inputs, cfg: VerifierConfig, ctx: StageContext) -> dict[str, Built]:
    """params: `fan_out`, the run's FanOut: where chunks of verifications run when a step has more than its
    `verify_chunk` rollouts (in place, in one piece, without one)."""
    table = inputs.table("rollouts")
    given = environment_verdicts(table)  # an environment that gives its own reward has scored these already
    references = problem_references(inputs.table("problems", ["problem_id", "verifier", "reference"]))
    columns = table.select(["rollout_id", "problem_id", "prompt", "response"]).to_pylist()
    unscored = [r for r in columns if r["rollout_id"] not in given]
    judged, rollouts = split_by_model(cfg, unscored, references)
    max_error_rate = float(ctx.params.get("max_error_rate", DEFAULT_MAX_ERROR_RATE))
    model_of, model_entries = model_verdicts(ctx.store, cfg, judged, references, max_error_rate)
    fan_out = ctx.params.get("fan_out")
    chunk = getattr(fan_out, "verify_chunk", None)  # a FanOut has it (flow.executor.verify_chunk); `map` has not
    misses: MissScorer = score_fresh
    if fan_out is not None and chunk and len(rollouts) > chunk:
        misses = chunked(fan_out, chunk)
    verdicts, entries = score_rollouts(ctx.store, cfg, rollouts, references, misses)
    verdict_of = {r["rollout_id"]: v for r, v in zip(rollouts, verdicts)} | given | model_of
    rows = [
        {
            "rollout_id": r["rollout_id"],
            "run_id": ctx.run_id,
            "step": ctx.step,
            "problem_id": r["problem_id"],
            **verdict_of[r["rollout_id"]],
        }
        for r in table.select(["rollout_id", "problem_id"]).to_pylist()
    ]
    check_error_share(rows, f"rewards of step {ctx.step}", max_error_rate)
    return {
        "reward_cache": Built(rows_to_table("reward_cache", [*entries, *model_entries])),
        "rewards": Built(rows_to_table("rewards", rows)),
    }


def environment_verdicts(rollouts: pa.Table) -> dict[str, dict[str, Any]]:
    """rollout_id -> its rewards columns, for the episodes their environment decided: the rollout loop gave each
    such episode its verdict (`env_verdict`: the environment's own, its reward against `env.solved_at`, or an
    error for an episode that failed), and the environment ("name@version") stands as the verifier. An episode
    with neither a verdict nor a reward is left to the verifier (one that the environment names to score its
    final answer). A reward with no verdict (rollouts sampled before verdicts were recorded) is an error, never
    read as solved."""
    if "env_reward" not in rollouts.column_names:  # rollouts written before environments
        return {}
    found = {}
    for r in rollouts.select(["rollout_id", "env", "env_reward", "env_verdict"]).to_pylist():
        if r["env_verdict"] is None and r["env_reward"] is None:
            continue
        verdict = json.loads(r["env_verdict"]) if r["env_verdict"] else UNDECIDED
        status = verdict.get("status", "error")
        score = 0.0 if is_error(status) or r["env_reward"] is None else float(r["env_reward"])
        name, _, version = str(r["env"]).partition("@")
        found[r["rollout_id"]] = {
            "verifier": f"env:{name}",
            "verifier_version": version,
            "score": score,
            "status": status,
            "extracted": verdict.get("extracted"),
            "reason": verdict.get("reason"),
            "components": json.dumps(verdict.get("components") or {}, sort_keys=True),
            "cache_hit": False,
        }
    return found


UNDECIDED = {"status": "error", "reason": "the environment's reward came without a verdict (sampled before v5)"}


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
