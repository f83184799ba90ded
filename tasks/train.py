"""train: one GRPO policy update from the step's rollouts and rewards.

Commits `train_steps` (the step's metrics; the durable link of the policy chain) and `train_state`
(weights + optimizer, the exact point a resumed run continues from). Only the newest train_state
is kept: the previous one is deleted once the new step is committed.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import task
from prefect.cache_policies import NONE
from pydantic import BaseModel, ConfigDict, Field

from rlvr.storage.stage import StageOutput, open_store, rows_to_table
from rlvr.trainer.checkpoints import (
    OPTIMIZER_FILE,
    STATE_CODE_VERSION,
    keep_trainer_state,
    take_trainer_state,
    train_state_id,
)
from rlvr.trainer.generation import Sample
from rlvr.trainer.grpo import GRPOConfig, RolloutBatch, grpo_step
from rlvr.trainer.policy import optimizer_state_bytes, policy_files

CODE_VERSION = "1"


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(400, ge=0, description="RL steps")
    grpo: GRPOConfig = Field(default_factory=lambda: GRPOConfig(minibatches=2))


def rollout_batch(rollouts: list[dict[str, Any]], score_of: dict[str, float]) -> RolloutBatch:
    """Group the step's rollouts by batch slot (one GRPO group per slot)."""
    slots = sorted({r["slot"] for r in rollouts})
    index_of = {slot: i for i, slot in enumerate(slots)}
    prompts = [""] * len(slots)
    samples, rewards = [], []
    for r in sorted(rollouts, key=lambda r: (r["slot"], r["sample_index"])):
        i = index_of[r["slot"]]
        prompts[i] = r["prompt"]
        samples.append(Sample(prompt_index=i, sample_index=r["sample_index"], completion_ids=list(r["completion_ids"]),
                              text=r["response"], n_tokens=r["n_tokens"], finish_reason=r["finish_reason"]))
        rewards.append(score_of[r["rollout_id"]])
    return RolloutBatch(prompts=prompts, samples=samples, rewards=rewards)


@task(name="train", cache_policy=NONE)
def train(
    store_root: str, run_id: str, step: int, cfg: TrainConfig, rollouts_id: str, rewards_id: str, policy_ref: str
) -> dict[str, Any]:
    """Commit the step's `train_steps` and `train_state`; return the metrics row (policy_id = new reference)."""
    store = open_store(store_root)
    out = StageOutput("train_steps", "train", CODE_VERSION, run_id, (rollouts_id, rewards_id, policy_ref),
                      cfg.grpo.model_dump(), step=step)
    aid = out.artifact_id
    if not store.exists(aid):
        rollouts = store.read_table(rollouts_id).to_pylist()
        rewards = store.read_table(rewards_id, columns=["rollout_id", "score"]).to_pylist()
        batch = rollout_batch(rollouts, {r["rollout_id"]: r["score"] for r in rewards})
        state = take_trainer_state(store, policy_ref, lr=cfg.grpo.lr, weight_decay=cfg.grpo.weight_decay)
        started = time.perf_counter()
        stats = grpo_step(state.policy, state.optimizer, batch, cfg.grpo)
        compute_seconds = time.perf_counter() - started
        n_params = sum(p.numel() for p in state.policy.model.parameters())
        optimizer_steps = int(stats["updates"])
        files = {**policy_files(state.policy), OPTIMIZER_FILE: optimizer_state_bytes(state.optimizer)}
        state_row = {"run_id": run_id, "step": step, "optimizer_steps": optimizer_steps, "n_params": n_params}
        store.write_artifact("train_state", train_state_id(aid, run_id), rows_to_table("train_state", [state_row]),
                             run_id=run_id, stage="train", parents=[aid], code_version=STATE_CODE_VERSION, config={},
                             step=step, files=files)
        row = {"run_id": run_id, "step": step, "policy_id": aid, "loss": stats["loss"],
               "mean_reward": stats["mean_reward"], "reward_std": stats["reward_std"],
               "effective_ratio": stats["effective_ratio"], "groups": len(batch.prompts),
               "rollouts": len(batch.samples), "clip_fraction": stats["clip_fraction"], "kl": stats["kl"],
               "grad_norm": stats["grad_norm"], "lr": cfg.grpo.lr, "updates": optimizer_steps,
               "compute_seconds": compute_seconds}
        store.write_artifact("train_steps", aid, rows_to_table("train_steps", [row]), run_id=run_id,
                             stage="train", parents=list(out.parents), code_version=CODE_VERSION,
                             config=dict(out.config), step=step, extra={"n_params": n_params})
        keep_trainer_state(aid, state)
        if store.manifest(policy_ref).kind == "train_steps":
            store.delete_artifact(train_state_id(policy_ref, run_id))
    return store.read_table(aid).to_pylist()[0]


@task(name="prune_train_states", cache_policy=NONE)
def prune_train_states(store_root: str, run_id: str, policy_ref: str) -> list[str]:
    """Delete every train_state of the run but the one behind `policy_ref` (a crash can leave extras)."""
    store = open_store(store_root)
    keep = train_state_id(policy_ref, run_id)
    stale = [m.artifact_id for m in store.manifests(kind="train_state", run_id=run_id) if m.artifact_id != keep]
    for aid in stale:
        store.delete_artifact(aid)
    return stale
