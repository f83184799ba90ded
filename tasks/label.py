"""label: score every rollout with the domain's verifier; statuses, not silent zeros."""

from __future__ import annotations

import json

from prefect import task
from prefect.cache_policies import NONE
from pydantic import BaseModel, ConfigDict

from storage.stage import Built, StageOutput, commit_stage, open_store, rows_to_table
from verifiers.registry import get_verifier

CODE_VERSION = "1"


class LabelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    verifier: str = "arithmetic"


@task(name="label", cache_policy=NONE)
def label(store_root: str, run_id: str, step: int, cfg: LabelConfig, problems_id: str, rollouts_id: str) -> str:
    """Commit the step's `rewards` (one row per rollout, same order)."""
    store = open_store(store_root)
    verifier = get_verifier(cfg.verifier)
    out = StageOutput("rewards", "label", CODE_VERSION, run_id, (rollouts_id, problems_id),
                      {**cfg.model_dump(), "verifier_version": verifier.version}, step=step)

    def build() -> Built:
        rollouts = store.read_table(rollouts_id, columns=["rollout_id", "problem_id", "response"]).to_pylist()
        problems = store.read_table(problems_id, columns=["problem_id", "answer"]).to_pylist()
        answer_of = {p["problem_id"]: p["answer"] for p in problems}
        rows = []
        for r in rollouts:
            score = verifier.score(r["response"], answer_of[r["problem_id"]])
            rows.append({
                "rollout_id": r["rollout_id"], "run_id": run_id, "step": step, "problem_id": r["problem_id"],
                "verifier": verifier.name, "verifier_version": verifier.version, "score": score.value,
                "status": score.status, "extracted": score.extracted, "reason": score.reason,
                "components": json.dumps(score.components, sort_keys=True),
            })
        return Built(rows_to_table("rewards", rows))

    return commit_stage(store, out, build)
