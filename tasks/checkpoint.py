"""checkpoint: durable, Hugging Face-loadable copies of the policy every `checkpoint.every` steps and at the end."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext
from rlvr.trainer.checkpoints import checkpoint_built, policy_files_of, streamed_checkpoint


class CheckpointConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every: int = Field(100, ge=1, description="RL steps between checkpoints (the last step always gets one)")


def build(inputs: Inputs, cfg: CheckpointConfig, ctx: StageContext) -> Built:
    """Copy the weights named by the `policy` input (a train_steps id) into a permanent checkpoint: streamed a tensor
    at a time from the live policy (by the data-parallel ranks from their shards when they hold it), else read from
    the store and written whole."""
    n_params, policy_id = inputs.manifest("policy").extra.get("n_params", 0), inputs.id("policy")
    if inputs.store is not None:
        streamed = streamed_checkpoint(inputs.store, inputs.require_id("policy"), ctx.output_ids["checkpoints"])
        if streamed is not None:
            files, placed = streamed
            return checkpoint_built(ctx, files, n_params, policy_id, placed=placed)
    return checkpoint_built(ctx, inputs.load("policy", policy_files_of), n_params, policy_id)


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
