"""initialize: the run's starting policy as step 0: built from the seed, loaded from `policy.model`, or
taken from a checkpoint of an earlier run in the same store (`policy.checkpoint`, an input, so lineage
walks from the new run into the one it continues)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlvr.errors import UserError
from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext
from rlvr.storage.store import Store
from rlvr.trainer.checkpoints import (
    checked_weights_file,
    checkpoint_built,
    file_chunks,
    one_weights_file,
    parameter_count,
    policy_files_of,
    require_policy,
    streamed_files,
)
from rlvr.trainer.devices import WEIGHTS_DTYPES, stage_device, usage
from rlvr.trainer.directory_weights import weights_chunks
from rlvr.trainer.lora import SETTINGS_FILE, add_lora
from rlvr.trainer.policy import (
    WEIGHTS_FILE,
    Policy,
    PolicyConfig,
    init_policy,
    meta_policy,
    place,
    policy_files,
    policy_from_files,
    static_files,
    stored_dtype,
)


def build(inputs: Inputs, cfg: PolicyConfig, ctx: StageContext) -> Built:
    """The policy lands on `policy.device` in `policy.dtype` and stays there as the run's live policy."""
    device = stage_device(cfg.device)  # a GPU this machine lacks is a one-line error before any work
    placed: list[dict[str, Any]] = []
    if ctx.params.get("ranks", 1) > 1 and inputs.store is not None:
        sliced = _read_by_the_ranks(inputs, cfg, ctx)
        if sliced is not None:
            return sliced
    if cfg.checkpoint is not None:
        policy, files = _from_checkpoint(inputs, cfg, cfg.checkpoint, ctx)
    else:
        policy = init_policy(cfg, ctx.seed)
        streamed = streamed_files(inputs.store, policy, ctx.output_ids["checkpoints"]) if inputs.store else None
        files, placed = streamed if streamed is not None else (policy_files(policy), [])
    place(policy, device)
    ctx.usage.update(usage(policy.model))
    return checkpoint_built(ctx, files, parameter_count(policy), cfg.checkpoint, live=policy, placed=placed)


def _read_by_the_ranks(inputs: Inputs, cfg: PolicyConfig, ctx: StageContext) -> Built | None:
    """With data-parallel ranks, which read their slices of the checkpoint themselves: the checkpoint written from
    the model directory a tensor at a time (trainer/directory_weights.py), or `policy.checkpoint`'s files copied in
    chunks, the model never whole in this process and none kept live. None when the starting weights must be built
    (the tiny model, LoRA's adapters) or loaded (a checkpoint to cast or to give adapters)."""
    store = inputs.store
    assert store is not None
    if cfg.checkpoint is not None:
        return _copied_checkpoint(inputs, cfg, cfg.checkpoint, ctx)
    found = meta_policy(cfg)
    if found is None:
        return None
    policy, directory = found
    chunks = weights_chunks(policy.model, directory, WEIGHTS_DTYPES[cfg.dtype])
    if chunks is None:
        return None
    entry = store.place_file("checkpoints", ctx.output_ids["checkpoints"], WEIGHTS_FILE, chunks)
    return checkpoint_built(ctx, static_files(policy), parameter_count(policy), None, placed=[entry])


def _copied_checkpoint(inputs: Inputs, cfg: PolicyConfig, checkpoint: str, ctx: StageContext) -> Built | None:
    """`policy.checkpoint`'s model directory as this run's step-0 checkpoint, its weights file copied in chunks
    (checked against its manifest first); None when it must be loaded: adapters to add or keep, or another dtype."""
    store = inputs.store
    assert store is not None
    _require_checkpoint_input(inputs, checkpoint)
    require_policy(store, checkpoint, "policy.checkpoint")
    if cfg.lora is not None or not one_weights_file(store, checkpoint):
        return None
    static, dtype = checked_weights_file(store, checkpoint)
    if dtype != WEIGHTS_DTYPES[cfg.dtype]:
        return None
    chunks = file_chunks(store, checkpoint, WEIGHTS_FILE)
    entry = store.place_file("checkpoints", ctx.output_ids["checkpoints"], WEIGHTS_FILE, chunks)
    n_params = int(store.manifest(checkpoint).extra["n_params"])
    return checkpoint_built(ctx, static, n_params, checkpoint, placed=[entry])


def _require_checkpoint_input(inputs: Inputs, checkpoint: str) -> None:
    if inputs.id("checkpoint") != checkpoint:
        raise UserError(
            "policy.checkpoint is set, but this command does not start from checkpoints; use `rlvr run`, "
            f"or `rlvr difficulty RUN_ID --policy {checkpoint}` to estimate difficulty with it"
        )


def _from_checkpoint(
    inputs: Inputs, cfg: PolicyConfig, checkpoint: str, ctx: StageContext
) -> tuple[Policy, dict[str, bytes]]:
    """The checkpoint's policy and model directory, byte for byte, as this run's step-0 checkpoint. Its LoRA
    adapters, if it has any, come with it; a checkpoint without adapters gets fresh ones when `policy.lora`
    asks, and one stored in another dtype than `policy.dtype` is cast (both then write the directory anew)."""
    _require_checkpoint_input(inputs, checkpoint)
    files = inputs.load("checkpoint", _checkpoint_files)
    dtype = WEIGHTS_DTYPES[cfg.dtype]
    policy = policy_from_files(files, source=checkpoint, threads=cfg.threads, dtype=dtype)
    if cfg.lora is not None and SETTINGS_FILE not in files:
        add_lora(policy.model, cfg.lora, ctx.seed)
        files = policy_files(policy)
    elif stored_dtype(files) != dtype:
        files = policy_files(policy)
    return policy, files


def _checkpoint_files(store: Store, artifact_id: str) -> dict[str, bytes]:
    return policy_files_of(store, require_policy(store, artifact_id, "policy.checkpoint"))


def identity(cfg: PolicyConfig, params: Mapping[str, Any]) -> dict[str, Any]:
    """The seed decides the tiny model's initial weights, so it is part of the id. A starting checkpoint
    is an input (its id is hashed as a parent), so the config key is left out: ids of runs that do not
    set it stay what they were. So is the device (where the model runs, not what it is), and the dtype when
    it is float32, what every run computed in before it existed."""
    left_out = {"checkpoint", "device"} | ({"dtype"} if cfg.dtype == "float32" else set())
    return {"policy": cfg.model_dump(exclude=left_out), "seed": params["seed"]}


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
