"""restructure: CLPO (off by default; `restructure.enabled`). The step's rollouts label each problem hard,
medium or easy; hard ones are simplified and medium ones diversified by the rewriter; every rewrite is
sampled `restructure.rollouts` times by the current policy and verified against its reference, and kept
only when it is solved sometimes but not always and does not reveal its answer. Kept rewrites are new
problems (`parent_problem_id`, `derivation`) that join the pool from the next step on.

Writes `restructured` (one row per group: its accuracy, label, KL weight, and the fate of its rewrite)
and `problems` (the kept rewrites). The trainer reads the KL weights of the step's groups from it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from functools import partial
from typing import Any

from rlvr.curricula.clpo import (
    RestructureConfig,
    Rewrite,
    Rewriter,
    RewriteRequest,
    keeps_rewrite,
    kl_weight,
    label_of,
    mode_for,
    reveals_answer,
)
from rlvr.data.sources import ProceduralRewriter, make_sources
from rlvr.storage.ids import row_id
from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.trainer.checkpoints import load_policy
from rlvr.trainer.devices import stage_device, usage
from rlvr.trainer.engines import EngineConfig, engine_for
from rlvr.trainer.policy import Policy
from rlvr.trainer.rewriting import PolicyRewriter
from rlvr.verifiers.cache import VerifierConfig, score_cached
from rlvr.verifiers.registry import verifier_class

PROBLEM_COLUMNS = [
    "problem_id",
    "split",
    "domain",
    "category",
    "prompt",
    "reference",
    "answer",
    "verifier",
    "source",
    "generator",
    "generator_version",
]


def group_accuracy(inputs: Inputs) -> list[tuple[int, str, float]]:
    """(slot, problem_id, share of its rollouts verified ok) for every group of the step, by slot."""
    status_of = dict(zip(*inputs.table("rewards", ["rollout_id", "status"]).to_pydict().values()))
    groups: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in inputs.rows("rollouts", ["rollout_id", "slot", "problem_id"]):
        groups[r["slot"]].append(r)
    return [
        (slot, rows[0]["problem_id"], sum(status_of[r["rollout_id"]] == "ok" for r in rows) / len(rows))
        for slot, rows in sorted(groups.items())
    ]


def build(inputs: Inputs, cfg: RestructureConfig, ctx: StageContext) -> dict[str, Built]:
    """Inputs: the pool's problems, the step's rollouts and rewards (every round) and the policy.
    params: `verifier` (label section), `rollout` (the engine that samples rewrites), `sources` (the
    synthesize sources, for the procedural rewriter), `device` (the run's policy.device)."""
    pool = {p["problem_id"]: p for p in inputs.rows("problems", PROBLEM_COLUMNS)}
    groups = group_accuracy(inputs)
    requests = _requests(groups, pool, cfg)
    policy = inputs.load("policy", partial(load_policy, device=stage_device(ctx.params.get("device"))))
    rewrites = _rewriter(cfg, pool, policy, ctx).rewrite(requests)
    verdicts = _verify(rewrites, requests, pool, policy, cfg, ctx)
    ctx.usage.update(usage(policy.model))
    new_problems, fate = [], {}
    for request, rewrite, (accuracy, reason) in zip(requests, rewrites, verdicts):
        kept = reason == "kept"
        fate[request.problem_id] = (request.mode, rewrite, accuracy, kept, reason)
        if kept and rewrite is not None:
            new_problems.append(_problem_row(pool[request.problem_id], rewrite, request.mode, ctx))
    rows, reported = [], set()
    for slot, pid, accuracy in groups:  # a problem in several slots: its rewrite is reported with the first
        rows.append(_audit_row(slot, pid, accuracy, cfg, fate.get(pid) if pid not in reported else None, ctx))
        reported.add(pid)
    return {
        "restructured": Built(rows_to_table("restructured", rows), extra={"kept": len(new_problems)}),
        "problems": Built(rows_to_table("problems", new_problems)),
    }


def _requests(
    groups: list[tuple[int, str, float]], pool: dict[str, dict[str, Any]], cfg: RestructureConfig
) -> list[RewriteRequest]:
    """One request per distinct problem whose label calls for a rewrite (its first slot decides)."""
    requests, seen = [], set()
    for _, pid, accuracy in groups:
        mode = mode_for(label_of(accuracy, cfg), cfg)
        if mode is None or pid in seen:
            continue
        seen.add(pid)
        problem = pool[pid]
        requests.append(RewriteRequest(pid, problem["prompt"], problem["answer"], problem["domain"] or "", mode))
    return requests


def _rewriter(cfg: RestructureConfig, pool: dict[str, dict[str, Any]], policy: Policy, ctx: StageContext) -> Rewriter:
    if cfg.rewriter == "procedural":
        return ProceduralRewriter(make_sources(ctx.params["sources"]), {pid: p["source"] for pid, p in pool.items()})
    scoring: VerifierConfig = ctx.params["verifier"]
    verifier_of_domain = {p["domain"] or "": scoring.verifier_of(p["verifier"]) for p in pool.values()}
    return PolicyRewriter(
        policy, lambda domain: verifier_class(verifier_of_domain[domain]).rewrite_templates, cfg.max_new_tokens
    )


def _verify(
    rewrites: list[Rewrite | None],
    requests: list[RewriteRequest],
    pool: dict[str, dict[str, Any]],
    policy: Policy,
    cfg: RestructureConfig,
    ctx: StageContext,
) -> list[tuple[float | None, str]]:
    """(accuracy of the policy on the rewrite, why it is kept or not) per request."""
    pool_prompts = {p["prompt"] for p in pool.values()}
    reasons: list[str | None] = []
    for rewrite in rewrites:
        if rewrite is None:
            reasons.append("no rewrite")
        elif reveals_answer(rewrite.prompt, rewrite.answer):
            reasons.append("reveals the answer")
        elif rewrite.prompt in pool_prompts:
            reasons.append("already in the pool")
        else:
            reasons.append(None)
    todo = [
        (i, rewrite)
        for i, (rewrite, reason) in enumerate(zip(rewrites, reasons))
        if reason is None and rewrite is not None
    ]
    accuracy: dict[int, float] = {}
    if todo:
        engine_cfg: EngineConfig = ctx.params["rollout"]
        engine = engine_for(engine_cfg)
        engine.update_weights(policy, ctx.input_ids["policy"][0])
        sampling = engine_cfg.sampling(ctx.derive_seed("restructure", ctx.step))
        samples = engine.generate([r.prompt for _, r in todo], [cfg.rollouts] * len(todo), sampling)
        parents = [pool[requests[i].problem_id] for i, _ in todo]
        pairs = [(s.text, rewrite_reference(parents[s.prompt_index], todo[s.prompt_index][1])) for s in samples]
        verifiers = [parents[s.prompt_index]["verifier"] for s in samples]
        scores, _, _ = score_cached(ctx.store, ctx.params["verifier"], pairs, verifiers)
        for s, score in zip(samples, scores):
            index = todo[s.prompt_index][0]
            accuracy[index] = accuracy.get(index, 0.0) + (score.status == "ok") / cfg.rollouts
    results: list[tuple[float | None, str]] = []
    for i, reason in enumerate(reasons):
        if reason is not None:
            results.append((None, reason))
        else:
            results.append(
                (
                    accuracy.get(i, 0.0),
                    "kept" if keeps_rewrite(accuracy.get(i, 0.0)) else "accuracy not strictly between 0 and 1",
                )
            )
    return results


def rewrite_reference(parent: dict[str, Any], rewrite: Rewrite) -> str:
    """The reference of a rewrite: the parent's when the answer is kept, else the rewrite's answer."""
    return parent["reference"] if rewrite.answer == parent["answer"] else rewrite.answer


def _problem_row(parent: dict[str, Any], rewrite: Rewrite, mode: str, ctx: StageContext) -> dict[str, Any]:
    params = {"rewriter": "clpo", "mode": mode, "step": ctx.step, "policy": ctx.input_ids["policy"][0]}
    return {
        "problem_id": row_id("p", "clpo", parent["problem_id"], mode, rewrite.prompt),
        "run_id": ctx.run_id,
        "split": parent["split"],
        "domain": parent["domain"],
        "category": parent["category"],
        "prompt": rewrite.prompt,
        "reference": rewrite_reference(parent, rewrite),
        "answer": rewrite.answer,
        "verifier": parent["verifier"],
        "source": parent["source"],
        "generator": parent["generator"],
        "generator_version": parent["generator_version"],
        "params": json.dumps(params, sort_keys=True),
        "seed": ctx.seed,
        "source_index": -1,
        "parent_problem_id": parent["problem_id"],
        "derivation": mode,
        "difficulty_label": None,
    }


def _audit_row(
    slot: int,
    problem_id: str,
    accuracy: float,
    cfg: RestructureConfig,
    fate: tuple[str, Rewrite | None, float | None, bool, str] | None,
    ctx: StageContext,
) -> dict[str, Any]:
    label = label_of(accuracy, cfg)
    row = {
        "run_id": ctx.run_id,
        "step": ctx.step,
        "slot": slot,
        "problem_id": problem_id,
        "accuracy": accuracy,
        "label": label,
        "kl_weight": kl_weight(label, cfg),
        "mode": None,
        "rewrite_prompt": None,
        "rewrite_answer": None,
        "rewrite_accuracy": None,
        "kept": False,
        "reason": None,
    }
    if fate is not None:
        mode, rewrite, rewrite_accuracy, kept, reason = fate
        row.update(
            mode=mode,
            rewrite_prompt=rewrite.prompt if rewrite else None,
            rewrite_answer=rewrite.answer if rewrite else None,
            rewrite_accuracy=rewrite_accuracy,
            kept=kept,
            reason=reason,
        )
    return row


RESTRUCTURE: Stage[RestructureConfig] = Stage(
    name="restructure",
    code_version="2",
    section="restructure",
    config=RestructureConfig,
    inputs=("problems", "rollouts", "rewards", "policy"),
    outputs={"restructured": Output("restructured"), "problems": Output("problems")},
    build=build,
)
