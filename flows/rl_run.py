"""The RL run as Prefect flows: the order of stages at a glance.

    synthesize -> initialize -> evaluate(init) -> warmstart -> evaluate(warmstart) -> difficulty
    then, for every RL step t: select -> allocate -> rollout -> label -> train
                               (+ evaluate every `evaluate.every`, checkpoint every `checkpoint.every`)

Steps are grouped into subflows of `flow.steps_per_subflow` steps (a subflow per step would cost
about a second each on the embedded server, more than a tiny model's whole step). Every stage
skips work whose artifact is already committed, so running this flow again on a killed run's
config is `rlvr resume`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from rlvr.flows.config import RunConfig, commit_config
from rlvr.flows.progress import report
from rlvr.storage.stage import open_store
from rlvr.tasks.allocate import allocate
from rlvr.tasks.checkpoint import checkpoint, initialize
from rlvr.tasks.difficulty import difficulty
from rlvr.tasks.evaluate import evaluate
from rlvr.tasks.label import label
from rlvr.tasks.rollout import rollout
from rlvr.tasks.select import select
from rlvr.tasks.synthesize import synthesize
from rlvr.tasks.train import prune_train_states, train
from rlvr.tasks.warmstart import warmstart


@flow(name="rl-steps", validate_parameters=False)
def rl_steps(
    store: str, cfg: RunConfig, first: int, last: int, problems: str, stats: str, policy: str
) -> str:
    """RL steps first..last; returns the policy reference after the last one."""
    run, seed, scorer = cfg.run_id, cfg.seed, cfg.label
    for step in range(first, last + 1):
        selections = select(store, run, seed, step, cfg.select, problems, stats)
        allocations = allocate(store, run, step, cfg.allocate, selections, stats)
        rollouts = rollout(store, run, seed, step, cfg.rollout, problems, allocations, policy)
        rewards = label(store, run, step, cfg.label, problems, rollouts)
        metrics = train(store, run, step, cfg.train, rollouts, rewards, policy)
        policy = metrics["policy_id"]
        report("step", step=step, reward=metrics["mean_reward"])
        final = step == cfg.train.steps
        if step % cfg.evaluate.every == 0 or final:
            accuracy = evaluate(store, run, step, "rl", cfg.evaluate, scorer, problems, policy)
            report("eval", step=step, accuracy=accuracy)
        if step % cfg.checkpoint.every == 0 or final:
            checkpoint(store, run, step, policy)
    return policy


@flow(name="rl-run", validate_parameters=False)
def rl_run(store: str, cfg: RunConfig) -> dict[str, Any]:
    """The whole run; returns the ids a summary needs."""
    run, seed, scorer = cfg.run_id, cfg.seed, cfg.label
    config_id = commit_config(open_store(store), cfg)
    report("stage", name="synthesize")
    problems = synthesize(store, run, seed, cfg.synthesize, config_id)
    initial = initialize(store, run, seed, cfg.policy, config_id)
    report("eval", step=0, phase="init",
           accuracy=evaluate(store, run, 0, "init", cfg.evaluate, scorer, problems, initial))
    report("stage", name="warmstart")
    policy = warmstart(store, run, seed, cfg.warmstart, problems, initial)
    report("eval", step=0, phase="warmstart",
           accuracy=evaluate(store, run, 0, "warmstart", cfg.evaluate, scorer, problems, policy))
    report("stage", name="difficulty")
    stats = difficulty(store, run, seed, cfg.difficulty, scorer, problems, policy)
    report("stage", name="rl")
    size = cfg.flow.steps_per_subflow
    for first in range(1, cfg.train.steps + 1, size):
        last = min(first + size - 1, cfg.train.steps)
        policy = rl_steps(store, cfg, first, last, problems, stats, policy)
    prune_train_states(store, run, policy)
    return {"run_id": run, "config_id": config_id, "problems_id": problems, "policy_id": policy}
