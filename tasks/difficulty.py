"""difficulty: k sampled rollouts of the current policy per problem, verified; pass rate and Beta posterior.

The only stage that is large even on the tiny default (k rollouts for the whole pool), so it writes
in shards: a crash loses at most the shard in flight, and resume skips committed shards.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from rlvr.progress import report
from rlvr.storage.stage import Built, Inputs, Output, Sharded, Stage, StageContext, rows_to_table
from rlvr.trainer.checkpoints import load_policy
from rlvr.trainer.generation import sample
from rlvr.verifiers.cache import VerifierConfig, score_cached, verifier_identity


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
    return {
        "run_id": run_id,
        "problem_id": problem_id,
        "policy_id": policy_id,
        "k": k,
        "successes": successes,
        "pass_rate": successes / k,
        "beta_alpha": alpha,
        "beta_beta": beta,
        "posterior_mean": mean,
        "bin": min(int(mean * bins), bins - 1),
    }


def build(inputs: Inputs, cfg: DifficultyConfig, ctx: StageContext) -> Sharded:
    """params: `verifier` (the label section). Problems are taken in id order, `shard_size` per shard."""
    verifier: VerifierConfig = ctx.params["verifier"]
    problems = [
        p
        for p in inputs.rows("problems", ["problem_id", "split", "prompt", "reference", "verifier"])
        if p["split"] in cfg.splits
    ]
    problems.sort(key=lambda p: p["problem_id"])
    policy_ref = inputs.require_id("policy")
    policy = inputs.load("policy", load_policy)

    def make(index: int) -> pa.Table:
        shard = problems[index * cfg.shard_size : (index + 1) * cfg.shard_size]
        samples = sample(
            policy,
            [p["prompt"] for p in shard],
            [cfg.k] * len(shard),
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=1.0,
            seed=ctx.derive_seed("difficulty", index),
        )
        pairs = [(s.text, shard[s.prompt_index]["reference"]) for s in samples]
        scores, _, _ = score_cached(ctx.store, verifier, pairs, [shard[s.prompt_index]["verifier"] for s in samples])
        successes = [0] * len(shard)
        for s, score in zip(samples, scores):
            successes[s.prompt_index] += score.status == "ok"
        rows = [
            difficulty_row(ctx.run_id, p["problem_id"], policy_ref, cfg.k, n, cfg.bins)
            for p, n in zip(shard, successes)
        ]
        report("shard", stage="difficulty", done=index + 1, total=count)
        return rows_to_table("difficulty", rows)

    count = -(-len(problems) // cfg.shard_size)
    return Sharded(count=count, make=make)


def _label_key(label: str) -> tuple[float, str]:
    """Order of metadata labels: by the number in them when there is one ("Level 2" < "Level 10")."""
    number = re.search(r"-?\d+(\.\d+)?", label)
    return (float(number.group()) if number else float("inf"), label)


def labels_build(inputs: Inputs, cfg: DifficultyConfig, ctx: StageContext) -> Built:
    """Difficulty from the problems' `difficulty_label` (e.g. MATH's levels) instead of rollouts: the
    labels' rank order (higher = harder) as a pass-rate estimate 1 - (rank + 0.5) / labels, binned.
    Unlabelled problems get no row, as if never estimated."""
    problems = [
        p
        for p in inputs.rows("problems", ["problem_id", "split", "difficulty_label"])
        if p["split"] in cfg.splits and p["difficulty_label"]
    ]
    labels = sorted({p["difficulty_label"] for p in problems}, key=_label_key)
    rank = {label: i for i, label in enumerate(labels)}
    rows = []
    for p in sorted(problems, key=lambda p: p["problem_id"]):
        estimate = 1.0 - (rank[p["difficulty_label"]] + 0.5) / len(labels)
        rows.append(
            {
                "run_id": ctx.run_id,
                "problem_id": p["problem_id"],
                "policy_id": f"labels:{p['difficulty_label']}",
                "k": 0,
                "successes": 0,
                "pass_rate": None,
                "beta_alpha": None,
                "beta_beta": None,
                "posterior_mean": estimate,
                "bin": min(int(estimate * cfg.bins), cfg.bins - 1),
            }
        )
    return Built(rows_to_table("difficulty", rows))


def identity(cfg: DifficultyConfig, params: Mapping[str, Any]) -> dict[str, Any]:
    return {**cfg.model_dump(), **verifier_identity(params["verifier"])}


DIFFICULTY: Stage[DifficultyConfig] = Stage(
    name="difficulty",
    code_version="2",
    section="difficulty",
    config=DifficultyConfig,
    inputs=("problems", "policy"),
    outputs={"difficulty": Output("difficulty", sharded=True)},
    build=build,
    identity=identity,
)

DIFFICULTY_FROM_LABELS: Stage[DifficultyConfig] = Stage(
    name="difficulty_labels",
    code_version="1",
    section="difficulty",
    config=DifficultyConfig,
    inputs=("problems",),
    outputs={"difficulty": Output("difficulty")},
    build=labels_build,
)
