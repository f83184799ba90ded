"""The RL steps of a subflow (`rl_steps`): one after another, or with flow.async_level k each sampled by the policy
entering the step k before, beside the trainer: on a worker thread (flow.sampler=thread) or in the run's sampler
process (flow.sampler=process, flows/sampling_server.py). `Lag` says which policy samples which step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NONE

from rlvr.flows.config import RunConfigBase
from rlvr.flows.rl_step import Generated, Sampler, StepRefs, after_step, generate_ahead, rl_train, run_step
from rlvr.flows.sampling_server import SampleJob, sampler_worker
from rlvr.progress import report
from rlvr.storage.store import open_store
from rlvr.trainer.checkpoints import keep_snapshots

# The steps' Prefect tasks (rl_step.py, where their bodies live, imports no Prefect: the sampler process imports it)
rl_step = task(name="rl-step", cache_policy=NONE)(run_step)
rl_generate = task(name="rl-generate", cache_policy=NONE)(generate_ahead)


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
