"""warmstart: a short supervised stage on its own split, so RL starts from a policy that sometimes answers.

Pure RL from random init does not learn full-answer arithmetic on this model in minutes
(environment.md); a few supervised steps on the warmup split fix the output format. The held-out
test split is never seen here, so the rise in test accuracy after this stage comes from RL.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE
from pydantic import BaseModel, ConfigDict, Field

from rlvr.storage.ids import derive_seed
from rlvr.storage.stage import Built, StageOutput, commit_stage, open_store, rows_to_table
from rlvr.trainer.checkpoints import TrainerState, keep_trainer_state, load_policy
from rlvr.trainer.policy import make_optimizer, policy_files, policy_from_files
from rlvr.trainer.sft import sft_warmstart

CODE_VERSION = "1"


class WarmstartConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(60, ge=0, description="0 skips the warm start (the initial policy is used as is)")
    batch_size: int = Field(64, ge=1)
    lr: float = Field(3e-3, gt=0)
    split: str = "warmup"


@task(name="warmstart", cache_policy=NONE)
def warmstart(
    store_root: str, run_id: str, seed: int, cfg: WarmstartConfig, problems_id: str, init_id: str
) -> str:
    """Commit the `warmstart` losses and the warm-started `checkpoints`; return the checkpoint id."""
    store = open_store(store_root)
    if cfg.steps == 0:
        return init_id
    settings = cfg.model_dump()
    losses_out = StageOutput("warmstart", "warmstart", CODE_VERSION, run_id, (problems_id, init_id), settings)
    ckpt_out = StageOutput("checkpoints", "warmstart", CODE_VERSION, run_id, (losses_out.artifact_id,), {}, step=0)
    if store.exists(ckpt_out.artifact_id):
        return ckpt_out.artifact_id

    problems = store.read_table(problems_id, columns=["split", "prompt", "answer"]).to_pylist()
    examples = [(p["prompt"], p["answer"]) for p in problems if p["split"] == cfg.split]
    if not examples:
        raise ValueError(f"warm start split {cfg.split!r} has no problems")
    # A private copy: the initial policy object may be cached for other readers.
    policy = policy_from_files(policy_files(load_policy(store, init_id)))
    optimizer = make_optimizer(policy, lr=cfg.lr, weight_decay=0.0)
    losses = sft_warmstart(policy, optimizer, examples, steps=cfg.steps, batch_size=cfg.batch_size,
                           seed=derive_seed(seed, "warmstart"))
    rows = [{"run_id": run_id, "step": i + 1, "loss": loss, "examples": min(cfg.batch_size, len(examples)),
             "lr": cfg.lr} for i, loss in enumerate(losses)]
    commit_stage(store, losses_out, lambda: Built(rows_to_table("warmstart", rows)))

    def build_checkpoint() -> Built:
        n_params = sum(p.numel() for p in policy.model.parameters())
        row = {"run_id": run_id, "step": 0, "artifact_id": ckpt_out.artifact_id, "stage": "warmstart",
               "policy_id": init_id, "n_params": n_params}
        return Built(rows_to_table("checkpoints", [row]), files=policy_files(policy))

    aid = commit_stage(store, ckpt_out, build_checkpoint)
    keep_trainer_state(aid, TrainerState(policy, None))
    return aid
