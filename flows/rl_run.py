"""The RL run as Prefect flows: the order of stages at a glance.

    config -> synthesize -> initialize -> evaluate(init) -> warmstart -> evaluate(warmstart) -> difficulty
    then for every RL step t (one Prefect task run, `rl-step`):
        select -> allocate -> rollout -> label -> train -> update
    and every `evaluate.every` / `checkpoint.every` steps (and at the last one): evaluate, checkpoint

Steps are grouped into subflows of `flow.steps_per_subflow` steps (a subflow per step would cost
about a second each on the embedded server, more than a tiny model's whole step). Every stage skips
work whose outputs are already committed, so running this flow again on a killed run's config is
`rlvr resume`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NONE

from rlvr.flows.config import RunConfigBase, commit_config
from rlvr.flows.progress import report
from rlvr.flows.stages import run
from rlvr.storage.stage import open_store, prune_transient
from rlvr.tasks.allocate import ALLOCATE
from rlvr.tasks.checkpoint import CHECKPOINT
from rlvr.tasks.difficulty import DIFFICULTY
from rlvr.tasks.evaluate import EVALUATE
from rlvr.tasks.initialize import INITIALIZE
from rlvr.tasks.label import LABEL
from rlvr.tasks.rollout import ROLLOUT
from rlvr.tasks.select import SELECT
from rlvr.tasks.synthesize import SYNTHESIZE
from rlvr.tasks.train import TRAIN
from rlvr.tasks.update import UPDATE
from rlvr.tasks.warmstart import WARMSTART
from rlvr.trainer.checkpoints import weights_artifact


@dataclass(frozen=True)
class StepRefs:
    """What one RL step hands the next: the problems and their difficulty, the policy to sample and train
    (a checkpoints or train_steps id) and the selection strategy's state (a curriculum_state id)."""

    problems: str
    difficulty: str
    policy: str
    state: str | None = None


@task(name="rl-step", cache_policy=NONE)
def rl_step(store: str, cfg: RunConfigBase, step: int, refs: StepRefs) -> tuple[StepRefs, dict[str, Any]]:
    """One RL step; returns the refs for the next step and the step's train_steps row.

    The step's artifacts are committed as one group (`Store.batch`): a kill redoes the whole step.
    """
    with open_store(store).batch():
        return _step_stages(store, cfg, step, refs)


def _step_stages(store: str, cfg: RunConfigBase, step: int, refs: StepRefs) -> tuple[StepRefs, dict[str, Any]]:
    at: dict[str, Any] = dict(store=store, run_id=cfg.run_id, seed=cfg.seed, step=step)
    problems, difficulty = refs.problems, refs.difficulty
    selections = run(
        SELECT, cfg.select, inputs={"problems": problems, "difficulty": difficulty, "state": refs.state}, **at
    )
    allocations = run(ALLOCATE, cfg.allocate, inputs={"selections": selections.id, "difficulty": difficulty}, **at)
    rollouts = run(
        ROLLOUT, cfg.rollout, inputs={"allocations": allocations.id, "problems": problems, "policy": refs.policy}, **at
    )
    rewards = run(LABEL, cfg.label, inputs={"rollouts": rollouts.id, "problems": problems}, **at)["rewards"]
    trained = run(TRAIN, cfg.train, inputs={"rollouts": rollouts.id, "rewards": rewards, "policy": refs.policy}, **at)
    updated = run(
        UPDATE,
        cfg.select,
        inputs={
            "state": refs.state,
            "problems": problems,
            "difficulty": difficulty,
            "selections": selections.id,
            "rollouts": rollouts.id,
            "rewards": rewards,
        },
        params={"advantage_scale": cfg.train.grpo.advantage_scale},
        **at,
    )
    metrics = trained.table(open_store(store), "train_steps").to_pylist()[0]
    return replace(refs, policy=trained["train_steps"], state=updated.id), metrics


def evaluate(store: str, cfg: RunConfigBase, step: int, phase: str, refs: StepRefs) -> float:
    """Greedy accuracy of `refs.policy` on the held-out split (an `evals` row)."""
    at: dict[str, Any] = dict(store=store, run_id=cfg.run_id, seed=cfg.seed, step=step)
    result = run(
        EVALUATE,
        cfg.evaluate,
        inputs={"policy": refs.policy, "problems": refs.problems},
        params={"phase": phase, "verifier": cfg.label},
        **at,
    )
    return float(result.table(open_store(store)).column("accuracy")[0].as_py())


@flow(name="rl-steps", validate_parameters=False)
def rl_steps(store: str, cfg: RunConfigBase, first: int, last: int, refs: StepRefs) -> StepRefs:
    """RL steps first..last; returns the refs after the last one."""
    for step in range(first, last + 1):
        refs, metrics = rl_step(store, cfg, step, refs)
        report("step", step=step, reward=metrics["mean_reward"])
        final = step == cfg.train.steps
        if step % cfg.evaluate.every == 0 or final:
            report("eval", step=step, accuracy=evaluate(store, cfg, step, "rl", refs))
        if step % cfg.checkpoint.every == 0 or final:
            at: dict[str, Any] = dict(store=store, run_id=cfg.run_id, seed=cfg.seed, step=step)
            run(CHECKPOINT, cfg.checkpoint, inputs={"policy": refs.policy}, **at)
    return refs


@flow(name="rl-run", validate_parameters=False)
def rl_run(store: str, cfg: RunConfigBase) -> dict[str, Any]:
    """The whole run; returns the ids a summary needs."""
    assert cfg.run_id is not None
    at: dict[str, Any] = dict(store=store, run_id=cfg.run_id, seed=cfg.seed)
    config_id = commit_config(open_store(store), cfg)
    report("stage", name="synthesize")
    problems = run(SYNTHESIZE, cfg.synthesize, inputs={"config": config_id}, **at)["problems"]
    initial = run(INITIALIZE, cfg.policy, inputs={"config": config_id}, params={"seed": cfg.seed}, step=0, **at).id
    refs = StepRefs(problems=problems, difficulty="", policy=initial)
    report("eval", step=0, phase="init", accuracy=evaluate(store, cfg, 0, "init", refs))
    if cfg.warmstart.steps:
        report("stage", name="warmstart")
        warm = run(WARMSTART, cfg.warmstart, inputs={"problems": problems, "policy": initial}, step=0, **at)
        refs = replace(refs, policy=warm["checkpoints"])
        report("eval", step=0, phase="warmstart", accuracy=evaluate(store, cfg, 0, "warmstart", refs))
    report("stage", name="difficulty")
    difficulty = run(
        DIFFICULTY,
        cfg.difficulty,
        inputs={"problems": problems, "policy": refs.policy},
        params={"verifier": cfg.label},
        **at,
    )
    refs = replace(refs, difficulty=difficulty.id)
    report("stage", name="rl")
    size = cfg.flow.steps_per_subflow
    for first in range(1, cfg.train.steps + 1, size):
        refs = rl_steps(store, cfg, first, min(first + size - 1, cfg.train.steps), refs)
    _keep_newest_train_state(store, cfg.run_id, refs.policy)
    return {"run_id": cfg.run_id, "config_id": config_id, "problems_id": problems, "policy_id": refs.policy}


def _keep_newest_train_state(store_root: str, run_id: str, policy_ref: str) -> None:
    """A crash between a train_state commit and the delete of the previous one can leave an extra."""
    store = open_store(store_root)
    keep = weights_artifact(store, policy_ref) if store.manifest(policy_ref).kind == "train_steps" else ""
    prune_transient(store, "train_state", run_id, keep)
