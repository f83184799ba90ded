"""difficulty: k sampled rollouts of the current policy per problem, verified; pass rate and Beta posterior.

The only stage that is large even on the tiny default (k rollouts for the whole pool), so it writes
in shards: a crash loses at most the shards in flight, and resume skips committed shards. The verdicts
behind the pass rates go in the store's reward cache (a `reward_cache` artifact beside `difficulty`), as a
label stage's do. Each shard is a unit of the run's fan-out (`params["fan_out"]`, flows/executors.py): on
another backend the shards are sampled and verified on the workers, which load the policy from the store by
its id onto the run's `policy.device` as they resolve it (`params["device"]`: `auto` takes a worker's own GPU).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

import pyarrow as pa
import torch
from pydantic import BaseModel, ConfigDict, Field

from rlvr.progress import report
from rlvr.storage.stage import Built, Inputs, Output, Sharded, Stage, StageContext, rows_to_table
from rlvr.storage.store import open_store
from rlvr.trainer.checkpoints import load_policy
from rlvr.trainer.devices import stage_device, usage
from rlvr.trainer.engine_base import SamplingParams
from rlvr.trainer.engines import EngineConfig, engine_for
from rlvr.trainer.generation import Sample, sample
from rlvr.trainer.policy import Policy
from rlvr.verifiers.cache import (
    VerifierConfig,
    cache_entries,
    reward_cache,
    score_cached,
    verdict_keys,
    verifier_identity,
)
from rlvr.verifiers.model_rewards import announce_calls
from rlvr.verifiers.outcomes import solved


class DifficultyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    k: int = Field(8, ge=1, description="rollouts per problem")
    shard_size: int = Field(32, ge=1, description="problems per committed shard")
    bins: int = Field(5, ge=1, description="equal-width bins of the posterior mean")
    splits: list[str] = Field(default_factory=lambda: ["train", "warmup"])
    max_new_tokens: int = Field(3, ge=1)
    temperature: float = Field(1.0, gt=0)


def difficulty_row(run_id: str, problem_id: str, policy_id: str, k: int, successes: int, bins: int) -> dict:
    """Pass rate and its Beta(1+s, 1+k-s) posterior (uniform prior) for one problem; `k` counts the verdicts given
    (a sample whose verdict failed, status error, is neither a success nor a failure: verifiers/outcomes.py), so
    with none the pass rate is unknown (None) and the posterior the prior's."""
    alpha, beta = 1.0 + successes, 1.0 + k - successes
    mean = alpha / (alpha + beta)
    return {
        "run_id": run_id,
        "problem_id": problem_id,
        "policy_id": policy_id,
        "k": k,
        "successes": successes,
        "pass_rate": successes / k if k else None,
        "beta_alpha": alpha,
        "beta_beta": beta,
        "posterior_mean": mean,
        "bin": min(int(mean * bins), bins - 1),
    }


@dataclass(frozen=True)
class ShardJob:
    """One shard's work, as a worker needs it: its index, the problems, the settings, the seed, where the
    policy is (the store's root and the policy's id; or the policy itself, for a build given its inputs without
    a store) and the device to sample on (the run's policy.device, resolved by the worker)."""

    index: int
    problems: list[dict[str, Any]]
    cfg: DifficultyConfig
    verifier: VerifierConfig
    seed: int
    store: str | None
    policy_id: str
    policy: Policy | None = None
    device: str | None = None
    engine: EngineConfig | None = None  # the run's engine when it is not transformers


@dataclass(frozen=True)
class ShardEstimate:
    """Successes per problem of shard `index`, and the reward-cache entries of the cacheable verdicts behind
    them, cache hits included (the process that commits the shard adds them to its cache, so later stages
    find the same reward-cache hits wherever the shard ran, whatever that worker had in its cache), and the
    device it was sampled on with the accelerator's peak memory while it was (None on the CPU)."""

    index: int
    successes: list[int]
    verdicts: list[int]  # per problem: the samples with a verdict (not status error)
    entries: list[dict[str, Any]]
    device: str | None = None
    peak_memory_bytes: int | None = None


def estimate_shard(job: ShardJob) -> ShardEstimate:
    """k sampled rollouts per problem of one shard, verified."""
    device = stage_device(job.device)
    policy = job.policy or shard_policy(job.store or "", job.policy_id, device)
    problems = job.problems
    samples = _sampled(policy, job, [p["prompt"] for p in problems])
    pairs = [(s.text, problems[s.prompt_index]["reference"]) for s in samples]
    names = [job.verifier.verifier_of(problems[s.prompt_index]["verifier"]) for s in samples]
    store = open_store(job.store) if job.store is not None else None
    questions = [problems[s.prompt_index]["prompt"] for s in samples]  # what a judge is asked with the answer
    scores, _, _ = score_cached(store, job.verifier, pairs, names, questions=questions)
    successes, verdicts = [0] * len(problems), [0] * len(problems)
    for s, name, score in zip(samples, names, scores, strict=True):
        found = solved(name, score.status)
        successes[s.prompt_index] += found is True
        verdicts[s.prompt_index] += found is not None
    entries = cache_entries(verdict_keys(names, pairs, job.verifier, questions), scores)
    return ShardEstimate(job.index, successes, verdicts, entries, **usage(policy.model))


def _sampled(policy: Policy, job: ShardJob, prompts: list[str]) -> list[Sample]:
    """k samples of each prompt: through the run's engine when the job names one, else transformers."""
    cfg = job.cfg
    if job.engine is None:
        return sample(
            policy,
            prompts,
            [cfg.k] * len(prompts),
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=1.0,
            seed=job.seed,
        )
    engine = engine_for(job.engine)
    engine.update_weights(policy, job.policy_id)
    sampling = SamplingParams(cfg.max_new_tokens, cfg.temperature, 1.0, job.seed)
    return engine.generate(prompts, [cfg.k] * len(prompts), sampling)


@lru_cache(maxsize=1)
def shard_policy(store_root: str, policy_id: str, device: torch.device) -> Policy:
    """The policy to sample on `device` (`load_policy`: the live one when this process holds it there, else
    loaded from the store), kept for the stage's next shards in this process; the stage's build lets go of it
    after its last shard (a worker keeps it until its next stage's first shard)."""
    return load_policy(open_store(store_root), policy_id, device=device)


def _shard_jobs(inputs: Inputs, cfg: DifficultyConfig, ctx: StageContext) -> list[ShardJob]:
    """The problems of `cfg.splits`, in id order, `shard_size` a shard, each shard with its seed and where to find
    the policy (the store, or without one the policy given as an input)."""
    problems = [
        p
        for p in inputs.rows("problems", ["problem_id", "split", "prompt", "reference", "verifier"])
        if p["split"] in cfg.splits
    ]
    problems.sort(key=lambda p: p["problem_id"])
    device = ctx.params.get("device")
    given = None if ctx.store is not None else inputs.load("policy", partial(load_policy, device=stage_device(device)))
    root = ctx.store.root if ctx.store is not None else None
    policy_ref = inputs.require_id("policy")
    return [
        ShardJob(
            index,
            problems[start : start + cfg.shard_size],
            cfg,
            ctx.params["verifier"],
            ctx.derive_seed("difficulty", index),
            root,
            policy_ref,
            given,
            device,
            ctx.params.get("rollout"),
        )
        for index, start in enumerate(range(0, len(problems), cfg.shard_size))
    ]


def build(inputs: Inputs, cfg: DifficultyConfig, ctx: StageContext) -> dict[str, Sharded]:
    """params: `verifier` (the label section), `fan_out` (where shards run; in place without one), `device`
    (the run's policy.device) and, when the run samples through another engine than transformers, `rollout`
    (that engine's config). Problems are taken in id order, `shard_size` per shard. Besides the `difficulty` rows,
    a `reward_cache` artifact of the verdicts behind them (a shard per difficulty shard, made after the last)."""
    fan_out: Callable[..., Iterator[Any]] = ctx.params.get("fan_out", map)
    jobs = _shard_jobs(inputs, cfg, ctx)
    announce_calls("difficulty", ctx.params["verifier"], [p["verifier"] for job in jobs for p in job.problems], cfg.k)
    policy_ref, count = inputs.require_id("policy"), len(jobs)
    results: Iterator[ShardEstimate] | None = None
    verdicts: dict[int, list[dict[str, Any]]] = {}  # each shard's cache entries, of the shards made in this process

    def make(index: int) -> pa.Table:
        # The runner asks for the shards not yet committed, in order (after a crash: all from the first
        # missing one), so the fan-out starts there and yields them in that order.
        nonlocal results
        if results is None:
            results = fan_out(estimate_shard, jobs[index:])
        estimate = next(results, None)
        if estimate is None or estimate.index != index:
            found = "no more shards" if estimate is None else f"shard {estimate.index}"
            raise RuntimeError(f"difficulty shard {index} was asked for, but the fan-out returned {found}")
        if index == count - 1:
            shard_policy.cache_clear()  # the stage's last shard: keep no copy of the policy past it
        verdicts[index] = estimate.entries
        if ctx.store is not None:
            reward_cache(ctx.store).add_entries(estimate.entries)  # later stages of this process hit them at once
        peaks = [peak for peak in (ctx.usage.get("peak_memory_bytes"), estimate.peak_memory_bytes) if peak is not None]
        ctx.usage.update(device=estimate.device, peak_memory_bytes=max(peaks, default=None))
        rows = [
            difficulty_row(ctx.run_id, p["problem_id"], policy_ref, k, n, cfg.bins)
            for p, n, k in zip(jobs[index].problems, estimate.successes, estimate.verdicts, strict=True)
        ]
        report("shard", stage="difficulty", done=index + 1, total=count)
        return rows_to_table("difficulty", rows)

    def make_cache(index: int) -> pa.Table:
        # Made after the last difficulty shard, from the verdicts each shard found. A shard committed by an attempt
        # that crashed is sampled and verified again here, so the artifact is the same whatever crashed before it.
        if index not in verdicts:
            for estimate in fan_out(estimate_shard, [job for job in jobs[index:] if job.index not in verdicts]):
                verdicts[estimate.index] = estimate.entries
            shard_policy.cache_clear()
        return rows_to_table("reward_cache", verdicts.pop(index))

    return {"difficulty": Sharded(count=count, make=make), "reward_cache": Sharded(count=count, make=make_cache)}


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
    """The engine counts when it is not transformers (params `rollout`: its samples differ)."""
    engine = {"engine": params["rollout"].type} if params.get("rollout") is not None else {}
    return {**cfg.model_dump(), **verifier_identity(params["verifier"]), **engine}


DIFFICULTY: Stage[DifficultyConfig] = Stage(
    name="difficulty",
    code_version="3",  # 3: a failed verdict (status error) is neither a success nor a failure
    section="difficulty",
    config=DifficultyConfig,
    inputs=("problems", "policy"),
    # difficulty first: it is the stage's id (`StageRun.id`). The verdicts behind its successes go in the store's
    # reward cache, so a resumed run's later stages find them as the uninterrupted run's did (in its memory).
    outputs={"difficulty": Output("difficulty", sharded=True), "reward_cache": Output("reward_cache", sharded=True)},
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
