"""evaluate: greedy accuracy of a policy on a held-out split, verified like the training rewards."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.trainer.checkpoints import load_policy
from rlvr.trainer.devices import stage_device, usage
from rlvr.trainer.generation import greedy
from rlvr.verifiers.cache import VerifierConfig, score_cached, verifier_identity


class EvaluateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every: int = Field(50, ge=1, description="RL steps between evaluations (the last step always gets one)")
    split: str = "test"
    max_new_tokens: int = Field(3, ge=1)


def build(inputs: Inputs, cfg: EvaluateConfig, ctx: StageContext) -> Built:
    """params: `phase` (init, warmstart, rl), `verifier` (the label section: how answers are scored) and
    `device` (the run's policy.device)."""
    verifier: VerifierConfig = ctx.params["verifier"]
    columns = ["split", "prompt", "reference", "verifier"]
    problems = [p for p in inputs.rows("problems", columns) if p["split"] == cfg.split]
    if not problems:
        raise ValueError(f"evaluation split {cfg.split!r} has no problems")
    policy = inputs.load("policy", partial(load_policy, device=stage_device(ctx.params.get("device"))))
    answers = greedy(policy, [p["prompt"] for p in problems], max_new_tokens=cfg.max_new_tokens)
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


def identity(cfg: EvaluateConfig, params: Mapping[str, Any]) -> dict[str, Any]:
    """How often evaluations run does not change one, and only the verifiers matter, not their pool."""
    return {
        "split": cfg.split,
        "max_new_tokens": cfg.max_new_tokens,
        **verifier_identity(params["verifier"]),
        "phase": params["phase"],
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
