"""label: score every rollout with the run's verifier (`label.verifier`); statuses, not silent zeros.

Verdicts come from the store's reward cache when this (verifier version, response, reference) was
scored before, otherwise from the verifier pool (worker processes with a hard timeout). The new
cacheable verdicts are committed as a `reward_cache` artifact beside the step's `rewards`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.verifiers.cache import VerifierConfig, score_cached
from rlvr.verifiers.registry import verifier_class


def build(inputs: Inputs, cfg: VerifierConfig, ctx: StageContext) -> dict[str, Built]:
    rollouts = inputs.rows("rollouts", ["rollout_id", "problem_id", "response"])
    answer_of = dict(zip(*inputs.table("problems", ["problem_id", "answer"]).to_pydict().values()))
    scores, hits, entries = score_cached(
        ctx.store, cfg, [(r["response"], answer_of[r["problem_id"]]) for r in rollouts]
    )
    version = verifier_class(cfg.verifier).version
    rows = [
        {
            "rollout_id": r["rollout_id"],
            "run_id": ctx.run_id,
            "step": ctx.step,
            "problem_id": r["problem_id"],
            "verifier": cfg.verifier,
            "verifier_version": version,
            "score": s.value,
            "status": s.status,
            "extracted": s.extracted,
            "reason": s.reason,
            "components": json.dumps(s.components, sort_keys=True),
            "cache_hit": hit,
        }
        for r, s, hit in zip(rollouts, scores, hits)
    ]
    return {
        "reward_cache": Built(rows_to_table("reward_cache", entries)),
        "rewards": Built(rows_to_table("rewards", rows)),
    }


def identity(cfg: VerifierConfig, params: Mapping[str, Any]) -> dict[str, Any]:
    """The verifier and its version decide the verdicts; its pool settings do not."""
    return {"verifier": cfg.verifier, "verifier_version": verifier_class(cfg.verifier).version}


LABEL: Stage[VerifierConfig] = Stage(
    name="label",
    code_version="2",
    section="label",
    config=VerifierConfig,
    inputs=("rollouts", "problems"),
    outputs={"reward_cache": Output("reward_cache"), "rewards": Output("rewards")},
    build=build,
    identity=identity,
)
