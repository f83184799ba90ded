"""difficulty: k sampled rollouts of the current policy per problem, verified; pass rate and Beta posterior.

The only stage that is large even on the tiny default (k rollouts for the whole pool), so it writes
in shards: a crash loses at most the shard in flight, and resume skips committed shards.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE
from pydantic import BaseModel, ConfigDict, Field

from rlvr.storage.ids import derive_seed
from rlvr.storage.stage import StageOutput, open_store, rows_to_table
from rlvr.trainer.checkpoints import load_policy
from rlvr.trainer.generation import sample
from rlvr.verifiers.cache import VerifierConfig, score_cached

CODE_VERSION = "1"


class DifficultyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    k: int = Field(8, ge=1, description="rollouts per problem")
    shard_size: int = Field(32, ge=1, description="problems per committed shard")
    bins: int = Field(5, ge=1, description="equal-width bins of the posterior mean")
    splits: list[str] = Field(default_factory=lambda: ["train", "warmup"])
    max_new_tokens: int = Field(3, ge=1)
    temperature: float = Field(1.0, gt=0)


def difficulty_row(run_id: str, problem_id: str, policy_id: str, k: int, successes: int, bins: int) -> dict:
    """Pass rate and its Beta(1+s, 1+k-s) posterior (uniform prior) for one problem."""
    alpha, beta = 1.0 + successes, 1.0 + k - successes
    mean = alpha / (alpha + beta)
    return {"run_id": run_id, "problem_id": problem_id, "policy_id": policy_id, "k": k,
            "successes": successes, "pass_rate": successes / k, "beta_alpha": alpha, "beta_beta": beta,
            "posterior_mean": mean, "bin": min(int(mean * bins), bins - 1)}


@task(name="difficulty", cache_policy=NONE)
def difficulty(
    store_root: str, run_id: str, seed: int, cfg: DifficultyConfig, label: VerifierConfig,
    problems_id: str, policy_ref: str,
) -> str:
    """Commit the `difficulty` artifact (one row per pool problem), shard by shard."""
    store = open_store(store_root)
    out = StageOutput("difficulty", "difficulty", CODE_VERSION, run_id, (problems_id, policy_ref),
                      {**cfg.model_dump(), "verifier": label.verifier})
    if store.exists(out.artifact_id):
        return out.artifact_id
    problems = [p for p in store.read_table(problems_id, columns=["problem_id", "split", "prompt", "answer"])
                .to_pylist() if p["split"] in cfg.splits]
    problems.sort(key=lambda p: p["problem_id"])
    writer = store.writer("difficulty", out.artifact_id, run_id=run_id, stage="difficulty",
                          parents=list(out.parents), code_version=CODE_VERSION, config=dict(out.config))
    done = writer.committed_shards()
    policy = load_policy(store, policy_ref)
    for index, start in enumerate(range(0, len(problems), cfg.shard_size)):
        if index in done:
            continue
        shard = problems[start : start + cfg.shard_size]
        samples = sample(policy, [p["prompt"] for p in shard], [cfg.k] * len(shard),
                         max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=1.0,
                         seed=derive_seed(seed, "difficulty", index))
        scores, _, _ = score_cached(store, label, [(s.text, shard[s.prompt_index]["answer"]) for s in samples])
        successes = [0] * len(shard)
        for s, score in zip(samples, scores):
            successes[s.prompt_index] += score.status == "ok"
        rows = [difficulty_row(run_id, p["problem_id"], policy_ref, cfg.k, n, cfg.bins)
                for p, n in zip(shard, successes)]
        writer.write_shard(index, rows_to_table("difficulty", rows))
    writer.commit()
    return out.artifact_id
