"""The RL run as Prefect flows: the order of stages at a glance.

    config -> synthesize -> initialize -> evaluate(init) -> warmstart -> evaluate(warmstart) -> difficulty
    then for every RL step t (one Prefect task run, `rl-step`):
        select -> allocate -> rollout -> label (or rlpr)  [-> filter, and refill rounds of these four]
        [-> restructure] -> train -> update
    and every `evaluate.every` / `checkpoint.every` steps (and at the last one): evaluate, checkpoint

Every stage that touches the model gets the run's `policy.device` as its `device` param (trainer/devices.py).

Steps are grouped into subflows of `flow.steps_per_subflow` steps (a subflow per step would cost
about a second each on the embedded server, more than a tiny model's whole step). Every stage skips
work whose outputs are already committed, so running this flow again on a killed run's config is
`rlvr resume`.

The flow module imports no stage and no trainer module at import time (under 2.5 s of user CPU with Prefect,
docs/architecture.md "Testing"): `_whole_run` imports the steps (flows/rl_step.py, flows/step_loop.py) and the
stages when the run starts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from prefect import flow

from rlvr.environments.registry import check_environment
from rlvr.flows.compatibility import refuse_incompatible
from rlvr.flows.config import RunConfigBase, commit_config, data_run_problems, require_problems
from rlvr.flows.executors import use_executor
from rlvr.flows.run_preflight import announce_model_calls, check_async, check_clpo, warn_without_solutions
from rlvr.flows.stages import run, run_context
from rlvr.progress import report
from rlvr.storage.stage import RESIDENTS, prune_transient
from rlvr.storage.store import open_store


@flow(name="rl-run", validate_parameters=False)
def rl_run(store: str, cfg: RunConfigBase) -> dict[str, Any]:
    """The whole run; returns the ids a summary needs. Stages fan their units out on `flow.executor`."""
    with use_executor(cfg.flow.executor, store):
        return _whole_run(store, cfg)


def _whole_run(store: str, cfg: RunConfigBase) -> dict[str, Any]:
    from rlvr.flows.data_run import estimate_difficulty, initial_policy
    from rlvr.flows.rl_step import StepRefs, evaluate
    from rlvr.flows.sampling_server import stop_sampler_worker
    from rlvr.flows.step_loop import rl_steps
    from rlvr.tasks.warmstart import WARMSTART

    assert cfg.run_id is not None
    refuse_incompatible(cfg)  # a config made in Python, not loaded: its combinations and env keys too, before any work
    check_environment(cfg.env)
    check_async(cfg, store)
    check_clpo(cfg)
    config_id = commit_config(open_store(store), cfg)
    problems = problems_of_run(store, cfg, config_id)
    warn_without_solutions(store, cfg, problems)
    announce_model_calls(store, cfg, problems)
    initial = initial_policy(store, cfg, config_id)
    refs = StepRefs(problems=(problems,), difficulty="", policy_ref=initial, start_ref=initial)
    if cfg.train.data_parallel > 1:  # from here on every model use is the ranks': evaluations, the warm start,
        share_policy(store, cfg, refs.policy_ref)  # difficulty, rollouts, updates
    report("eval", step=0, phase="init", accuracy=evaluate(store, cfg, 0, "init", refs))
    if cfg.warmstart.steps:
        report("stage", name="warmstart")
        inputs = {"problems": problems, "policy": initial}
        at = run_context(store, cfg, 0)
        warm = run(WARMSTART, cfg.warmstart, at, inputs=inputs, params={"device": cfg.policy.device})
        refs = replace(refs, policy_ref=warm["checkpoints"], start_ref=warm["checkpoints"])
        if cfg.train.data_parallel > 1:  # live on the ranks when they trained it; read by slices on a resume
            share_policy(store, cfg, refs.policy_ref)
        report("eval", step=0, phase="warmstart", accuracy=evaluate(store, cfg, 0, "warmstart", refs))
    refs = replace(refs, difficulty=estimate_difficulty(store, cfg, problems, refs.policy_ref))
    report("stage", name="rl")
    size = cfg.flow.steps_per_subflow
    try:
        for first in range(1, cfg.train.steps + 1, size):
            refs = rl_steps(store, cfg, first, min(first + size - 1, cfg.train.steps), refs)
    finally:
        stop_sampler_worker(store, cfg)
        end_rank_group()  # at one rank too: a replay may have started a group (end_rank_group says when)
    _keep_newest_train_state(store, cfg.run_id, refs.policy_ref)
    open_store(store).wait()
    return {"run_id": cfg.run_id, "config_id": config_id, "problems_id": problems, "policy_id": refs.policy_ref}


def share_policy(store: str, cfg: RunConfigBase, policy_ref: str) -> None:
    """With train.data_parallel > 1: the run's policy, adopted by the run's rank group (with a fresh optimizer for
    the RL phase) and kept in memory under its id, so that the evaluations, the warm start, the difficulty estimate
    and the rollouts run on every rank. A policy the group holds already (the warm start's) is taken as it is."""
    from rlvr.trainer.checkpoints import Ranks, take_trainer_state
    from rlvr.trainer.devices import resolve_device

    ranks = Ranks(cfg.train.data_parallel, cfg.train.sharding, cfg.train.decode_weights)
    grpo, device = cfg.train.grpo, resolve_device(cfg.policy.device)
    state = take_trainer_state(open_store(store), policy_ref, grpo.lr, grpo.weight_decay, device=device, ranks=ranks)
    RESIDENTS.keep(policy_ref, state)


def end_rank_group() -> None:
    """Stop the run's data-parallel ranks, and forget the policy they held (a sharded model is no use without them).
    A run at one rank may have a group too: resumed after a kill at two ranks, it replays the updates after the
    newest stored state on the ranks that made them (trainer/checkpoints.py, `rebuilt_state`); those end with the
    run as well, not when its process exits (a run inside a longer-lived program kept them until then)."""
    from rlvr.trainer.checkpoints import TrainerState
    from rlvr.trainer.ranks.launch import close_group, current_group

    group = current_group()
    if group is None:
        return
    held = RESIDENTS.get_any()
    if isinstance(held, TrainerState) and held.policy.ranks is group:
        RESIDENTS.clear()
    close_group()


def problems_of_run(store: str, cfg: RunConfigBase, config_id: str) -> str:
    """The run's problems: synthesized now, or those a data run made (`rlvr run --data RUN_ID`)."""
    from rlvr.flows.data_run import synthesized_problems

    if cfg.data is None:
        return require_problems(open_store(store), synthesized_problems(store, cfg, config_id), str(cfg.run_id))
    return data_run_problems(open_store(store), cfg.data)


def _keep_newest_train_state(store_root: str, run_id: str, policy_ref: str) -> None:
    """A crash between a train_state commit and the delete of the previous one can leave an extra."""
    from rlvr.trainer.checkpoints import weights_artifact

    store = open_store(store_root)
    keep = weights_artifact(store, policy_ref) if store.manifest(policy_ref).kind == "train_steps" else ""
    prune_transient(store, "train_state", run_id, keep)
