"""initialize: the run's starting policy (built from the seed, or loaded from `policy.model`) as step 0."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.trainer.checkpoints import TrainerState
from rlvr.trainer.policy import PolicyConfig, init_policy, policy_files


def build(inputs: Inputs, cfg: PolicyConfig, ctx: StageContext) -> Built:
    policy = init_policy(cfg, ctx.seed)
    n_params = sum(p.numel() for p in policy.model.parameters())
    row = {
        "run_id": ctx.run_id,
        "step": 0,
        "artifact_id": ctx.output_ids["checkpoints"],
        "stage": "initialize",
        "policy_id": None,
        "n_params": n_params,
    }
    return Built(
        rows_to_table("checkpoints", [row]),
        files=policy_files(policy),
        extra={"n_params": n_params},
        resident=TrainerState(policy, None),
    )


def identity(cfg: PolicyConfig, params: Mapping[str, Any]) -> dict[str, Any]:
    """The seed decides the tiny model's initial weights, so it is part of the id."""
    return {"policy": cfg.model_dump(), "seed": params["seed"]}


INITIALIZE: Stage[PolicyConfig] = Stage(
    name="initialize",
    code_version="2",
    section="policy",
    config=PolicyConfig,
    inputs=("config",),
    outputs={"checkpoints": Output("checkpoints")},
    build=build,
    identity=identity,
)
