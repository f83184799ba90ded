"""evaluate: greedy accuracy of a policy on a held-out split, verified like the training rewards."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE
from pydantic import BaseModel, ConfigDict, Field

from rlvr.storage.stage import Built, StageOutput, commit_stage, open_store, rows_to_table
from rlvr.trainer.checkpoints import load_policy
from rlvr.trainer.generation import greedy
from rlvr.verifiers.cache import VerifierConfig, score_cached

CODE_VERSION = "1"


class EvaluateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every: int = Field(50, ge=1, description="RL steps between evaluations (the last step always gets one)")
    split: str = "test"
    max_new_tokens: int = Field(3, ge=1)


@task(name="evaluate", cache_policy=NONE)
def evaluate(
    store_root: str, run_id: str, step: int, phase: str, cfg: EvaluateConfig, label: VerifierConfig,
    problems_id: str, policy_ref: str,
) -> float:
    """Commit an `evals` row for `policy_ref` on the held-out split; return the accuracy."""
    store = open_store(store_root)
    settings = {"split": cfg.split, "max_new_tokens": cfg.max_new_tokens, "verifier": label.verifier,
                "phase": phase}
    out = StageOutput("evals", "evaluate", CODE_VERSION, run_id, (policy_ref, problems_id), settings, step=step)

    def build() -> Built:
        problems = [p for p in store.read_table(problems_id, columns=["split", "prompt", "answer"]).to_pylist()
                    if p["split"] == cfg.split]
        if not problems:
            raise ValueError(f"evaluation split {cfg.split!r} has no problems")
        answers = greedy(load_policy(store, policy_ref), [p["prompt"] for p in problems],
                         max_new_tokens=cfg.max_new_tokens)
        scores, _, _ = score_cached(store, label, [(a, p["answer"]) for a, p in zip(answers, problems)])
        correct = sum(s.status == "ok" for s in scores)
        row = {"run_id": run_id, "step": step, "phase": phase, "split": cfg.split, "policy_id": policy_ref,
               "accuracy": correct / len(problems), "correct": correct, "n": len(problems)}
        return Built(rows_to_table("evals", [row]))

    aid = commit_stage(store, out, build)
    return float(store.read_table(aid, columns=["accuracy"]).column("accuracy")[0].as_py())
