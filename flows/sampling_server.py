"""The run's sampler process under flow.sampler=process: `SamplingServer` is what that process runs (in
flows/sampler_process.py's worker), `sampler_worker` starts it for a run.

Nothing this module imports imports Prefect: the process runs its stages in place, without Prefect runs, so the
fresh interpreter that imports torch and transformers to sample does not import Prefect as well (about 1.7
CPU-s of every async run's start; tests/test_sampler_process.py holds it to that)."""

from __future__ import annotations

import math
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

from rlvr.flows.config import RunConfigBase, config_from_json
from rlvr.flows.executors import use_executor
from rlvr.flows.rl_step import Generated, Sampler, StepRefs, generate, update_state
from rlvr.flows.sampler_process import WorkerProcess
from rlvr.flows.stages import run_context, stages_in_place
from rlvr.progress import listen
from rlvr.storage.leases import Lease
from rlvr.storage.store import open_store
from rlvr.trainer.policy import set_threads


@dataclass(frozen=True)
class SampleJob:
    """One step for the sampler process: `refs` None goes on from the state its previous job left."""

    step: int
    refs: StepRefs | None
    sampler: Sampler


class SamplingServer:
    """The sampler process's side (flow.sampler=process): the sampling half of each step, with the stages run
    in place (this process has no Prefect run) on the run's executor. Each step's artifacts commit as one
    group in the background while the next step samples; the trainer waits for the group's last artifact
    (the selection state) before it reads them. `lease`: the number of the run's lease the run's process holds;
    each of this process's commits checks that it is still the newest (storage/leases.py)."""

    def __init__(self, store: str, cfg_json: str, lease: int | None = None) -> None:
        self.store, self.cfg = store, config_from_json(cfg_json)
        if lease is not None:
            run_id, the_store = str(self.cfg.run_id), open_store(store)
            # No heartbeat of its own (the run's process sends it): its commits' listings are its checks.
            the_store.hold(run_id, Lease(the_store, run_id, lease, fresh_s=math.inf))
        self.refs: StepRefs | None = None
        self.events: list[tuple[str, dict[str, Any]]] = []
        listen(lambda event, fields: self.events.append((event, fields)))
        self._scope = ExitStack()
        self._scope.enter_context(use_executor(self.cfg.flow.executor, store))
        self._scope.enter_context(stages_in_place())
        set_threads(self.cfg.policy.threads)

    def __call__(self, job: SampleJob) -> tuple[Generated, str, list[tuple[str, dict[str, Any]]]]:
        refs = job.refs or self.refs
        assert refs is not None, "a sampler's first job carries the step's refs"
        the_store = open_store(self.store)
        the_store.await_committed(job.sampler.policy_ref)  # the trainer commits it in the background
        with the_store.batch(background=True):
            at = run_context(self.store, self.cfg, job.step)
            made = generate(at, self.cfg, refs, job.sampler)
            state = update_state(at, self.cfg, refs, made).id
        self.refs = replace(
            refs, state=state, rewards=tuple(made.rewards), filter_state=made.filter_state(refs.filter_state)
        )
        events, self.events = self.events, []
        return made, state, events

    def close(self) -> None:
        """The last groups on disk before the process ends."""
        open_store(self.store).wait()
        self._scope.close()


_workers: dict[tuple[str, str], WorkerProcess] = {}


def sampler_worker(store: str, cfg: RunConfigBase) -> WorkerProcess:
    """The run's sampler process, started on first use; `_whole_run` stops it when the run ends."""
    key = (store, str(cfg.run_id))
    if key not in _workers:
        lease = open_store(store).lease_number(str(cfg.run_id))
        _workers[key] = WorkerProcess(SamplingServer, (store, cfg.model_dump_json(), lease), name="rlvr-sampler")
    return _workers[key]


def stop_sampler_worker(store: str, cfg: RunConfigBase) -> None:
    worker = _workers.pop((store, str(cfg.run_id)), None)
    if worker is not None:
        worker.close()
