"""The data stages alone as a Prefect flow (`rlvr data`): config -> synthesize [-> initialize] [-> difficulty].

A data run is a run like any other (its own run id, config artifact and run record), so its problems
can be queried, exported (`rlvr export`) and trained on later (`rlvr run --data RUN_ID`). Synthesis
(per source) and difficulty estimation (per shard) fan out on the run's `flow.executor`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from rlvr.flows.config import RunConfigBase, commit_config, engine_param
from rlvr.flows.executors import current_fan_out, use_executor
from rlvr.flows.stages import run, run_context
from rlvr.progress import report
from rlvr.storage.store import open_store
from rlvr.tasks.difficulty import DIFFICULTY, DIFFICULTY_FROM_LABELS
from rlvr.tasks.initialize import INITIALIZE
from rlvr.tasks.synthesize import SYNTHESIZE
from rlvr.trainer.checkpoints import require_policy

INIT_POLICY = "init"  # `--policy init`: the run's own starting policy (`policy` section), built or loaded


@flow(name="data-run", validate_parameters=False)
def data_run(store: str, cfg: RunConfigBase, policy: str | None) -> dict[str, Any]:
    """Synthesize the problems and, given a policy (a checkpoint id or "init"), estimate their difficulty."""
    with use_executor(cfg.flow.executor, store):
        return _data_stages(store, cfg, policy)


def _data_stages(store: str, cfg: RunConfigBase, policy: str | None) -> dict[str, Any]:
    assert cfg.run_id is not None
    config_id = commit_config(open_store(store), cfg)
    problems = synthesized_problems(store, cfg, config_id)
    result: dict[str, Any] = {"run_id": cfg.run_id, "config_id": config_id, "problems_id": problems}
    if policy is not None:
        if policy == INIT_POLICY:
            policy = initial_policy(store, cfg, config_id)
        result["difficulty_id"] = estimate_difficulty(store, cfg, problems, policy)
    open_store(store).wait()
    return result


def synthesized_problems(store: str, cfg: RunConfigBase, config_id: str) -> str:
    """The `problems` artifact of the run's sources (`synthesize`, one unit per source on the executor)."""
    report("stage", name="synthesize")
    params = {"fan_out": current_fan_out()}
    return run(SYNTHESIZE, cfg.synthesize, run_context(store, cfg), inputs={"config": config_id}, params=params)[
        "problems"
    ]


def initial_policy(store: str, cfg: RunConfigBase, config_id: str) -> str:
    """The run's starting policy as its step-0 checkpoint (`initialize`): built, loaded, or taken from
    `policy.checkpoint` (a checkpoint of an earlier run, or None). With data-parallel ranks a model directory's
    weights are copied a tensor at a time, and the ranks read their slices."""
    inputs = {"config": config_id, "checkpoint": cfg.policy.checkpoint}
    params = {"seed": cfg.seed, "ranks": cfg.train.data_parallel}  # the ranks read it by slices: never whole here
    return run(INITIALIZE, cfg.policy, run_context(store, cfg, 0), inputs=inputs, params=params).id


def estimate_difficulty(store: str, cfg: RunConfigBase, problems: str, policy: str) -> str:
    """A `difficulty` artifact of `problems` under `policy` (a checkpoints or train_steps artifact id)."""
    require_policy(open_store(store), policy, "policy")
    report("stage", name="difficulty")
    inputs = {"problems": problems, "policy": policy}
    params = {"verifier": cfg.label, "fan_out": current_fan_out(), "device": cfg.policy.device, **engine_param(cfg)}
    return run(DIFFICULTY, cfg.difficulty, run_context(store, cfg), inputs=inputs, params=params).id


@flow(name="difficulty", validate_parameters=False)
def difficulty_run(store: str, cfg: RunConfigBase, problems: str, policy: str | None) -> str:
    """`rlvr difficulty`: one more difficulty artifact of the run's problems, under another policy (or
    from the problems' metadata labels when `policy` is None)."""
    if policy is not None:
        with use_executor(cfg.flow.executor, store):
            return estimate_difficulty(store, cfg, problems, policy)
    return run(DIFFICULTY_FROM_LABELS, cfg.difficulty, run_context(store, cfg), inputs={"problems": problems}).id
