"""checkpoint: durable, Hugging Face-loadable copies of the policy (initial weights and every N steps)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE
from pydantic import BaseModel, ConfigDict, Field

from rlvr.storage.stage import Built, StageOutput, commit_stage, open_store, rows_to_table
from rlvr.trainer.checkpoints import TrainerState, keep_trainer_state, policy_files_of
from rlvr.trainer.policy import PolicyConfig, init_policy, policy_files

CODE_VERSION = "1"


class CheckpointConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every: int = Field(100, ge=1, description="RL steps between checkpoints (the last step always gets one)")


def _checkpoint_row(run_id: str, step: int, aid: str, stage: str, policy_id: str | None, n_params: int) -> dict:
    return {"run_id": run_id, "step": step, "artifact_id": aid, "stage": stage, "policy_id": policy_id,
            "n_params": n_params}


@task(name="initialize", cache_policy=NONE)
def initialize(store_root: str, run_id: str, seed: int, cfg: PolicyConfig, config_id: str) -> str:
    """Commit the initial policy (built from the seed, or loaded from `policy.model`) as step 0."""
    store = open_store(store_root)
    out = StageOutput("checkpoints", "initialize", CODE_VERSION, run_id, (config_id,),
                      {"policy": cfg.model_dump(), "seed": seed}, step=0)

    def build() -> Built:
        policy = init_policy(cfg, seed)
        n_params = sum(p.numel() for p in policy.model.parameters())
        row = _checkpoint_row(run_id, 0, out.artifact_id, "initialize", None, n_params)
        keep_trainer_state(out.artifact_id, TrainerState(policy, None))
        return Built(rows_to_table("checkpoints", [row]), files=policy_files(policy))

    return commit_stage(store, out, build)


@task(name="checkpoint", cache_policy=NONE)
def checkpoint(store_root: str, run_id: str, step: int, policy_ref: str) -> str:
    """Copy the weights named by `policy_ref` (a train_steps id) into a permanent checkpoint."""
    store = open_store(store_root)
    out = StageOutput("checkpoints", "checkpoint", CODE_VERSION, run_id, (policy_ref,), {}, step=step)

    def build() -> Built:
        files = policy_files_of(store, policy_ref)
        n_params = store.manifest(policy_ref).extra.get("n_params", 0)
        row = _checkpoint_row(run_id, step, out.artifact_id, "checkpoint", policy_ref, n_params)
        return Built(rows_to_table("checkpoints", [row]), files=files)

    return commit_stage(store, out, build)
