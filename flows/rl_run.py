"""The RL run as Prefect flows: the order of stages at a glance.

    config -> synthesize -> initialize -> evaluate(init) -> warmstart -> evaluate(warmstart) -> difficulty
    then for every RL step t (one Prefect task run, `rl-step`):
        select -> allocate -> rollout -> label  [-> filter, and refill rounds of these four]
        [-> restructure] -> train -> update
    and every `evaluate.every` / `checkpoint.every` steps (and at the last one): evaluate, checkpoint

Every stage that touches the model gets the run's `policy.device` as its `device` param (trainer/devices.py).

Steps are grouped into subflows of `flow.steps_per_subflow` steps (a subflow per step would cost
about a second each on the embedded server, more than a tiny model's whole step). Every stage skips
work whose outputs are already committed, so running this flow again on a killed run's config is
`rlvr resume`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NONE

from rlvr.curricula.filtering import prompts_to_draw
from rlvr.flows.config import RunConfigBase, commit_config, data_run_problems, require_problems
from rlvr.flows.data_run import estimate_difficulty, initial_policy, synthesized_problems
from rlvr.flows.executors import current_fan_out, use_executor
from rlvr.flows.stages import RunContext, run, run_context, step_of
from rlvr.progress import report
from rlvr.storage.stage import prune_transient
from rlvr.storage.store import open_store
from rlvr.tasks.allocate import ALLOCATE
from rlvr.tasks.checkpoint import CHECKPOINT
from rlvr.tasks.evaluate import EVALUATE
from rlvr.tasks.filter import FILTER
from rlvr.tasks.label import LABEL
from rlvr.tasks.restructure import RESTRUCTURE
from rlvr.tasks.rollout import ROLLOUT
from rlvr.tasks.select import SELECT
from rlvr.tasks.train import TRAIN
from rlvr.tasks.update import UPDATE
from rlvr.tasks.warmstart import WARMSTART
from rlvr.trainer.checkpoints import weights_artifact

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRefs:
    """What one RL step hands the next (artifact ids): the problem pool (the synthesized problems, then
    the rewrites CLPO kept), their difficulty, the policy to sample and train (`policy_ref`), the policy
    RL started from (the KL reference), the selection strategy's state, and the step's rewards (every
    round: the outcome buffers of the next allocation)."""

    problems: tuple[str, ...]
    difficulty: str
    policy_ref: str
    start_ref: str
    state: str | None = None
    rewards: tuple[str, ...] = ()


@dataclass
class Generated:
    """A step's rounds (one, or more with dynamic sampling's refills) and the filter's last decision."""

    selections: list[str] = field(default_factory=list)
    rollouts: list[str] = field(default_factory=list)
    rewards: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)


@task(name="rl-step", cache_policy=NONE)
def rl_step(store: str, cfg: RunConfigBase, step: int, refs: StepRefs) -> tuple[StepRefs, dict[str, Any]]:
    """One RL step; returns the refs for the next step and the step's train_steps row.

    The step's artifacts are committed as one group (`Store.batch`), in the background while the next
    step computes; a kill redoes the steps not yet on disk.
    """
    with open_store(store).batch(background=True):
        return _step_stages(store, cfg, step, refs)


def _step_stages(store: str, cfg: RunConfigBase, step: int, refs: StepRefs) -> tuple[StepRefs, dict[str, Any]]:
    at = run_context(store, cfg, step)
    made = _generate(at, cfg, refs)
    samples = {"rollouts": made.rollouts, "rewards": made.rewards}
    restructured = None
    if cfg.restructure.enabled:
        restructured = run(
            RESTRUCTURE,
            cfg.restructure,
            at,
            inputs={"problems": refs.problems, **samples, "policy": refs.policy_ref},
            params={
                "verifier": cfg.label,
                "rollout": cfg.rollout,
                "sources": cfg.synthesize.sources,
                "device": cfg.policy.device,
            },
        )
    reference = refs.start_ref if cfg.train.grpo.kl_beta > 0 else None
    trained = run(
        TRAIN,
        cfg.train,
        at,
        inputs={
            **samples,
            "policy": refs.policy_ref,
            "groups": made.groups,
            "restructured": restructured["restructured"] if restructured else None,
            "reference": reference,
        },
        params={"device": cfg.policy.device},
    )
    updated = run(
        UPDATE,
        cfg.select,
        at,
        inputs={
            "state": refs.state,
            "problems": refs.problems,
            "difficulty": refs.difficulty,
            "selections": made.selections,
            **samples,
        },
        params={"advantage_scale": cfg.train.grpo.advantage_scale},
    )
    problems = refs.problems
    if restructured is not None and restructured.manifest(open_store(store), "restructured").extra["kept"]:
        problems = (*problems, restructured["problems"])
    metrics = trained.table(open_store(store), "train_steps").to_pylist()[0]
    next_refs = replace(
        refs, problems=problems, policy_ref=trained["train_steps"], state=updated.id, rewards=tuple(made.rewards)
    )
    return next_refs, metrics


def _generate(at: RunContext, cfg: RunConfigBase, refs: StepRefs) -> Generated:
    """select -> allocate -> rollout -> label; with dynamic sampling, filter after each round and refill
    with new prompts until the batch has enough groups with reward variance or the refills run out."""
    made, drawn, refills = Generated(), 0, 0
    count = prompts_to_draw(cfg.select.batch_size, cfg.filter)
    while True:
        rounds = {"round": refills, "count": count, "first_slot": drawn} if cfg.filter.enabled else {}
        selections = run(
            SELECT,
            cfg.select,
            at,
            inputs={"problems": refs.problems, "difficulty": refs.difficulty, "state": refs.state},
            params=rounds,
        )
        allocations = run(
            ALLOCATE,
            cfg.allocate,
            at,
            inputs={"selections": selections.id, "difficulty": refs.difficulty, "rewards": refs.rewards},
        )
        rollouts = run(
            ROLLOUT,
            cfg.rollout,
            at,
            inputs={"allocations": allocations.id, "problems": refs.problems, "policy": refs.policy_ref},
            params={"device": cfg.policy.device},
        )
        fanned = {"fan_out": current_fan_out()}  # it carries flow.executor.verify_chunk
        rewards = run(LABEL, cfg.label, at, inputs={"rollouts": rollouts.id, "problems": refs.problems}, params=fanned)
        made.selections.append(selections.id)
        made.rollouts.append(rollouts.id)
        made.rewards.append(rewards["rewards"])
        if not cfg.filter.enabled:
            return made
        groups = run(
            FILTER,
            cfg.filter,
            at,
            inputs={"rollouts": made.rollouts, "rewards": made.rewards},
            params={"batch_size": cfg.select.batch_size, "refills_done": refills, "first_slot": drawn},
        )
        made.groups.append(groups.id)
        decision = groups.manifest(open_store(at.store)).extra
        if not decision["refill_prompts"]:
            if decision["limit_reached"]:
                _warn_refill_limit(cfg, step_of(at), decision["kept"])
            return made
        drawn, count, refills = drawn + count, decision["refill_prompts"], refills + 1


_warned: set[str] = set()


def _warn_refill_limit(cfg: RunConfigBase, step: int, kept: int) -> None:
    """Dynamic sampling could not fill the batch: say so once per run, then train on what there is."""
    if cfg.run_id in _warned:
        return
    _warned.add(str(cfg.run_id))
    message = (
        f"dynamic sampling: after {cfg.filter.max_refills} refills step {step} has only {kept} of "
        f"{cfg.select.batch_size} groups with reward variance; training on those (warned once per run)"
    )
    log.warning(message)
    report("warning", message=message)


def evaluate(store: str, cfg: RunConfigBase, step: int, phase: str, refs: StepRefs) -> float:
    """Greedy accuracy of `refs.policy_ref` on the held-out split of the synthesized problems (an `evals` row)."""
    inputs = {"policy": refs.policy_ref, "problems": refs.problems[0]}
    params = {"phase": phase, "verifier": cfg.label, "device": cfg.policy.device}
    result = run(EVALUATE, cfg.evaluate, run_context(store, cfg, step), inputs=inputs, params=params)
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
            run(CHECKPOINT, cfg.checkpoint, run_context(store, cfg, step), inputs={"policy": refs.policy_ref})
    return refs


@flow(name="rl-run", validate_parameters=False)
def rl_run(store: str, cfg: RunConfigBase) -> dict[str, Any]:
    """The whole run; returns the ids a summary needs. Stages fan their units out on `flow.executor`."""
    with use_executor(cfg.flow.executor, store):
        return _whole_run(store, cfg)


def _whole_run(store: str, cfg: RunConfigBase) -> dict[str, Any]:
    assert cfg.run_id is not None
    config_id = commit_config(open_store(store), cfg)
    problems = problems_of_run(store, cfg, config_id)
    initial = initial_policy(store, cfg, config_id)
    refs = StepRefs(problems=(problems,), difficulty="", policy_ref=initial, start_ref=initial)
    report("eval", step=0, phase="init", accuracy=evaluate(store, cfg, 0, "init", refs))
    if cfg.warmstart.steps:
        report("stage", name="warmstart")
        inputs = {"problems": problems, "policy": initial}
        at = run_context(store, cfg, 0)
        warm = run(WARMSTART, cfg.warmstart, at, inputs=inputs, params={"device": cfg.policy.device})
        refs = replace(refs, policy_ref=warm["checkpoints"], start_ref=warm["checkpoints"])
        report("eval", step=0, phase="warmstart", accuracy=evaluate(store, cfg, 0, "warmstart", refs))
    refs = replace(refs, difficulty=estimate_difficulty(store, cfg, problems, refs.policy_ref))
    report("stage", name="rl")
    size = cfg.flow.steps_per_subflow
    for first in range(1, cfg.train.steps + 1, size):
        refs = rl_steps(store, cfg, first, min(first + size - 1, cfg.train.steps), refs)
    _keep_newest_train_state(store, cfg.run_id, refs.policy_ref)
    open_store(store).wait()
    return {"run_id": cfg.run_id, "config_id": config_id, "problems_id": problems, "policy_id": refs.policy_ref}


def problems_of_run(store: str, cfg: RunConfigBase, config_id: str) -> str:
    """The run's problems: synthesized now, or those a data run made (`rlvr run --data RUN_ID`)."""
    if cfg.data is None:
        return require_problems(open_store(store), synthesized_problems(store, cfg, config_id), str(cfg.run_id))
    return data_run_problems(open_store(store), cfg.data)


def _keep_newest_train_state(store_root: str, run_id: str, policy_ref: str) -> None:
    """A crash between a train_state commit and the delete of the previous one can leave an extra."""
    store = open_store(store_root)
    keep = weights_artifact(store, policy_ref) if store.manifest(policy_ref).kind == "train_steps" else ""
    prune_transient(store, "train_state", run_id, keep)
