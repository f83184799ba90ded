"""RLPR's two stages (`label.reward=rlpr`, docs/rewards.md#rlpr): `rlpr`, the rewards, and `rlpr_debias`, the
debiasing terms of the whole pool.

rlpr: RLPR's rewards in place of label. Each rollout's reward is
(1 - w) * clip(r - r_noreason, 0, 1) + w * format, where r is the sampling policy's mean per-token probability of
the problem's reference written in place of the response's answer, r_noreason the same with no reasoning, and
format 1 when the response states an answer where `answer_span` finds one; a response that states none gets 0
(status unparseable), as RLPR's code gives it, and so does one cut off by max_new_tokens unless
`label.rlpr.score_cut_off` (`stated_answer`).

The r_noreason terms are the `rlpr_debias` rows: those of the `debias` inputs computed with the `debias_policy`
are reused, the missing ones computed here with it and committed as this stage's own `rlpr_debias` (so each is
computed once per problem and policy: the flow hands a step's later rounds the earlier rounds' terms, and with
debias_with=start the terms of the whole pool, the `rlpr_debias` stage below). Rewards rows carry their provenance
(the policy, r, r_noreason, the reference's tokens). Everything is a function of the inputs: a resumed run makes the
same rows.

rlpr_debias: the debiasing terms of the whole pool with the policy RL started from (`label.rlpr.debias_with=start`,
the default), as RLPR's code computes them once before training (`compute_promptgt2scoreA`): r_noreason, the
policy's mean per-token probability of each problem's reference right after its prompt. One run per pool and
policy; every step's `rlpr` stage reads it, so each term is computed once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any

from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.trainer.checkpoints import load_policy, sampler_policy
from rlvr.trainer.devices import stage_device, usage
from rlvr.trainer.policy import Policy
from rlvr.trainer.rlpr import ReferenceProbability, debias_rows, reference_probabilities, rlpr_identity
from rlvr.verifiers.cache import VerifierConfig
from rlvr.verifiers.rlpr import (
    RLPR_VERSION,
    AnswerSpan,
    RLPRConfig,
    rlpr_reward,
    stated_answer,
    unread_cut_off,
    with_reference,
)


def build(inputs: Inputs, cfg: VerifierConfig, ctx: StageContext) -> dict[str, Built]:
    """Inputs: the round's `rollouts`, the `problems`, the sampling `policy`, the `debias_policy` and the `debias`
    terms known so far. params: `device`; `beside_trainer` under flow.async_level (read the sampler's copies)."""
    settings = cfg.rlpr
    loader = sampler_policy if ctx.params.get("beside_trainer") else load_policy
    load = partial(loader, device=stage_device(ctx.params.get("device")))
    rollouts = inputs.rows("rollouts", ["rollout_id", "problem_id", "prompt", "response", "finish_reason"])
    problems = {p["problem_id"]: p for p in inputs.rows("problems", ["problem_id", "prompt", "reference"])}
    debias_policy = inputs.require_id("debias_policy")
    known = known_terms(inputs, debias_policy)
    missing = sorted({r["problem_id"] for r in rollouts} - set(known))
    new_terms: list[dict[str, Any]] = []
    if missing:  # before the sampling policy is loaded: a sampler's loader may reuse one model for both
        model = inputs.load("debias_policy", load)
        new_terms = debias_rows(model, debias_policy, [problems[p] for p in missing], settings, ctx.run_id, ctx.step)
        ctx.usage.update(usage(model.model))
    debias_of = {**known, **{t["problem_id"]: t["probability"] for t in new_terms}}
    spans = [stated_answer(str(r["response"]), str(r["finish_reason"]), settings) for r in rollouts]
    probability = reference_terms(inputs, rollouts, problems, spans, load, settings, ctx)
    policy_id = inputs.require_id("policy")
    rows = [
        reward_row(
            ctx, r, spans[i], probability.get(i), debias_of[r["problem_id"]], (policy_id, debias_policy), settings
        )
        for i, r in enumerate(rollouts)
    ]
    return {
        "rlpr_debias": Built(rows_to_table("rlpr_debias", new_terms)),
        "rewards": Built(rows_to_table("rewards", rows)),
    }


def reference_terms(
    inputs: Inputs,
    rollouts: list[dict[str, Any]],
    problems: dict[str, dict[str, Any]],
    spans: list[AnswerSpan | None],
    load: Callable[..., Policy],
    settings: RLPRConfig,
    ctx: StageContext,
) -> dict[int, ReferenceProbability]:
    """rollout index -> the sampling policy's probability of the reference written in place of its answer span, for
    the rollouts that state an answer (the policy is loaded only when one does)."""
    stated = [(i, span) for i, span in enumerate(spans) if span is not None]
    if not stated:
        return {}
    policy = inputs.load("policy", load)
    texts = [
        with_reference(
            str(rollouts[i]["prompt"]),
            str(rollouts[i]["response"]),
            span,
            str(problems[rollouts[i]["problem_id"]]["reference"]),
            stopped=str(rollouts[i]["finish_reason"]) != "length",
        )
        for i, span in stated
    ]
    found = reference_probabilities(
        policy, texts, settings.temperature, settings.micro_batch_tokens, settings.end_cap()
    )
    ctx.usage.update(usage(policy.model))
    return {i: term for (i, _), term in zip(stated, found, strict=True)}


def reward_row(
    ctx: StageContext,
    rollout: dict[str, Any],
    span: AnswerSpan | None,
    term: ReferenceProbability | None,
    debias: float,
    policies: tuple[str, str],
    settings: RLPRConfig,
) -> dict[str, Any]:
    """One `rewards` row: RLPR's reward from the rollout's reference probability (`term`, None without an answer
    span) and its problem's debias term, with the policies and probabilities as provenance."""
    raw = term.mean if term is not None else 0.0
    components = {"probability": raw, "debias": debias, "format": float(span is not None)}
    provenance: dict[str, Any] = {"policy": policies[0], "debias_policy": policies[1], "raw": raw, "debias": debias}
    if term is not None:
        provenance |= {"tokens": term.tokens, "lowest": term.lowest}
        if term.end is not None:
            provenance["end"] = term.end
    return {
        "rollout_id": rollout["rollout_id"],
        "run_id": ctx.run_id,
        "step": ctx.step,
        "problem_id": rollout["problem_id"],
        "verifier": "rlpr",
        "verifier_version": RLPR_VERSION,
        "score": rlpr_reward(raw, debias, span is not None, settings),
        "status": "ok" if span is not None else "unparseable",
        "extracted": str(rollout["response"])[span.start : span.end] if span is not None else None,
        "reason": None if span is not None else no_answer_reason(rollout, settings),
        "components": json.dumps(components, sort_keys=True),
        "cache_hit": False,
        "latency_s": None,  # the forward passes' time is the stage run's (the `stage_runs` view)
        "provenance": json.dumps(provenance, sort_keys=True),
    }


def no_answer_reason(rollout: dict[str, Any], settings: RLPRConfig) -> str:
    """Why a rollout got no answer span: cut off by the token limit, or no answer where `answer_span` looks."""
    if unread_cut_off(str(rollout["finish_reason"]), settings):
        return "the response was cut off by max_new_tokens before it ended (label.rlpr.score_cut_off is false)"
    return "the response states no answer (answer_span found none)"


def known_terms(inputs: Inputs, policy_id: str) -> dict[str, float]:
    """problem_id -> r_noreason under `policy_id`, from the `debias` inputs (none when there are none)."""
    if not inputs.ids.get("debias"):
        return {}
    columns = ["problem_id", "policy_id", "probability"]
    return {t["problem_id"]: t["probability"] for t in inputs.rows("debias", columns) if t["policy_id"] == policy_id}


RLPR: Stage[VerifierConfig] = Stage(
    name="rlpr",
    code_version="1",
    section="label",
    config=VerifierConfig,
    inputs=("rollouts", "problems", "policy", "debias_policy", "debias"),
    outputs={"rlpr_debias": Output("rlpr_debias"), "rewards": Output("rewards")},
    build=build,
    identity=rlpr_identity,
)


def build_debias(inputs: Inputs, cfg: VerifierConfig, ctx: StageContext) -> Built:
    """The `rlpr_debias` stage. params: `splits` (the splits selection draws from, select.splits), `device`, and
    `beside_trainer` under flow.async_level."""
    splits = set(ctx.params["splits"])
    pool = sorted(
        (p for p in inputs.rows("problems", ["problem_id", "split", "prompt", "reference"]) if p["split"] in splits),
        key=lambda p: p["problem_id"],
    )
    loader = sampler_policy if ctx.params.get("beside_trainer") else load_policy
    policy = inputs.load("policy", partial(loader, device=stage_device(ctx.params.get("device"))))
    rows: list[dict[str, Any]] = debias_rows(policy, inputs.require_id("policy"), pool, cfg.rlpr, ctx.run_id, None)
    ctx.usage.update(usage(policy.model))
    return Built(rows_to_table("rlpr_debias", rows))


RLPR_DEBIAS: Stage[VerifierConfig] = Stage(
    name="rlpr_debias",
    code_version="1",
    section="label",
    config=VerifierConfig,
    inputs=("problems", "policy"),
    outputs={"rlpr_debias": Output("rlpr_debias")},
    build=build_debias,
    identity=rlpr_identity,
)
