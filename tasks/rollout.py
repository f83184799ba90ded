"""rollout: sample the allocated number of responses per selected problem with the rollout engine
(`rollout.type`) from the current policy, or, with flow.async_level k > 0, from the policy k steps back,
beside the trainer: then each rollout keeps its staleness and the sampling policy's token log-probs.
With GHPO's hints (`select.hints`) a prompt carries the share of its solution its selection row gives."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from rlvr.curricula.hints import HintConfig, hinted_prompt, solutions_of
from rlvr.storage.ids import row_id
from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.trainer.checkpoints import load_policy, sampler_policy
from rlvr.trainer.devices import stage_device, usage
from rlvr.trainer.engines import ENGINES, EngineConfig, engine_for
from rlvr.trainer.grpo import GRPOConfig, behaviour_logprobs


def build(inputs: Inputs, cfg: EngineConfig, ctx: StageContext) -> Built:
    """params: `device` (the run's policy.device: where the policy is loaded; an engine with its own copy of the
    weights, vLLM or a server, samples where it runs); with flow.async_level, `staleness` (the step that trains
    on these rollouts minus the step whose policy samples them) and `behaviour` (the train stage's GRPO settings:
    the sampling policy's log-probs are computed as its π_old pass would, or, with `logprobs` "sampling", recorded
    at its temperature while sampling when the engine gives them); with GHPO, `hints` (select.hints)
    and the `selections` input, whose hint_ratio each slot's prompt shows."""
    slots = inputs.rows("allocations", ["slot", "problem_id", "n_rollouts"])
    ratios, prompts = slot_prompts(inputs, slots, ctx.params.get("hints"))
    policy_ref = inputs.require_id("policy")
    engine = engine_for(cfg)
    behaviour = ctx.params.get("behaviour")
    loader = load_policy if behaviour is None else sampler_policy  # beside the trainer: never the live policy
    policy = inputs.load("policy", partial(loader, device=stage_device(ctx.params.get("device"))))
    engine.update_weights(policy, policy_ref)
    first_slot = min((s["slot"] for s in slots), default=0)  # > 0 for a refill round of dynamic sampling
    seed = ctx.derive_seed("rollout", ctx.step, first_slot) if first_slot else ctx.derive_seed("rollout", ctx.step)
    sampling = cfg.sampling(seed)
    if behaviour is not None and ctx.params.get("logprobs") == "sampling":
        sampling = replace(sampling, logprob_temperature=behaviour["temperature"])
    samples = engine.generate(prompts, [s["n_rollouts"] for s in slots], sampling)
    logprobs = [s.logprobs for s in samples]
    if behaviour is not None and any(lp is None for lp in logprobs):  # an engine that does not give them
        logprobs = list(behaviour_logprobs(policy, prompts, samples, GRPOConfig.model_validate(behaviour)))
    ctx.usage.update(usage(policy.model))
    rows = []
    for s, sample_logprobs in zip(samples, logprobs):
        slot = slots[s.prompt_index]
        rows.append(
            {
                "rollout_id": row_id("r", ctx.run_id, ctx.step, slot["slot"], s.sample_index),
                "run_id": ctx.run_id,
                "step": ctx.step,
                "slot": slot["slot"],
                "problem_id": slot["problem_id"],
                "sample_index": s.sample_index,
                "prompt": prompts[s.prompt_index],
                "response": s.text,
                "completion_ids": s.completion_ids,
                "n_tokens": s.n_tokens,
                "finish_reason": s.finish_reason,
                "policy_id": policy_ref,
                "staleness": int(ctx.params.get("staleness", 0)),
                "logprobs": sample_logprobs,
                "hint_ratio": ratios[s.prompt_index],
            }
        )
    return Built(rows_to_table("rollouts", rows))


def slot_prompts(
    inputs: Inputs, slots: list[dict[str, Any]], hints: dict[str, Any] | None
) -> tuple[list[float], list[str]]:
    """Each slot's hint ratio and the prompt it samples from (the problem's own without hints)."""
    if hints is None:
        prompt_of = dict(zip(*inputs.table("problems", ["problem_id", "prompt"]).to_pydict().values()))
        return [0.0] * len(slots), [prompt_of[s["problem_id"]] for s in slots]
    cfg = HintConfig.model_validate(hints)
    problems = inputs.table("problems")
    prompt_of = dict(zip(*problems.select(["problem_id", "prompt"]).to_pydict().values()))
    solution_of = solutions_of(problems)
    ratio_of = {row["slot"]: row["hint_ratio"] for row in inputs.rows("selections", ["slot", "hint_ratio"])}
    ratios = [ratio_of[s["slot"]] for s in slots]
    pids = [s["problem_id"] for s in slots]
    return ratios, [hinted_prompt(prompt_of[p], solution_of.get(p), r, cfg) for p, r in zip(pids, ratios)]


ROLLOUT: Stage[EngineConfig] = Stage(
    name="rollout",
    code_version="4",  # 4: GHPO hints stop before the step that states the answer; 3: pad-id tokens in prompts
    section="rollout",
    config=ENGINES.config_type,
    default=ENGINES.default_config,
    inputs=("allocations", "problems", "policy", "selections"),
    outputs={"rollouts": Output("rollouts")},
    build=build,
)
