"""rollout: sample the allocated number of responses per selected problem from the current policy."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE
from pydantic import BaseModel, ConfigDict, Field

from rlvr.storage.ids import derive_seed, row_id
from rlvr.storage.stage import Built, StageOutput, commit_stage, open_store, rows_to_table
from rlvr.trainer.checkpoints import load_policy
from rlvr.trainer.generation import sample

CODE_VERSION = "1"


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: str = Field("transformers", pattern="^transformers$")
    max_new_tokens: int = Field(3, ge=1)
    temperature: float = Field(
        2.5, gt=0, description="sampling temperature; hot sampling keeps groups mixed on the tiny default"
    )
    top_p: float = Field(1.0, gt=0, le=1)


@task(name="rollout", cache_policy=NONE)
def rollout(
    store_root: str, run_id: str, seed: int, step: int, cfg: RolloutConfig,
    problems_id: str, allocations_id: str, policy_ref: str,
) -> str:
    """Commit the step's `rollouts` (one row per sampled response)."""
    store = open_store(store_root)
    out = StageOutput("rollouts", "rollout", CODE_VERSION, run_id, (allocations_id, problems_id, policy_ref),
                      cfg.model_dump(), step=step)

    def build() -> Built:
        slots = store.read_table(allocations_id, columns=["slot", "problem_id", "n_rollouts"]).to_pylist()
        problems = store.read_table(problems_id, columns=["problem_id", "prompt"]).to_pylist()
        prompt_of = {p["problem_id"]: p["prompt"] for p in problems}
        prompts = [prompt_of[s["problem_id"]] for s in slots]
        samples = sample(load_policy(store, policy_ref), prompts, [s["n_rollouts"] for s in slots],
                         max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                         seed=derive_seed(seed, "rollout", step))
        rows = []
        for s in samples:
            slot = slots[s.prompt_index]
            rows.append({
                "rollout_id": row_id("r", run_id, step, slot["slot"], s.sample_index),
                "run_id": run_id, "step": step, "slot": slot["slot"], "problem_id": slot["problem_id"],
                "sample_index": s.sample_index, "prompt": prompts[s.prompt_index], "response": s.text,
                "completion_ids": s.completion_ids, "n_tokens": s.n_tokens,
                "finish_reason": s.finish_reason, "policy_id": policy_ref,
            })
        return Built(rows_to_table("rollouts", rows))

    return commit_stage(store, out, build)
