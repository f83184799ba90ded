"""Stages as Prefect tasks: the runner (storage/stage.py) wrapped once for every stage.

`run` makes a stage run its own Prefect task run when the flow calls it directly (the data stages,
evaluations, checkpoints), and runs it in place when it is already inside a task run (the stages of
one RL step share the step's task: a Prefect task run costs about 4 ms and a share of the embedded
server's CPU, which on the default step would be a tenth of the step per stage). Either way every
stage run is a row of the `stage_runs` view with its timings.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from rlvr.storage.stage import InputRef, Stage, StageRun, run_stage
from rlvr.storage.store import open_store


@dataclass(frozen=True)
class RunContext:
    """Where and for which run a stage runs: the store root, the run's id and seed, and its RL step (None for
    the stages outside the steps). Roots rather than Store objects, so a context crosses to other workers."""

    store: str
    run_id: str
    seed: int = 0
    step: int | None = None

    def at_step(self, step: int | None) -> RunContext:
        return replace(self, step=step)


def run_context(store: str, cfg: Any, step: int | None = None) -> RunContext:
    """The context of run `cfg` (its id and seed) on the store at `store`, at `step`."""
    assert cfg.run_id is not None, "the run id is resolved before any stage runs"
    return RunContext(store, str(cfg.run_id), int(cfg.seed), step)


def step_of(at: RunContext) -> int:
    """The RL step of a context inside the steps."""
    assert at.step is not None, "a context inside an RL step has its step"
    return at.step


def run(
    stage: Stage[Any],
    cfg: Any,
    at: RunContext,
    *,
    inputs: Mapping[str, InputRef] | None = None,
    params: Mapping[str, Any] | None = None,
) -> StageRun:
    """Run `stage` through the runner (skipped when committed), as a Prefect task unless inside one (or in a
    process that runs stages in place, `stages_in_place`)."""
    if _in_place.get() or _in_task_run():
        store = open_store(at.store)
        return run_stage(store, stage, cfg, run_id=at.run_id, seed=at.seed, step=at.step, inputs=inputs, params=params)
    _stages[stage.name] = stage
    task = _task_of(stage.name)
    return task(at.store, stage.name, cfg, at.run_id, at.seed, at.step, dict(inputs or {}), dict(params or {}))


def _in_task_run() -> bool:
    from prefect.context import TaskRunContext  # here: a process that runs its stages in place never imports Prefect

    return TaskRunContext.get() is not None


_stages: dict[str, Stage[Any]] = {}
_in_place: ContextVar[bool] = ContextVar("stages_in_place", default=False)


@contextmanager
def stages_in_place() -> Iterator[None]:
    """Every `run` in the block (in this thread) runs its stage in place, without a Prefect task run: for a
    worker process that does stages for a flow in another process (flow.sampler=process) and has no Prefect
    run of its own. The stage runs are rows of the `stage_runs` view as any other."""
    token = _in_place.set(True)
    try:
        yield
    finally:
        _in_place.reset(token)


@cache
def _task_of(name: str) -> Any:
    """One Prefect task per stage name (the task run's name in the UI is the stage's)."""
    from prefect import task
    from prefect.cache_policies import NONE

    def run_as_task(
        store: str,
        stage_name: str,
        cfg: Any,
        run_id: str,
        seed: int,
        step: int | None,
        inputs: dict[str, InputRef],
        params: dict[str, Any],
    ) -> StageRun:
        return run_stage(
            open_store(store),
            _stages[stage_name],
            cfg,
            run_id=run_id,
            seed=seed,
            step=step,
            inputs=inputs,
            params=params,
        )

    return task(name=name, cache_policy=NONE)(run_as_task)
