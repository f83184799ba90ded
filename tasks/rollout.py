"""rollout: sample the allocated number of responses per selected problem with the rollout engine
(`rollout.type`) from the current policy, or, with flow.async_level k > 0, from the policy k steps back,
beside the trainer: then each rollout keeps its staleness and the sampling policy's token log-probs.
With GHPO's hints (`select.hints`) a prompt carries the share of its solution its selection row gives.

Every rollout is an episode of the run's environment, played by the one rollout loop (trainer/episodes.py): the
one-turn default's are episodes of `OneTurn`, whose first turn is drawn as the engine samples a batch of prompts,
so they are the tokens `engine.generate` gives (tests/test_one_path.py), and whose rows keep the columns one-turn
rollouts always had (the environment's columns null)."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rlvr.curricula.hints import HintConfig, hinted_prompt, solutions_of
from rlvr.environments.registry import EnvConfig
from rlvr.storage.ids import row_id
from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.trainer.checkpoints import load_policy, sampler_policy
from rlvr.trainer.devices import stage_device, usage
from rlvr.trainer.engine_base import RolloutEngine, SamplingParams
from rlvr.trainer.engines import ENGINES, EngineConfig, TransformersEngine, engine_for
from rlvr.trainer.episodes import Trajectory, Turn, episode_budgets
from rlvr.trainer.episodes import play_episodes as play
from rlvr.trainer.generation import Sample
from rlvr.trainer.grpo import GRPOConfig, behaviour_logprobs
from rlvr.trainer.policy import Policy
from rlvr.trainer.prompts import check_readable


def build(inputs: Inputs, cfg: EngineConfig, ctx: StageContext) -> dict[str, Built]:
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
    if ctx.params.get("logprobs") == "sampling":  # recorded as drawn, at the trainer's temperature
        temperature = behaviour["temperature"] if behaviour is not None else ctx.params["logprob_temperature"]
        sampling = replace(sampling, logprob_temperature=temperature)
    env = ctx.params.get("env")  # None: the one-turn default, whose completions the label stage scores
    environment = EnvConfig() if env is None else EnvConfig.model_validate(env)
    tasks = slot_tasks(inputs, slots, prompts)
    trajectories = play_episodes(engine, policy, environment, tasks, slots, sampling, seed)
    if environment.multi_turn:
        check_readable(policy.tokenizer, [t.prompt_ids for t in trajectories], f"env.type={environment.type}")
    if behaviour is not None and any(t.logprobs is None for t in trajectories):  # an engine that gives none
        computed = episode_logprobs(policy, prompts, trajectories, GRPOConfig.model_validate(behaviour))
        trajectories = [replace(t, logprobs=lp) for t, lp in zip(trajectories, computed)]
    ctx.usage.update(usage(policy.model))
    rollouts: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    for t in trajectories:
        row = rollout_row(ctx, t, slots[t.prompt_index], prompts[t.prompt_index], ratios[t.prompt_index], policy_ref)
        rollouts.append({**row, **episode_columns(t, env, ctx.params.get("environment"))})
        common = {k: row[k] for k in ("rollout_id", "run_id", "step", "problem_id")}
        turns.extend({**common, **turn} for turn in turn_rows(t))
    return {"rollouts": Built(rows_to_table("rollouts", rollouts)), "turns": Built(rows_to_table("turns", turns))}


def rollout_row(
    ctx: StageContext, t: Trajectory, slot: dict[str, Any], prompt: str, hint_ratio: float, policy_ref: str
) -> dict[str, Any]:
    """The `rollouts` columns every trajectory has (an environment's episode adds `episode_columns`)."""
    return {
        "rollout_id": row_id("r", ctx.run_id, ctx.step, slot["slot"], t.sample_index),
        "run_id": ctx.run_id,
        "step": ctx.step,
        "slot": slot["slot"],
        "problem_id": slot["problem_id"],
        "sample_index": t.sample_index,
        "prompt": prompt,
        "response": t.response,
        "completion_ids": t.completion_ids,
        "n_tokens": len(t.completion_ids),
        "finish_reason": t.finish_reason,
        "policy_id": policy_ref,
        "staleness": int(ctx.params.get("staleness", 0)),
        "logprobs": t.logprobs,
        "hint_ratio": hint_ratio,
    }


def slot_tasks(inputs: Inputs, slots: list[dict[str, Any]], prompts: list[str]) -> list[dict[str, Any]]:
    """Each slot's problem row, as the environment's task (its prompt the one sampled from: hinted or not). Only the
    slots' rows are read into Python: a step samples a few of many problems."""
    problems = inputs.table("problems")
    ids = pa.array(sorted({s["problem_id"] for s in slots}), problems.schema.field("problem_id").type)
    wanted = problems.filter(pc.is_in(problems["problem_id"], value_set=ids))
    problem_of = {p["problem_id"]: p for p in wanted.to_pylist()}
    return [{**problem_of[s["problem_id"]], "prompt": prompt} for s, prompt in zip(slots, prompts)]


def play_episodes(
    engine: RolloutEngine,
    policy: Policy,
    env: EnvConfig,
    tasks: list[dict[str, Any]],
    slots: list[dict[str, Any]],
    sampling: SamplingParams,
    seed: int,
) -> list[Trajectory]:
    """The slots' episodes of environment `env`, every running one decoding in one batch a turn: on the policy
    itself for the transformers engine (over the data-parallel ranks, when the policy has them), else through the
    engine (`policy` then renders the messages). An environment's episodes are keyed by their slots; the one-turn
    default's first (only) turn is drawn as the engine samples a batch of prompts, so it is `engine.generate`'s
    draw: the transformers engine's `rollout.seeding` (row: keyed by the prompt's place in the call), one request a
    group for vllm and openai."""
    budgets = episode_budgets(env, sampling.max_new_tokens)
    settings: dict[str, Any] = dict(temperature=sampling.temperature, top_p=sampling.top_p, seed=seed)
    settings["logprob_temperature"] = sampling.logprob_temperature
    counts = [s["n_rollouts"] for s in slots]
    keys: list[int] | None = [s["slot"] for s in slots] if env.multi_turn else None
    if not isinstance(engine, TransformersEngine):  # vllm, openai: log-probs where the engine gives them
        return play(policy, env, tasks, counts, budgets=budgets, settings=settings, row_keys=keys, engine=engine)
    own = engine.settings()
    if keys is None and own.seeding == "row":
        keys = list(range(len(slots)))
    settings |= dict(cache=own.cache, precision=own.precision)
    return play(policy, env, tasks, counts, budgets=budgets, settings=settings, row_keys=keys)


def episode_logprobs(
    policy: Policy, prompts: list[str], trajectories: list[Trajectory], cfg: GRPOConfig
) -> list[list[float]]:
    """Each episode's token log-probs under `policy`, the one that sampled it, for an engine that gives none: π_old
    as the train stage computes it (`behaviour_logprobs`) over the episode's opening ids and every token after them,
    then 0.0 on the environment's tokens, as the transformers loop records them."""
    played = [t for t in trajectories if t.completion_ids]  # an environment that failed to reset: no tokens
    samples = [
        Sample(t.prompt_index, t.sample_index, t.completion_ids, t.response, len(t.completion_ids), t.finish_reason)
        for t in played
    ]
    computed = behaviour_logprobs(policy, prompts, samples, cfg, [t.prompt_ids for t in played])
    found = {
        (t.prompt_index, t.sample_index): [lp if m else 0.0 for lp, m in zip(row, t.loss_mask)]
        for t, row in zip(played, computed)
    }
    return [found.get((t.prompt_index, t.sample_index), []) for t in trajectories]


def episode_columns(t: Trajectory, env: dict[str, Any] | None, label: str | None) -> dict[str, Any]:
    """The rollouts columns of an environment's episode (none for the one-turn case). `env_verdict` is the verdict
    the rollout loop gave the episode (trainer/episodes.py `_Episode.verdict`): null only where the label stage is
    to score the last answer with the problem's verifier."""
    if env is None:
        return {}
    verdict = None
    if t.verdict is not None:
        v = t.verdict
        verdict = json.dumps(
            {"status": v.status, "extracted": v.extracted, "reason": v.reason, "components": v.components}
        )
    assistant = [turn for turn in t.turns if turn.role == "assistant"]
    return {
        "prompt_ids": t.prompt_ids,
        "loss_mask": t.loss_mask,
        "n_turns": len(assistant),
        "stop_reason": t.stop_reason,
        "env": label,
        "env_reward": t.reward,
        "env_verdict": verdict,
        "turn_starts": [turn.start for turn in assistant],
        "turn_rewards": assistant_turn_rewards(t.turns),
    }


def assistant_turn_rewards(turns: list[Turn]) -> list[float | None]:
    """Each assistant turn's reward: the reply to it carries it, on the environment's turn that follows, or on the
    assistant turn itself when the reply ended the episode (trainer/episodes.py `_take_reply`)."""
    rewards: list[float | None] = []
    for k, turn in enumerate(turns):
        if turn.role != "assistant":
            continue
        reply = turns[k + 1] if k + 1 < len(turns) and turns[k + 1].role != "assistant" else None
        given = [r for r in (turn.reward, None if reply is None else reply.reward) if r is not None]
        rewards.append(sum(given) if given else None)
    return rewards


def turn_rows(t: Trajectory) -> list[dict[str, Any]]:
    """The trajectory's rows of the `turns` table; the last carries its stop reason."""
    rows = []
    for turn in t.turns:
        uses = turn.tool_uses
        rows.append(
            {
                "turn": turn.turn,
                "role": turn.role,
                "token_start": turn.start,
                "token_end": turn.end,
                "text": turn.text,
                "tool_names": [u.name for u in uses] if uses else None,
                "tool_arguments": [u.arguments for u in uses] if uses else None,
                "tool_outputs": [u.output for u in uses] if uses else None,
                "tool_statuses": [u.status for u in uses] if uses else None,
                "reward": turn.reward,
                "seconds": turn.seconds,
                "stop_reason": None,
            }
        )
    rows[-1]["stop_reason"] = t.stop_reason
    return rows


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
    code_version="7",  # 7: tools an environment offers untaught, on a template that renders none, are taught with
    # environments/tools.py's tool_prompt (the calculator's text); 6: one-turn rollouts are OneTurn episodes of the
    # rollout loop (same tokens and rollouts rows; their turns rows carry the loop's stop reason, token_budget for a
    # cut one, and measured seconds); 5: every episode's env_verdict is the loop's (solved_at, faults, env_timeout);
    # 4: GHPO hints stop before the step that states the answer; 3: pad-id tokens in prompts
    section="rollout",
    config=ENGINES.config_type,
    default=ENGINES.default_config,
    inputs=("allocations", "problems", "policy", "selections"),
    outputs={"rollouts": Output("rollouts"), "turns": Output("turns")},
    build=build,
)
