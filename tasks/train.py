"""train: one GRPO policy update from the step's rollouts and rewards.

Commits `train_state` (weights + optimizer state: the exact point a resumed run continues from; only
the run's newest is kept; config and tokenizer stay those of the run's checkpoint) and then
`train_steps` (the step's metrics; the durable link of the policy chain that lineage walks through,
and the reference the next step's policy is named by).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load as safetensors_load

from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.storage.store import Store
from rlvr.trainer.checkpoints import (
    OPTIMIZER_FILE,
    TrainerState,
    is_weights_file,
    parameter_count,
    reference_policy,
    take_trainer_state,
)
from rlvr.trainer.devices import reset_peak_memory, stage_device, usage
from rlvr.trainer.distributed import run_torchrun
from rlvr.trainer.generation import Sample
from rlvr.trainer.grpo import GRPOConfig, RolloutBatch, grpo_step
from rlvr.trainer.policy import load_optimizer_state, optimizer_state_bytes, policy_files


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(600, ge=0, description="RL steps")
    grpo: GRPOConfig = Field(default_factory=lambda: GRPOConfig(minibatches=2))
    data_parallel: int = Field(
        1, ge=1, description="processes sharing each update, launched with torchrun (gloo on CPU, nccl on GPU)"
    )


def rollout_batch(
    rollouts: list[dict[str, Any]],
    score_of: Mapping[str, float],
    components_of: Mapping[str, dict[str, float]] | None = None,
) -> RolloutBatch:
    """Group the step's rollouts by batch slot (one GRPO group per slot); with `components_of`, each sample's
    reward components too (GDPO normalises them separately)."""
    slots = sorted({r["slot"] for r in rollouts})
    index_of = {slot: i for i, slot in enumerate(slots)}
    prompts = [""] * len(slots)
    samples, rewards = [], []
    ordered = sorted(rollouts, key=lambda r: (r["slot"], r["sample_index"]))
    for r in ordered:
        i = index_of[r["slot"]]
        prompts[i] = r["prompt"]
        samples.append(
            Sample(
                prompt_index=i,
                sample_index=r["sample_index"],
                completion_ids=list(r["completion_ids"]),
                text=r["response"],
                n_tokens=r["n_tokens"],
                finish_reason=r["finish_reason"],
            )
        )
        rewards.append(score_of[r["rollout_id"]])
    components = None if components_of is None else [components_of[r["rollout_id"]] for r in ordered]
    return RolloutBatch(prompts=prompts, samples=samples, rewards=rewards, components=components)


def reward_components(inputs: Inputs) -> dict[str, dict[str, float]]:
    """rollout_id -> its reward components, parsed from the `rewards` artifact's JSON `components` column."""
    table = inputs.table("rewards", ["rollout_id", "components"]).to_pydict()
    return {rid: json.loads(text or "{}") for rid, text in zip(table["rollout_id"], table["components"])}


def rollout_max_new_tokens(inputs: Inputs) -> int:
    """The rollouts' sampling limit, from the rollout stage's config recorded in each rollouts manifest (the
    largest when refill rounds differ): token-sum's constant and the overlong penalty's L_max."""
    if inputs.store is None:
        raise ValueError("the rollouts' max_new_tokens is read from their manifests; these inputs have no store")
    limits: list[int] = []
    for aid in inputs.ids.get("rollouts", ()):
        limit = inputs.store.manifest(aid).config.get("max_new_tokens")
        if not isinstance(limit, int):
            raise ValueError(f"rollouts {aid} do not record max_new_tokens (the rollout stage's config)")
        limits.append(limit)
    if not limits:
        raise ValueError("input 'rollouts' is missing")
    return max(limits)


def update_policy(
    state: TrainerState, batch: RolloutBatch, cfg: TrainConfig, reference: Any, device: str | None = None
) -> dict[str, float]:
    """One GRPO step in this process, or across `cfg.data_parallel` torchrun processes (on the CPU when `device`,
    the run's policy.device, is "cpu"; else on the GPUs when there are some), whose updated weights and
    optimizer state are loaded back into the live trainer state."""
    assert state.optimizer is not None
    if cfg.data_parallel == 1:
        return grpo_step(state.policy, state.optimizer, batch, cfg.grpo, reference)
    files, optimizer_bytes, stats = run_torchrun(
        state.policy, state.optimizer, batch, cfg.grpo, reference, nproc=cfg.data_parallel, device=device
    )
    weights = safetensors_load(files["model.safetensors"])
    state.policy.model.load_state_dict(weights, strict=False)  # tied weights are stored once
    load_optimizer_state(state.optimizer, optimizer_bytes)
    return stats


def step_batch(inputs: Inputs, cfg: TrainConfig) -> RolloutBatch:
    """The step's rollouts with their rewards: only the groups the filter kept (with dynamic sampling), their
    reward components (GDPO), the rollouts' token limit (overlong shaping) and CLPO's KL weights."""
    score_of = dict(zip(*inputs.table("rewards", ["rollout_id", "score"]).to_pydict().values()))
    rollouts = inputs.rows("rollouts")
    if inputs.ids.get("groups"):
        kept = {r["slot"] for r in inputs.rows("groups", ["slot", "kept"]) if r["kept"]}
        rollouts = [r for r in rollouts if r["slot"] in kept]
    components_of = reward_components(inputs) if cfg.grpo.advantage_components is not None else None
    batch = rollout_batch(rollouts, score_of, components_of)
    if cfg.grpo.needs_max_length:
        batch.max_new_tokens = rollout_max_new_tokens(inputs)
    if inputs.ids.get("restructured"):
        weight_of = dict(zip(*inputs.table("restructured", ["slot", "kl_weight"]).to_pydict().values()))
        batch.kl_weights = [weight_of.get(slot, 1.0) for slot in sorted({r["slot"] for r in rollouts})]
    return batch


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
        **{name: stats[name] for name in ("clip_fraction", "kl", "ref_kl", "entropy", "grad_norm")},
        "lr": cfg.grpo.lr,
        "updates": int(stats["updates"]),
        "compute_seconds": compute_seconds,
        **ctx.usage,
    }


def build(inputs: Inputs, cfg: TrainConfig, ctx: StageContext) -> dict[str, Built]:
    """Inputs: the step's `rollouts` and `rewards` (every round), the `policy` to update (a TrainerState when
    given); with dynamic sampling the `groups` the filter kept (without it every group trains); with CLPO
    the `restructured` labels (their KL weights); with `grpo.kl_beta` > 0 the `reference` checkpoint.
    params: `device` (the run's policy.device: where the policy, its optimizer state and the reference live).
    The row records the device and the accelerator's peak memory during the update (None on the CPU; with
    data_parallel > 1 that of this process, not of the torchrun ranks)."""
    batch = step_batch(inputs, cfg)
    device = stage_device(ctx.params.get("device"))
    reference = None
    if cfg.grpo.kl_beta > 0:
        if not inputs.ids.get("reference"):
            raise ValueError("train.grpo.kl_beta > 0 needs a reference policy (the run's starting checkpoint)")
        reference = inputs.load("reference", partial(reference_policy, device=device))

    def take(store: Store, policy_ref: str) -> TrainerState:
        lr, weight_decay = cfg.grpo.lr, cfg.grpo.weight_decay
        return take_trainer_state(store, policy_ref, lr=lr, weight_decay=weight_decay, device=device)

    state: TrainerState = inputs.load("policy", take)
    assert state.optimizer is not None
    reset_peak_memory(device)  # the step's peak: the update's, with the model, optimizer and reference in place
    started = time.perf_counter()
    stats = update_policy(state, batch, cfg, reference, ctx.params.get("device"))
    compute_seconds = time.perf_counter() - started
    ctx.usage.update(usage(state.policy.model))
    n_params = parameter_count(state.policy)
    weights = {name: data for name, data in policy_files(state.policy).items() if is_weights_file(name)}
    files = {**weights, OPTIMIZER_FILE: optimizer_state_bytes(state.optimizer)}
    updates = int(stats["updates"])
    state_row = {"run_id": ctx.run_id, "step": ctx.step, "optimizer_steps": updates, "n_params": n_params}
    row = step_row(ctx, cfg, batch, stats, compute_seconds)
    return {
        "train_state": Built(rows_to_table("train_state", [state_row]), files=files),
        "train_steps": Built(rows_to_table("train_steps", [row]), extra={"n_params": n_params}, resident=state),
    }


def identity(cfg: TrainConfig, params: Mapping[str, Any]) -> dict[str, Any]:
    """The update depends on the GRPO settings, not on how many steps the run has."""
    return cfg.grpo.model_dump()


TRAIN: Stage[TrainConfig] = Stage(
    name="train",
    code_version="3",
    section="train",
    config=TrainConfig,
    inputs=("rollouts", "rewards", "policy", "groups", "restructured", "reference"),
    outputs={"train_state": Output("train_state", transient=True), "train_steps": Output("train_steps")},
    build=build,
    identity=identity,
)
