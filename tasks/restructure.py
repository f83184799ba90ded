"""restructure: CLPO (off by default; `restructure.enabled`). The step's rollouts label each problem hard,
medium or easy; hard ones are simplified and medium ones diversified by the rewriter; every rewrite is
sampled by the current policy and verified against its reference, and kept only when it is solved
sometimes but not always and does not reveal its answer. Kept rewrites are new problems
(`parent_problem_id`, `derivation`) that join the pool from the next step on.

With `join: same_step` (the paper) the step's select drew `share` fewer prompts; up to that many rewrites
(hard ones first) are sampled `allocate.n` times each, and the samples of the kept ones are this stage's
`rollouts` and `rewards`, trained in this step with the rest: the step's rollouts stay within its budget.
With `next_step` each rewrite is sampled `restructure.rollouts` times only to judge it, and those outputs
are empty.

Writes `restructured` (one row per group: its accuracy, label, KL weight, and the fate of its rewrite)
and `problems` (the kept rewrites). The trainer reads the KL weights of the step's groups from it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
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
from rlvr.verifiers.cache import VerifierConfig, score_rollouts
from rlvr.verifiers.outcomes import solved
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
    """(slot, problem_id, share of its rollouts that solved it) for every group of the step, by slot; a rollout
    whose verdict failed (status error) counts neither way (verifiers/outcomes.py), and a group with no verdict
    at all is left out."""
    solved_of = {r["rollout_id"]: solved(r["verifier"], r["status"]) for r in inputs.rows("rewards")}
    groups: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in inputs.rows("rollouts", ["rollout_id", "slot", "problem_id"]):
        groups[r["slot"]].append(r)
    found = []
    for slot, rows in sorted(groups.items()):
        verdicts = [v for r in rows if (v := solved_of[r["rollout_id"]]) is not None]
        if verdicts:
            found.append((slot, rows[0]["problem_id"], sum(verdicts) / len(verdicts)))
    return found


def build(inputs: Inputs, cfg: RestructureConfig, ctx: StageContext) -> dict[str, Built]:
    """Inputs: the pool's problems, the step's rollouts and rewards (every round) and the policy.
    params: `verifier` (label section), `rollout` (the engine that samples rewrites), `sources` (the
    synthesize sources, for the procedural rewriter), `device` (the run's policy.device); with join
    same_step, `slots` (how many rewrites may be sampled), `first_slot` (their slots) and `n` (samples each)."""
    pool = {p["problem_id"]: p for p in inputs.rows("problems", PROBLEM_COLUMNS)}
    groups = group_accuracy(inputs)
    requests = _requests(groups, pool, cfg)
    policy = inputs.load("policy", partial(load_policy, device=stage_device(ctx.params.get("device"))))
    rewrites = _rewriter(cfg, pool, policy, ctx).rewrite(requests)
    reasons = _screen(rewrites, pool, ctx.params.get("slots"))
    judged = _judge(rewrites, requests, reasons, pool, policy, cfg, ctx)
    ctx.usage.update(usage(policy.model))
    new_problems, fate, trained_rollouts, trained_rewards = [], {}, [], []
    for i, (request, rewrite) in enumerate(zip(requests, rewrites)):
        accuracy, reason = judged.verdicts[i]
        kept = reason == "kept"
        fate[request.problem_id] = (request.mode, rewrite, accuracy, kept, reason)
        if kept and rewrite is not None:
            new_problems.append(_problem_row(pool[request.problem_id], rewrite, request.mode, ctx))
            if cfg.join == "same_step":  # its samples train in this step
                trained_rollouts += judged.rollouts[i]
                trained_rewards += judged.rewards[i]
    rows, reported = [], set()
    for slot, pid, accuracy in groups:  # a problem in several slots: its rewrite is reported with the first
        rows.append(_audit_row(slot, pid, accuracy, cfg, fate.get(pid) if pid not in reported else None, ctx))
        reported.add(pid)
    extra = {"kept": len(new_problems), "sampled": judged.sampled}
    return {
        "restructured": Built(rows_to_table("restructured", rows), extra=extra),
        "problems": Built(rows_to_table("problems", new_problems)),
        "rollouts": Built(rows_to_table("rollouts", trained_rollouts)),
        "rewards": Built(rows_to_table("rewards", trained_rewards)),
    }


def _requests(
    groups: list[tuple[int, str, float]], pool: dict[str, dict[str, Any]], cfg: RestructureConfig
) -> list[RewriteRequest]:
    """One request per distinct problem whose label calls for a rewrite (its first slot decides); with join
    same_step the hard ones (simplify) come first, since only the first `slots` rewrites are sampled."""
    requests, seen = [], set()
    for _, pid, accuracy in groups:
        mode = mode_for(label_of(accuracy, cfg), cfg)
        if mode is None or pid in seen:
            continue
        seen.add(pid)
        problem = pool[pid]
        requests.append(RewriteRequest(pid, problem["prompt"], problem["answer"], problem["domain"] or "", mode))
    if cfg.join == "same_step":
        requests.sort(key=lambda r: r.mode != "simplify")  # stable: slot order within each mode
    return requests


def _rewriter(cfg: RestructureConfig, pool: dict[str, dict[str, Any]], policy: Policy, ctx: StageContext) -> Rewriter:
    if cfg.rewriter == "procedural":
        return ProceduralRewriter(make_sources(ctx.params["sources"]), {pid: p["source"] for pid, p in pool.items()})
    scoring: VerifierConfig = ctx.params["verifier"]
    verifier_of_domain = {p["domain"] or "": scoring.verifier_of(p["verifier"]) for p in pool.values()}
    engine = engine_for(ctx.params["rollout"])  # the run's engine writes the rewrites, as it samples them
    engine.update_weights(policy, ctx.input_ids["policy"][0])
    return PolicyRewriter(
        policy,
        lambda domain: verifier_class(verifier_of_domain[domain]).rewrite_templates,
        cfg.max_new_tokens,
        complete=engine.greedy,
    )


def _screen(rewrites: list[Rewrite | None], pool: dict[str, dict[str, Any]], slots: int | None) -> list[str | None]:
    """Why each rewrite is not sampled (None: it is): none made, it reveals its answer, it is in the pool
    already, or (with `slots`) the step's rewrite slots are taken by earlier requests."""
    pool_prompts = {p["prompt"] for p in pool.values()}
    reasons: list[str | None] = []
    for rewrite in rewrites:
        if rewrite is None:
            reasons.append("no rewrite")
        elif reveals_answer(rewrite.prompt, rewrite.answer):
            reasons.append("reveals the answer")
        elif rewrite.prompt in pool_prompts:
            reasons.append("already in the pool")
        elif slots is not None and sum(r is None for r in reasons) >= slots:
            reasons.append("no rewrite slot left this step")
        else:
            reasons.append(None)
    return reasons


@dataclass
class Judged:
    """What sampling the rewrites gave: (accuracy, reason) per request, and per sampled request its rollout
    and reward rows (trained in this step when the rewrite is kept and join is same_step)."""

    verdicts: list[tuple[float | None, str]] = field(default_factory=list)
    rollouts: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    rewards: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    sampled: int = 0


def _judge(
    rewrites: list[Rewrite | None],
    requests: list[RewriteRequest],
    reasons: list[str | None],
    pool: dict[str, dict[str, Any]],
    policy: Policy,
    cfg: RestructureConfig,
    ctx: StageContext,
) -> Judged:
    """Sample each screened rewrite with the current policy, verify the samples against its reference, and
    keep it when its accuracy lies strictly between 0 and 1."""
    todo = [i for i, reason in enumerate(reasons) if reason is None]
    judged = Judged()
    if todo:
        chosen = [rewrite for i in todo if (rewrite := rewrites[i]) is not None]  # all: screened ones exist
        rows = _sampled_rows(todo, chosen, requests, pool, policy, cfg, ctx)
        references = {r["problem_id"]: (pool[r["parent"]]["verifier"], r["reference"]) for r in rows}
        questions = [r["prompt"] for r in rows]  # a judged problem's rewrite: the judge is asked the rewrite
        verdicts, _ = score_rollouts(ctx.store, ctx.params["verifier"], rows, references, questions=questions)
        for row, verdict in zip(rows, verdicts):
            index = row["request"]  # this and `parent`, `reference`: not columns, left out when written
            judged.rollouts.setdefault(index, []).append(row)
            judged.rewards.setdefault(index, []).append(
                {
                    "rollout_id": row["rollout_id"],
                    "run_id": ctx.run_id,
                    "step": ctx.step,
                    "problem_id": row["problem_id"],
                    **verdict,
                }
            )
        judged.sampled = len(rows)
    for i, reason in enumerate(reasons):
        if reason is not None:
            judged.verdicts.append((None, reason))
            continue
        correct = [v for r in judged.rewards[i] if (v := solved(r["verifier"], r["status"])) is not None]
        if not correct:
            judged.verdicts.append((None, "no verdict on the rewrite's samples (status error)"))
            continue
        accuracy = sum(correct) / len(correct)
        judged.verdicts.append(
            (accuracy, "kept" if keeps_rewrite(accuracy) else "accuracy not strictly between 0 and 1")
        )
    return judged


def _sampled_rows(
    todo: list[int],
    chosen: list[Rewrite],
    requests: list[RewriteRequest],
    pool: dict[str, dict[str, Any]],
    policy: Policy,
    cfg: RestructureConfig,
    ctx: StageContext,
) -> list[dict[str, Any]]:
    """`rollouts` rows of the rewrites' samples (slots from `first_slot` on), each with the request it answers,
    its parent problem and the rewrite's reference."""
    engine_cfg: EngineConfig = ctx.params["rollout"]
    engine = engine_for(engine_cfg)
    policy_ref = ctx.input_ids["policy"][0]
    engine.update_weights(policy, policy_ref)
    n = ctx.params.get("n", cfg.rollouts)
    samples = engine.generate(
        [r.prompt for r in chosen], [n] * len(chosen), engine_cfg.sampling(ctx.derive_seed("restructure", ctx.step))
    )
    first_slot = ctx.params.get("first_slot", 0)
    rows = []
    for s in samples:
        index, rewrite = todo[s.prompt_index], chosen[s.prompt_index]
        parent = pool[requests[index].problem_id]
        slot = first_slot + s.prompt_index
        rows.append(
            {
                "rollout_id": row_id("r", ctx.run_id, ctx.step, slot, s.sample_index),
                "run_id": ctx.run_id,
                "step": ctx.step,
                "slot": slot,
                "problem_id": rewrite_id(parent, requests[index].mode, rewrite),
                "sample_index": s.sample_index,
                "prompt": rewrite.prompt,
                "response": s.text,
                "completion_ids": s.completion_ids,
                "n_tokens": s.n_tokens,
                "finish_reason": s.finish_reason,
                "policy_id": policy_ref,
                "staleness": 0,
                "logprobs": None,
                "hint_ratio": 0.0,
                "request": index,
                "parent": parent["problem_id"],
                "reference": rewrite_reference(parent, rewrite),
            }
        )
    return rows


def rewrite_reference(parent: dict[str, Any], rewrite: Rewrite) -> str:
    """The reference of a rewrite: the parent's when the answer is kept, else the rewrite's answer."""
    return parent["reference"] if rewrite.answer == parent["answer"] else rewrite.answer


def rewrite_id(parent: dict[str, Any], mode: str, rewrite: Rewrite) -> str:
    return row_id("p", "clpo", parent["problem_id"], mode, rewrite.prompt)


def _problem_row(parent: dict[str, Any], rewrite: Rewrite, mode: str, ctx: StageContext) -> dict[str, Any]:
    params = {"rewriter": "clpo", "mode": mode, "step": ctx.step, "policy": ctx.input_ids["policy"][0]}
    return {
        "problem_id": rewrite_id(parent, mode, rewrite),
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
    code_version="3",  # 3: accuracies over solved verdicts (verifiers/outcomes.py), error rows out
    section="restructure",
    config=RestructureConfig,
    inputs=("problems", "rollouts", "rewards", "policy"),
    outputs={
        "restructured": Output("restructured"),
        "problems": Output("problems"),
        "rollouts": Output("rollouts"),
        "rewards": Output("rewards"),
    },
    build=build,
)
