"""initialize: the run's starting policy (built from the seed, or loaded from `policy.model`) as step 0."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext
from rlvr.trainer.checkpoints import checkpoint_built, parameter_count
from rlvr.trainer.policy import PolicyConfig, init_policy, policy_files


def build(inputs: Inputs, cfg: PolicyConfig, ctx: StageContext) -> Built:
    policy = init_policy(cfg, ctx.seed)
    return checkpoint_built(ctx, policy_files(policy), parameter_count(policy), None, live=policy)


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
