"""label: score every rollout with the domain's verifier; statuses, not silent zeros.

Verdicts come from the store's reward cache when this (verifier version, response, reference) was
scored before, otherwise from the verifier pool (worker processes with a hard timeout). New
cacheable verdicts are committed as a `reward_cache` artifact just before the step's `rewards`.
"""

from __future__ import annotations

import json

from prefect import task
from prefect.cache_policies import NONE
from rlvr.storage.errors import UserError
from rlvr.storage.stage import Built, StageOutput, commit_stage, open_store, rows_to_table
from rlvr.verifiers.cache import VerifierConfig, score_cached
from rlvr.verifiers.registry import verifier_class

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


@task(name="relabel", cache_policy=NONE)
def relabel(store_root: str, rewards_id: str, cfg: VerifierConfig) -> tuple[str, str]:
    """Re-score a committed `rewards` artifact with `cfg`'s verifier at its current version.

    Commits a `relabeled_rewards` artifact (the rewards schema; a kind of its own so the `rewards` view
    keeps meaning "what training saw") and a `relabel_flips` report with the rows whose score or status
    changed; returns both ids. Verdicts the current version already gave come from the reward cache.
    """
    store = open_store(store_root)
    old = store.manifest(rewards_id)
    if old.kind != "rewards":
        raise UserError(f"{rewards_id} is a {old.kind} artifact; relabel takes a rewards artifact")
    rollouts_id, problems_id = old.parents[0], old.parents[1]
    verifier = verifier_class(cfg.verifier)
    settings = {"verifier": cfg.verifier, "verifier_version": verifier.version}
    parents = (rewards_id, rollouts_id, problems_id)
    out = StageOutput("relabeled_rewards", "relabel", CODE_VERSION, old.run_id, parents, settings, step=old.step)
    flips_out = StageOutput("relabel_flips", "relabel", CODE_VERSION, old.run_id, (out.artifact_id,), settings,
                            step=old.step)
    if store.exists(flips_out.artifact_id):
        return out.artifact_id, flips_out.artifact_id

    before = {r["rollout_id"]: r for r in store.read_table(rewards_id).to_pylist()}
    rollouts = store.read_table(rollouts_id, columns=["rollout_id", "problem_id", "response"]).to_pylist()
    answer_of = {p["problem_id"]: p["answer"]
                 for p in store.read_table(problems_id, columns=["problem_id", "answer"]).to_pylist()}
    scores, hits, entries = score_cached(store, cfg, [(r["response"], answer_of[r["problem_id"]]) for r in rollouts])
    cache_out = StageOutput("reward_cache", "relabel", CODE_VERSION, old.run_id, parents, settings, step=old.step)
    commit_stage(store, cache_out, lambda: Built(rows_to_table("reward_cache", entries)))
    rows, flips = [], []
    for r, s, hit in zip(rollouts, scores, hits):
        was = before[r["rollout_id"]]
        rows.append({**was, "verifier": cfg.verifier, "verifier_version": verifier.version, "score": s.value,
                     "status": s.status, "extracted": s.extracted, "reason": s.reason,
                     "components": json.dumps(s.components, sort_keys=True), "cache_hit": hit})
        if (was["score"], was["status"]) != (s.value, s.status):
            flips.append({"rollout_id": r["rollout_id"], "run_id": was["run_id"], "step": was["step"],
                          "old_verifier_version": was["verifier_version"], "new_verifier_version": verifier.version,
                          "old_score": was["score"], "new_score": s.value, "old_status": was["status"],
                          "new_status": s.status})
    commit_stage(store, out, lambda: Built(rows_to_table("relabeled_rewards", rows)))
    commit_stage(store, flips_out, lambda: Built(rows_to_table("relabel_flips", flips)))
    return out.artifact_id, flips_out.artifact_id
