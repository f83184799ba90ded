"""initialize: the run's starting policy as step 0: built from the seed, loaded from `policy.model`, or
taken from a checkpoint of an earlier run in the same store (`policy.checkpoint`, an input, so lineage
walks from the new run into the one it continues)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlvr.errors import UserError
from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext
from rlvr.storage.store import Store
from rlvr.trainer.checkpoints import checkpoint_built, parameter_count, policy_files_of, require_policy
from rlvr.trainer.lora import SETTINGS_FILE, add_lora
from rlvr.trainer.policy import PolicyConfig, init_policy, policy_files, policy_from_files


def build(inputs: Inputs, cfg: PolicyConfig, ctx: StageContext) -> Built:
    if cfg.checkpoint is not None:
        return _from_checkpoint(inputs, cfg, cfg.checkpoint, ctx)
    policy = init_policy(cfg, ctx.seed)
    return checkpoint_built(ctx, policy_files(policy), parameter_count(policy), None, live=policy)


def _from_checkpoint(inputs: Inputs, cfg: PolicyConfig, checkpoint: str, ctx: StageContext) -> Built:
    """The checkpoint's model directory, byte for byte, as this run's step-0 checkpoint. Its LoRA adapters,
    if it has any, come with it; a checkpoint without adapters gets fresh ones when `policy.lora` asks."""
    if inputs.id("checkpoint") != checkpoint:
        raise UserError(
            "policy.checkpoint is set, but this command does not start from checkpoints; use `rlvr run`, "
            f"or `rlvr difficulty RUN_ID --policy {checkpoint}` to estimate difficulty with it"
        )
    files = inputs.load("checkpoint", _checkpoint_files)
    policy = policy_from_files(files, source=checkpoint, threads=cfg.threads)
    if cfg.lora is not None and SETTINGS_FILE not in files:
        add_lora(policy.model, cfg.lora, ctx.seed)
        files = policy_files(policy)
    return checkpoint_built(ctx, files, parameter_count(policy), checkpoint, live=policy)


def _checkpoint_files(store: Store, artifact_id: str) -> dict[str, bytes]:
    return policy_files_of(store, require_policy(store, artifact_id, "policy.checkpoint"))


def identity(cfg: PolicyConfig, params: Mapping[str, Any]) -> dict[str, Any]:
    """The seed decides the tiny model's initial weights, so it is part of the id. A starting checkpoint
    is an input (its id is hashed as a parent), so the config key is left out: ids of runs that do not
    set it stay what they were."""
    return {"policy": cfg.model_dump(exclude={"checkpoint"}), "seed": params["seed"]}


INITIALIZE: Stage[PolicyConfig] = Stage(
    name="initialize",
    code_version="2",
    section="policy",
    config=PolicyConfig,
    inputs=("config", "checkpoint"),
    outputs={"checkpoints": Output("checkpoints")},
    build=build,
    identity=identity,
)
