"""label: score every rollout with the domain's verifier; statuses, not silent zeros.

Verdicts come from the store's reward cache when this (verifier version, response, reference) was
scored before, otherwise from the verifier pool (worker processes with a hard timeout). New
cacheable verdicts are committed as a `reward_cache` artifact just before the step's `rewards`.
"""

from __future__ import annotations

import json

from prefect import task
from prefect.cache_policies import NONE
from storage.stage import Built, StageOutput, commit_stage, open_store, rows_to_table
from verifiers.cache import VerifierConfig, score_cached
from verifiers.registry import verifier_class

CODE_VERSION = "1"


LabelConfig = VerifierConfig  # the `label` section of the run config


@task(name="label", cache_policy=NONE)
def label(store_root: str, run_id: str, step: int, cfg: LabelConfig, problems_id: str, rollouts_id: str) -> str:
    """Commit the step's `rewards` (one row per rollout, same order)."""
    store = open_store(store_root)
    verifier = verifier_class(cfg.verifier)
    settings = {"verifier": cfg.verifier, "verifier_version": verifier.version}
    parents = (rollouts_id, problems_id)
    out = StageOutput("rewards", "label", CODE_VERSION, run_id, parents, settings, step=step)
    cache_out = StageOutput("reward_cache", "label", CODE_VERSION, run_id, parents, settings, step=step)
    if store.exists(out.artifact_id):
        return out.artifact_id

    rollouts = store.read_table(rollouts_id, columns=["rollout_id", "problem_id", "response"]).to_pylist()
    problems = store.read_table(problems_id, columns=["problem_id", "answer"]).to_pylist()
    answer_of = {p["problem_id"]: p["answer"] for p in problems}
    pairs = [(r["response"], answer_of[r["problem_id"]]) for r in rollouts]
    scores, hits, entries = score_cached(store, cfg, pairs)
    commit_stage(store, cache_out, lambda: Built(rows_to_table("reward_cache", entries)))
    rows = [
        {"rollout_id": r["rollout_id"], "run_id": run_id, "step": step, "problem_id": r["problem_id"],
         "verifier": cfg.verifier, "verifier_version": verifier.version, "score": s.value, "status": s.status,
         "extracted": s.extracted, "reason": s.reason, "components": json.dumps(s.components, sort_keys=True),
         "cache_hit": hit}
        for r, s, hit in zip(rollouts, scores, hits)
    ]
    return commit_stage(store, out, lambda: Built(rows_to_table("rewards", rows)))
