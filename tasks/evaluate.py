"""evaluate: greedy accuracy of a policy on a held-out split, verified like the training rewards."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.trainer.checkpoints import load_policy
from rlvr.trainer.devices import stage_device, usage
from rlvr.trainer.engines import EngineConfig, engine_for
from rlvr.trainer.generation import greedy
from rlvr.trainer.policy import Policy
from rlvr.verifiers.cache import VerifierConfig, score_cached, verifier_identity


class EvaluateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every: int = Field(50, ge=1, description="RL steps between evaluations (the last step always gets one)")
    split: str = "test"
    max_new_tokens: int = Field(3, ge=1)


def build(inputs: Inputs, cfg: EvaluateConfig, ctx: StageContext) -> Built:
    """params: `phase` (init, warmstart, rl), `verifier` (the label section: how answers are scored),
    `device` (the run's policy.device) and, when the run samples through another engine than transformers,
    `rollout` (that engine's config: the answers come from it, as the rollouts do)."""
    verifier: VerifierConfig = ctx.params["verifier"]
    columns = ["split", "prompt", "reference", "verifier"]
    problems = [p for p in inputs.rows("problems", columns) if p["split"] == cfg.split]
    if not problems:
        raise ValueError(f"evaluation split {cfg.split!r} has no problems")
    policy = inputs.load("policy", partial(load_policy, device=stage_device(ctx.params.get("device"))))
    answers = greedy_answers(policy, inputs.require_id("policy"), [p["prompt"] for p in problems], cfg, ctx)
    ctx.usage.update(usage(policy.model))
    pairs = [(a, p["reference"]) for a, p in zip(answers, problems)]
    scores, _, _ = score_cached(ctx.store, verifier, pairs, [p["verifier"] for p in problems])
    correct = sum(s.status == "ok" for s in scores)
    row = {
        "run_id": ctx.run_id,
        "step": ctx.step,
        "phase": ctx.params["phase"],
        "split": cfg.split,
        "policy_id": inputs.id("policy"),
        "accuracy": correct / len(problems),
        "correct": correct,
        "n": len(problems),
    }
    return Built(rows_to_table("evals", [row]))


def greedy_answers(
    policy: Policy, policy_ref: str, prompts: list[str], cfg: EvaluateConfig, ctx: StageContext
) -> list[str]:
    """The policy's greedy answers: through the run's engine when params name one, else transformers on the
    policy itself (what the `transformers` engine does too)."""
    engine_cfg: EngineConfig | None = ctx.params.get("rollout")
    if engine_cfg is None:
        return greedy(policy, prompts, max_new_tokens=cfg.max_new_tokens)
    engine = engine_for(engine_cfg)
    engine.update_weights(policy, policy_ref)
    return engine.greedy(prompts, cfg.max_new_tokens)


def identity(cfg: EvaluateConfig, params: Mapping[str, Any]) -> dict[str, Any]:
    """How often evaluations run does not change one, and only the verifiers matter, not their pool; the
    engine counts when it is not transformers (its greedy decoding may differ in the last bits)."""
    engine = {"engine": params["rollout"].type} if params.get("rollout") is not None else {}
    return {
        "split": cfg.split,
        "max_new_tokens": cfg.max_new_tokens,
        **verifier_identity(params["verifier"]),
        "phase": params["phase"],
        **engine,
    }


EVALUATE: Stage[EvaluateConfig] = Stage(
    name="evaluate",
    code_version="2",
    section="evaluate",
    config=EvaluateConfig,
    inputs=("policy", "problems"),
    outputs={"evals": Output("evals")},
    build=build,
    identity=identity,
)
