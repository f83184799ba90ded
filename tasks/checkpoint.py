"""checkpoint: durable, Hugging Face-loadable copies of the policy every `checkpoint.every` steps and at the end."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext
from rlvr.trainer.checkpoints import checkpoint_built, policy_files_of


class CheckpointConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every: int = Field(100, ge=1, description="RL steps between checkpoints (the last step always gets one)")


def build(inputs: Inputs, cfg: CheckpointConfig, ctx: StageContext) -> Built:
    """Copy the weights named by the `policy` input (a train_steps id) into a permanent checkpoint."""
    files = inputs.load("policy", policy_files_of)
    return checkpoint_built(ctx, files, inputs.manifest("policy").extra.get("n_params", 0), inputs.id("policy"))


def identity(cfg: CheckpointConfig, params: Mapping[str, Any]) -> dict[str, Any]:
    """How often checkpoints are taken does not change what one holds."""
    return {}


CHECKPOINT: Stage[CheckpointConfig] = Stage(
    name="checkpoint",
    code_version="2",
    section="checkpoint",
    config=CheckpointConfig,
    inputs=("policy",),
    outputs={"checkpoints": Output("checkpoints")},
    build=build,
    identity=identity,
)
