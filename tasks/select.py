"""select: the curriculum policy picks the step's problems and records the probability of each pick."""

from __future__ import annotations

from typing import Literal

from prefect import task
from prefect.cache_policies import NONE
from pydantic import BaseModel, ConfigDict, Field

from rlvr.curricula.uniform import select_uniform
from rlvr.storage.ids import derive_seed
from rlvr.storage.stage import Built, StageOutput, commit_stage, open_store, rows_to_table

CODE_VERSION = "1"


class SelectConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: Literal["uniform"] = "uniform"
    batch_size: int = Field(32, ge=1, description="prompts per RL step")
    splits: list[str] = Field(default_factory=lambda: ["train", "warmup"])


@task(name="select", cache_policy=NONE)
def select(
    store_root: str, run_id: str, seed: int, step: int, cfg: SelectConfig, problems_id: str, difficulty_id: str
) -> str:
    """Commit the step's `selections` (one row per batch slot)."""
    store = open_store(store_root)
    out = StageOutput("selections", "select", CODE_VERSION, run_id, (problems_id, difficulty_id),
                      cfg.model_dump(), step=step)

    def build() -> Built:
        table = store.read_table(problems_id, columns=["problem_id", "split"])
        pool = [r["problem_id"] for r in table.to_pylist() if r["split"] in cfg.splits]
        picks = select_uniform(pool, cfg.batch_size, derive_seed(seed, "select", step))
        rows = [{"run_id": run_id, "step": step, "slot": slot, "problem_id": pid, "probability": prob,
                 "policy": cfg.policy} for slot, (pid, prob) in enumerate(picks)]
        return Built(rows_to_table("selections", rows))

    return commit_stage(store, out, build)
