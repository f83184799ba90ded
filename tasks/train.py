"""train: one GRPO policy update from the step's rollouts and rewards.

Commits `train_state` (weights + optimizer state: the exact point a resumed run continues from; only
the run's newest is kept; config and tokenizer stay those of the run's checkpoint) and then
`train_steps` (the step's metrics; the durable link of the policy chain that lineage walks through,
and the reference the next step's policy is named by).

With `state_every` k > 1 only every k-th step's train_state holds weights and optimizer state; the
others hold their row (manifest `weights: false`, and `needs`: the stored state they are rebuilt from).
A policy between two stored states is rebuilt by replaying the updates after the older one from their
committed inputs (trainer/checkpoints.py), which on the CPU gives the same bits.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from functools import partial
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlvr.storage.policy_chain import sampler_needs, weights_needed
from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.storage.store import Store
from rlvr.trainer.checkpoints import (
    OPTIMIZER_FILE,
    Ranks,
    TrainerState,
    is_weights_file,
    kl_reference,
    parameter_count,
    take_trainer_state,
)
from rlvr.trainer.devices import reset_peak_memory, stage_device, usage
from rlvr.trainer.grpo import GRPOConfig, RolloutBatch
from rlvr.trainer.policy import optimizer_state_bytes, policy_files
from rlvr.trainer.sharding import DecodeWeights, Sharding
from rlvr.trainer.updates import step_batch, update_policy

RUN_MINIBATCHES = 2  # a run's updates per step unless its config says otherwise (GRPOConfig alone: 1)


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(600, ge=0, description="RL steps")
    grpo: GRPOConfig = Field(default_factory=lambda: GRPOConfig(minibatches=RUN_MINIBATCHES))
    data_parallel: int = Field(
        1,
        ge=1,
        description=(
            "processes sharing each update (gloo on CPU, nccl on GPU): the run's process is rank 0 and the "
            "others live for the whole run (trainer/ranks/launch.py), or torchrun's ranks when it started the run"
        ),
    )
    sharding: Sharding = Field(
        "fsdp",
        exclude_if=lambda value: value == "fsdp",
        description=(
            "with data_parallel > 1: fsdp splits parameters, gradients and optimizer state over the ranks (FSDP2, "
            "each decoder layer a unit); replicate keeps a whole copy on every rank (FSDP2 over a ranks x 1 mesh)"
        ),
    )
    decode_weights: DecodeWeights = Field(
        "units",
        exclude_if=lambda value: value == "units",
        description=(
            "with data_parallel > 1 and fsdp: units decodes (evaluations, difficulty, rollouts) in lockstep, every "
            "token step gathering one unit at a time, so no rank holds the whole model; whole gathers the whole "
            "weights once a decoding call, then each rank decodes alone, as replicate does (its rollouts were 5x "
            "faster on gloo at 135M), when the whole model fits on each device (rlvr plan shows both)"
        ),
    )
    state_every: int = Field(
        1,
        ge=1,
        exclude_if=lambda value: value == 1,  # keys added later leave dumps, so ids, as they were at their default
        description=(
            "store the weights and optimizer state every this many steps (1: every step). Between, a resumed "
            "run replays the committed steps' updates from the last stored state (exact on the CPU). At 0.5B "
            "parameters a stored state is ~6 GB (float32 weights + Adam moments), more than a GPU step's compute"
        ),
    )

    @field_validator("grpo", mode="before")
    @classmethod
    def _run_minibatches(cls, value: Any) -> Any:
        """A `train.grpo` given in part keeps the run's minibatches default, not GRPOConfig's own."""
        if isinstance(value, dict) and "minibatches" not in value:
            return {**value, "minibatches": RUN_MINIBATCHES}
        return value


def step_row(
    ctx: StageContext, cfg: TrainConfig, batch: RolloutBatch, stats: dict[str, float], compute_seconds: float
) -> dict[str, Any]:
    """The step's `train_steps` row (in the schema's column order): the update's statistics, the batch's size,
    and where it ran."""
    return {
        "run_id": ctx.run_id,
        "step": ctx.step,
        "policy_id": ctx.output_ids["train_steps"],
        **{name: stats[name] for name in ("loss", "mean_reward", "reward_std", "effective_ratio")},
        "groups": len(batch.prompts),
        "rollouts": len(batch.samples),
        "reward_errors": batch.reward_errors,
        **{name: stats[name] for name in ("clip_fraction", "kl", "ref_kl", "entropy", "grad_norm")},
        "lr": cfg.grpo.lr,
        "updates": int(stats["updates"]),
        "compute_seconds": compute_seconds,
        **ctx.usage,
        **{name: stats.get(name) for name in ("mismatch_mean", "mismatch_max", "mismatch_kl", "corrected_share")},
    }


def build(inputs: Inputs, cfg: TrainConfig, ctx: StageContext) -> dict[str, Built]:
    """Inputs: the step's `rollouts` and `rewards` (every round), the `policy` to update (a TrainerState when
    given); with dynamic sampling the `groups` the filter kept (without it every group trains); with CLPO
    the `restructured` labels (their KL weights); with `grpo.kl_beta` > 0 the `reference` checkpoint.
    params: `device` (the run's policy.device: where the policy, its optimizer state and the reference live).
    The row records the device and the accelerator's peak memory during the update (None on the CPU; with
    data_parallel > 1 that of this process, rank 0)."""
    batch = step_batch(inputs, cfg.grpo)
    device = stage_device(ctx.params.get("device"))
    if cfg.grpo.kl_beta > 0 and not inputs.ids.get("reference"):
        raise ValueError("train.grpo.kl_beta > 0 needs a reference policy (the run's starting checkpoint)")

    def take(store: Store, policy_ref: str) -> TrainerState:
        lr, weight_decay = cfg.grpo.lr, cfg.grpo.weight_decay
        ranks = Ranks(cfg.data_parallel, cfg.sharding, cfg.decode_weights)
        return take_trainer_state(store, policy_ref, lr=lr, weight_decay=weight_decay, device=device, ranks=ranks)

    state: TrainerState = inputs.load("policy", take)
    assert state.optimizer is not None
    reference = None  # on data-parallel ranks the group reads it by slices and holds it
    if cfg.grpo.kl_beta > 0:
        reference = inputs.load("reference", partial(kl_reference, device=device, group=state.policy.ranks))
    reset_peak_memory(device)  # the step's peak: the update's, with the model, optimizer and reference in place
    started = time.perf_counter()
    stats = update_policy(state.policy, state.optimizer, batch, cfg.grpo, reference)
    compute_seconds = time.perf_counter() - started
    ctx.usage.update(usage(state.policy.model))
    n_params = parameter_count(state.policy)
    state_row = {"run_id": ctx.run_id, "step": ctx.step, "optimizer_steps": int(stats["updates"]), "n_params": n_params}
    row = step_row(ctx, cfg, batch, stats, compute_seconds)
    replay = {"data_parallel": cfg.data_parallel, "sharding": cfg.sharding} if cfg.data_parallel > 1 else {}
    return {
        "train_state": state_built(inputs, cfg, ctx, state, state_row),
        "train_steps": Built(
            rows_to_table("train_steps", [row]),
            extra={"n_params": n_params, **replay, "trained_rollouts": batch.rollout_ids or []},
            resident=state,
        ),
    }


def state_built(inputs: Inputs, cfg: TrainConfig, ctx: StageContext, state: TrainerState, row: dict[str, Any]) -> Built:
    """The `train_state` output: the weights and optimizer state on every `state_every`-th step, else only
    the row, naming the stored state a replay starts from (kept until a newer stored state replaces it).
    With param `samplers_behind` k (flow.async_level), it also names the states the policies entering the
    last k steps are rebuilt from, which a resumed sampler reads."""
    table = rows_to_table("train_state", [row])
    behind = int(ctx.params.get("samplers_behind", 0))  # flow.async_level: samplers read the last k policies
    needs = sampler_needs(inputs.store, inputs.require_id("policy"), behind) if behind and inputs.store else []
    if ctx.step is None or ctx.step % cfg.state_every == 0:
        assert state.optimizer is not None
        if state.policy.ranks is not None:  # every rank writes its shards (torch.distributed.checkpoint)
            assert inputs.store is not None, "the ranks write a sharded state into a store"
            target = ("train_state", ctx.output_ids["train_state"])
            placed = state.policy.ranks.save_state(str(inputs.store.root), *target)
            dtype = str(next(state.policy.model.parameters()).dtype).removeprefix("torch.")
            return Built(table, placed=placed, extra={"dtype": dtype, **({"needs": needs} if needs else {})})
        weights = {name: data for name, data in policy_files(state.policy).items() if is_weights_file(name)}
        files = {**weights, OPTIMIZER_FILE: optimizer_state_bytes(state.optimizer)}
        return Built(table, files=files, extra={"needs": needs} if needs else {})
    if inputs.store is not None:
        needs = list(dict.fromkeys([*weights_needed(inputs.store, inputs.require_id("policy")), *needs]))
    return Built(table, extra={"weights": False, "needs": needs})


def identity(cfg: TrainConfig, params: Mapping[str, Any]) -> dict[str, Any]:
    """The update depends on the GRPO settings, not on how many steps the run has; `state_every` changes what
    the train_state holds. Keys added later are left out of dumps at their default (`exclude_if`), so the
    ids of runs from before them stay what they were."""
    return {**cfg.grpo.model_dump(), **cfg.model_dump(include={"state_every"})}


TRAIN: Stage[TrainConfig] = Stage(
    name="train",
    code_version="4",  # 4: a pad-id token inside a prompt is attended to (trainer/fused_head.py)
    section="train",
    config=TrainConfig,
    inputs=("rollouts", "rewards", "policy", "groups", "restructured", "reference"),
    outputs={"train_state": Output("train_state", transient=True), "train_steps": Output("train_steps")},
    build=build,
    identity=identity,
)
