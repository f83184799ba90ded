"""The RL steps of a subflow (`rl_steps`): one after another, or with flow.async_level k each sampled by the policy
entering the step k before, beside the trainer: on a worker thread (flow.sampler=thread) or in the run's sampler
process (flow.sampler=process, `SamplingServer`). `Lag` says which policy samples which step."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

from prefect import flow

from rlvr.flows.config import RunConfigBase, config_from_json
from rlvr.flows.executors import use_executor
from rlvr.flows.rl_step import (
    Generated,
    Sampler,
    StepRefs,
    after_step,
    generate,
    rl_generate,
    rl_step,
    rl_train,
    update_state,
)
from rlvr.flows.sampler_process import WorkerProcess
from rlvr.flows.stages import run_context, stages_in_place
from rlvr.progress import listen, report
from rlvr.storage.leases import Lease
from rlvr.storage.store import open_store
from rlvr.trainer.checkpoints import keep_snapshots
from rlvr.trainer.policy import set_threads


@flow(name="rl-steps", validate_parameters=False)
def rl_steps(store: str, cfg: RunConfigBase, first: int, last: int, refs: StepRefs) -> StepRefs:
    """RL steps first..last; returns the refs after the last one."""
    if cfg.flow.async_level:
        return _async_steps(store, cfg, first, last, refs)
    for step in range(first, last + 1):
        refs, metrics = rl_step(store, cfg, step, refs)
        after_step(store, cfg, step, refs, metrics)
    return refs


class Lag:
    """Which policy samples which step under flow.async_level k: step s's rollouts are sampled by the policy
    entering step max(first known, s - k). `entering[j]` is the policy entering step j, kept while a sampler
    may still read it."""

    def __init__(self, k: int, first: int, refs: StepRefs) -> None:
        self.k = k
        self.entering = dict(enumerate((*refs.earlier, refs.policy_ref), start=first - len(refs.earlier)))

    def sampler(self, step: int) -> Sampler | None:
        """Who samples `step`; None while its policy is not trained yet."""
        source = max(min(self.entering), step - self.k)
        ref = self.entering.get(source)
        return None if ref is None else Sampler(ref, step - source)

    def trained(self, step: int, policy_ref: str) -> tuple[str, ...]:
        """Record the policy step `step` trained; returns the policies entering the k steps up to it, oldest
        first (`StepRefs.earlier`, what the next subflow's samplers may read)."""
        self.entering[step + 1] = policy_ref
        self.entering = {j: ref for j, ref in self.entering.items() if j >= step + 1 - self.k}
        return tuple(self.entering[j] for j in sorted(self.entering) if j <= step)


def _async_steps(store: str, cfg: RunConfigBase, first: int, last: int, refs: StepRefs) -> StepRefs:
    """Steps first..last with flow.async_level k: step s's rollouts are sampled by the policy entering step
    max(1, s - k) while earlier steps train.

    Every decision is a stage of its own with committed inputs (the sampling policy is an input of the
    rollout stage, the selection state one of select's), so a resumed run recomputes the same ids and
    redoes exactly the work that was not committed, whichever way sampling runs (`flow.sampler`)."""
    lag = Lag(cfg.flow.async_level, first, refs)
    if cfg.flow.sampler == "process":
        return _process_steps(store, cfg, first, last, refs, lag)
    return _thread_steps(store, cfg, first, last, refs, lag)


def _thread_steps(store: str, cfg: RunConfigBase, first: int, last: int, refs: StepRefs, lag: Lag) -> StepRefs:
    """flow.sampler=thread: one step sampled on a Prefect worker thread while the step before trains (at most
    one ahead: a step's selection needs the state its predecessor's outcomes left). The sampler reads a
    private copy of its policy (`keep_snapshots`), made here before the trainer takes the live one."""

    def submit(step: int, at_refs: StepRefs) -> Any:
        sampler = lag.sampler(step)
        assert sampler is not None, "one step ahead, a step's sampling policy is always trained"
        return rl_generate.submit(store, cfg, step, at_refs, sampler)

    keep_snapshots({_sampler_ref(lag, first)})
    sampled = refs
    pending = submit(first, sampled)
    for step in range(first, last + 1):
        made, state = pending.result()
        sampled = replace(
            sampled, state=state, rewards=tuple(made.rewards), filter_state=made.filter_state(sampled.filter_state)
        )
        # before the trainer takes it: the policy the next step samples with, copied (the next subflow's too)
        keep_snapshots({_sampler_ref(lag, step + 1)} if step < cfg.train.steps else set())
        if step < last:
            pending = submit(step + 1, sampled)
        refs = _trained_step(store, cfg, step, refs, made, state, lag)
    return refs


def _sampler_ref(lag: Lag, step: int) -> str:
    sampler = lag.sampler(step)
    assert sampler is not None
    return sampler.policy_ref


def _process_steps(store: str, cfg: RunConfigBase, first: int, last: int, refs: StepRefs, lag: Lag) -> StepRefs:
    """flow.sampler=process: the run's sampler process gets every step whose sampling policy is trained, so
    with k > 1 it runs up to k steps ahead; it carries the selection state from one step to the next itself,
    and waits for each policy's commit before it loads it from the store."""
    worker = sampler_worker(store, cfg)
    queued = first

    def queue() -> None:
        nonlocal queued
        while queued <= last and (sampler := lag.sampler(queued)) is not None:
            worker.submit(SampleJob(queued, refs if queued == first else None, sampler))
            queued += 1

    queue()
    for step in range(first, last + 1):
        made, state, events = worker.result()
        for event, fields in events:  # the warnings the sampler's stages gave, for this process's listeners
            report(event, **fields)
        open_store(store).await_committed(state)  # the step's last artifact: its group is on disk
        refs = _trained_step(store, cfg, step, refs, made, state, lag, after=queue)
    return refs


def _trained_step(
    store: str,
    cfg: RunConfigBase,
    step: int,
    refs: StepRefs,
    made: Generated,
    state: str,
    lag: Lag,
    after: Callable[[], None] | None = None,
) -> StepRefs:
    """Train step `step` on `made`, then its progress, evaluation and checkpoint; returns the next step's refs.
    `after` runs between the update and the evaluation (the process sampler queues the steps it unblocked)."""
    policy_ref, metrics = rl_train(store, cfg, step, refs, made)
    earlier = lag.trained(step, policy_ref)
    filter_state = made.filter_state(refs.filter_state)
    refs = replace(
        refs,
        policy_ref=policy_ref,
        state=state,
        rewards=tuple(made.rewards),
        earlier=earlier,
        filter_state=filter_state,
    )
    if after is not None:
        after()
    after_step(store, cfg, step, refs, metrics)
    return refs


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
