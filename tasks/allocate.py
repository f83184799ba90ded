"""allocate: how many rollouts each selected problem gets (uniform for now; ragged groups allowed)."""

from __future__ import annotations

from typing import Literal

from prefect import task
from prefect.cache_policies import NONE
from pydantic import BaseModel, ConfigDict, Field

from rlvr.curricula.budgets import allocate_uniform
from rlvr.storage.stage import Built, StageOutput, commit_stage, open_store, rows_to_table

CODE_VERSION = "1"


class AllocateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: Literal["uniform"] = "uniform"
    n: int = Field(16, ge=1, description="rollouts per prompt (the per-prompt budget)")


@task(name="allocate", cache_policy=NONE)
def allocate(
    store_root: str, run_id: str, step: int, cfg: AllocateConfig, selections_id: str, difficulty_id: str
) -> str:
    """Commit the step's `allocations` (one row per batch slot, with the p_hat it was decided on)."""
    store = open_store(store_root)
    out = StageOutput("allocations", "allocate", CODE_VERSION, run_id, (selections_id, difficulty_id),
                      cfg.model_dump(), step=step)

    def build() -> Built:
        slots = store.read_table(selections_id, columns=["slot", "problem_id"]).to_pylist()
        stats = store.read_table(difficulty_id, columns=["problem_id", "pass_rate"]).to_pylist()
        p_hat = {r["problem_id"]: r["pass_rate"] for r in stats}
        counts = allocate_uniform(len(slots), cfg.n)
        rows = [{"run_id": run_id, "step": step, "slot": s["slot"], "problem_id": s["problem_id"],
                 "n_rollouts": n, "p_hat": p_hat.get(s["problem_id"]), "policy": cfg.policy}
                for s, n in zip(slots, counts)]
        return Built(rows_to_table("allocations", rows))

    return commit_stage(store, out, build)
