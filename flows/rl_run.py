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
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
from prefect import flow, task
from prefect.cache_policies import NONE

from rlvr.curricula.filtering import prompts_to_draw
from rlvr.curricula.hints import solutions_of
from rlvr.endpoints import rate_of
from rlvr.environments.registry import check_environment, environment_label
from rlvr.errors import UserError
from rlvr.flows.compatibility import refuse_incompatible
from rlvr.flows.config import (
    RunConfigBase,
    commit_config,
    config_from_json,
    data_run_problems,
    engine_param,
    require_problems,
)
from rlvr.flows.data_run import estimate_difficulty, initial_policy, synthesized_problems
from rlvr.flows.executors import current_fan_out, use_executor
from rlvr.flows.sampler_process import WorkerProcess
from rlvr.flows.stages import RunContext, run, run_context, stages_in_place, step_of
from rlvr.progress import listen, report
from rlvr.storage.leases import Lease
from rlvr.storage.stage import RESIDENTS, TABLES, prune_transient
from rlvr.storage.store import open_store
from rlvr.tasks.allocate import ALLOCATE
from rlvr.tasks.checkpoint import CHECKPOINT
from rlvr.tasks.evaluate import EVALUATE
from rlvr.tasks.filter import FILTER
from rlvr.tasks.label import LABEL
from rlvr.tasks.restructure import RESTRUCTURE
from rlvr.tasks.rlpr import RLPR
from rlvr.tasks.rlpr_debias import RLPR_DEBIAS
from rlvr.tasks.rollout import ROLLOUT
from rlvr.tasks.select import SELECT
from rlvr.tasks.train import TRAIN
from rlvr.tasks.update import UPDATE
from rlvr.tasks.warmstart import WARMSTART
from rlvr.trainer.checkpoints import Ranks, TrainerState, keep_snapshots, take_trainer_state, weights_artifact
from rlvr.trainer.devices import own_stream, resolve_device
from rlvr.trainer.policy import set_threads
from rlvr.trainer.rank_group import close_group, current_group
from rlvr.verifiers.cache import MODEL_VERIFIERS
from rlvr.verifiers.model_rewards import endpoint_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRefs:
    """What one RL step hands the next (artifact ids): the problem pool (the synthesized problems, then
    the rewrites CLPO kept), their difficulty, the policy to sample and train (`policy_ref`), the policy
    RL started from (the KL reference), the selection strategy's state, the step's rewards (every
    round: the outcome buffers of the next allocation), and the filter's last decision (with filter.std, the
    state of RLPR's std filter)."""

    problems: tuple[str, ...]
    difficulty: str
    policy_ref: str
    start_ref: str
    state: str | None = None
    rewards: tuple[str, ...] = ()
    earlier: tuple[str, ...] = ()  # with flow.async_level k: the policies entering the k steps before, oldest first
    filter_state: str | None = None


@dataclass
class Generated:
    """A step's rounds (one, or more with dynamic sampling's refills) and the filter's last decision."""

    selections: list[str] = field(default_factory=list)
    rollouts: list[str] = field(default_factory=list)
    rewards: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    debias: list[str] = field(default_factory=list)  # label.reward=rlpr: the rounds' debiasing terms
    drawn: int = 0  # the slots the rounds used (the next free slot)

    def filter_state(self, before: str | None) -> str | None:
        """The filter state the next step starts from: the last round's decision, or `before` without a filter."""
        return self.groups[-1] if self.groups else before


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
    rewrite_slots = cfg.restructure.rewrite_slots(cfg.select.batch_size)
    made = _generate(at, cfg, refs, batch_size=cfg.select.batch_size - rewrite_slots)
    restructured = _restructure(at, cfg, refs, made, rewrite_slots) if cfg.restructure.enabled else None
    training = made
    if rewrite_slots and restructured is not None:  # CLPO, same step: the kept rewrites' groups train too
        training = replace(
            made, rollouts=[*made.rollouts, restructured["rollouts"]], rewards=[*made.rewards, restructured["rewards"]]
        )
    trained = _train(at, cfg, refs, training, restructured)
    updated = _update_state(at, cfg, refs, made)
    problems = refs.problems
    if restructured is not None and restructured.manifest(open_store(store), "restructured").extra["kept"]:
        problems = (*problems, restructured["problems"])
    metrics = trained.table(open_store(store), "train_steps").to_pylist()[0]
    next_refs = replace(
        refs,
        problems=problems,
        policy_ref=trained["train_steps"],
        state=updated.id,
        rewards=tuple(training.rewards),
        filter_state=made.filter_state(refs.filter_state),
    )
    return next_refs, metrics


def _restructure(at: RunContext, cfg: RunConfigBase, refs: StepRefs, made: Generated, rewrite_slots: int) -> Any:
    """CLPO's restructure stage on the step's rounds; with join same_step, the `rewrite_slots` slots after
    the drawn ones are its rewrites'."""
    same_step = {"slots": rewrite_slots, "first_slot": made.drawn, "n": cfg.allocate.n} if rewrite_slots else {}
    return run(
        RESTRUCTURE,
        cfg.restructure,
        at,
        inputs={
            "problems": refs.problems,
            "rollouts": made.rollouts,
            "rewards": made.rewards,
            "policy": refs.policy_ref,
        },
        params={
            "verifier": cfg.label,
            "rollout": cfg.rollout,
            "sources": cfg.synthesize.sources,
            "device": cfg.policy.device,
            **same_step,
        },
    )


def _train(at: RunContext, cfg: RunConfigBase, refs: StepRefs, made: Generated, restructured: Any = None) -> Any:
    """The train stage on the step's rounds: one update of `refs.policy_ref` (with flow.async_level k, its
    stored state keeps the last k policies' too: a resumed sampler reads them)."""
    behind = {"samplers_behind": cfg.flow.async_level} if cfg.flow.async_level else {}
    reference = refs.start_ref if cfg.train.grpo.kl_beta > 0 else None
    return run(
        TRAIN,
        cfg.train,
        at,
        inputs={
            "rollouts": made.rollouts,
            "rewards": made.rewards,
            "policy": refs.policy_ref,
            "groups": made.groups,
            "restructured": restructured["restructured"] if restructured else None,
            "reference": reference,
        },
        params={"device": cfg.policy.device, **behind},
    )


def _update_state(at: RunContext, cfg: RunConfigBase, refs: StepRefs, made: Generated) -> Any:
    """The selection strategy's state after the step's outcomes (the update stage)."""
    return run(
        UPDATE,
        cfg.select,
        at,
        inputs={
            "state": refs.state,
            "problems": refs.problems,
            "difficulty": refs.difficulty,
            "selections": made.selections,
            "rollouts": made.rollouts,
            "rewards": made.rewards,
        },
        params={"advantage_scale": cfg.train.grpo.advantage_scale},
    )


@dataclass(frozen=True)
class Sampler:
    """With flow.async_level: the policy that samples a step's rollouts and how many steps it is behind."""

    policy_ref: str
    staleness: int


def _generate(
    at: RunContext, cfg: RunConfigBase, refs: StepRefs, sampler: Sampler | None = None, batch_size: int | None = None
) -> Generated:
    """select -> allocate -> rollout -> label; with dynamic sampling, filter after each round and refill
    with new prompts until the batch has enough groups with reward variance or the refills run out.
    `sampler`: sample with that policy, beside the trainer, storing the log-probs it gives (flow.async_level).
    `batch_size`: the groups to draw when fewer than select.batch_size (CLPO's rewrites take the rest)."""
    made, drawn, refills = Generated(), 0, 0
    batch = batch_size or cfg.select.batch_size
    policy, sampling = refs.policy_ref, dict[str, Any](device=cfg.policy.device)
    if sampler is not None:
        behaviour = cfg.train.grpo.model_dump(include={"temperature", "autocast", "micro_batch_tokens"})
        policy = sampler.policy_ref
        sampling = {**sampling, "behaviour": behaviour, "staleness": sampler.staleness, "logprobs": "sampling"}
    count = prompts_to_draw(batch, cfg.filter)
    while True:
        rounds = {"round": refills, "count": count, "first_slot": drawn} if cfg.filter.enabled else {}
        if batch != cfg.select.batch_size and not cfg.filter.enabled:
            rounds = {"count": count}
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
        rollouts = _rollout(at, cfg, refs.problems, selections.id, allocations.id, policy, sampling)
        rewards = _label(at, cfg, refs, made, rollouts.id, policy, beside_trainer=sampler is not None)
        made.selections.append(selections.id)
        made.rollouts.append(rollouts.id)
        made.rewards.append(rewards)
        made.drawn = drawn + count
        if not cfg.filter.enabled:
            return made
        groups = run(
            FILTER,
            cfg.filter,
            at,
            inputs={"rollouts": made.rollouts, "rewards": made.rewards, "state": _filter_state(cfg, refs)},
            params={"batch_size": batch, "refills_done": refills, "first_slot": drawn},
        )
        made.groups.append(groups.id)
        decision = groups.manifest(open_store(at.store)).extra
        if not decision["refill_prompts"]:
            if decision["limit_reached"]:
                _warn_refill_limit(cfg, step_of(at), decision["kept"])
            return made
        drawn, count, refills = drawn + count, decision["refill_prompts"], refills + 1


def _label(
    at: RunContext,
    cfg: RunConfigBase,
    refs: StepRefs,
    made: Generated,
    rollouts: str,
    policy: str,
    beside_trainer: bool,
) -> str:
    """A round's rewards: the verifiers' (label), or with label.reward=rlpr RLPR's (the rlpr stage, with `policy`,
    the one that sampled them). Its debiasing terms are computed once per problem and policy: with
    debias_with=start for the whole pool with the policy RL started from (rlpr_debias, committed at the first step
    and found after), else with `policy`, the step's later rounds reading the earlier rounds' terms."""
    if cfg.label.reward != "rlpr":
        # fan_out carries verify_chunk; the error threshold holds for every reward source, not only models'
        fanned = {"fan_out": current_fan_out(), "max_error_rate": cfg.reward.max_error_rate}
        labelled = run(LABEL, cfg.label, at, inputs={"rollouts": rollouts, "problems": refs.problems}, params=fanned)
        return labelled["rewards"]
    params: dict[str, Any] = {"device": cfg.policy.device, **({"beside_trainer": True} if beside_trainer else {})}
    debias_policy, known = policy, list(made.debias)
    if cfg.label.rlpr.debias_with == "start":
        debias_policy = refs.start_ref
        pool_inputs = {"problems": refs.problems[0], "policy": debias_policy}
        pool = run(
            RLPR_DEBIAS, cfg.label, at.at_step(None), inputs=pool_inputs, params={"splits": cfg.select.splits, **params}
        )
        known = [pool.id, *known]
    inputs = {
        "rollouts": rollouts,
        "problems": refs.problems,
        "policy": policy,
        "debias_policy": debias_policy,
        "debias": known,
    }
    result = run(RLPR, cfg.label, at, inputs=inputs, params=params)
    made.debias.append(result["rlpr_debias"])
    return result["rewards"]


def _filter_state(cfg: RunConfigBase, refs: StepRefs) -> str | None:
    """The filter's state input: with filter.std, the decision the step before left (None otherwise, so runs without
    it keep their ids)."""
    return refs.filter_state if cfg.filter.std is not None else None


def _rollout(
    at: RunContext,
    cfg: RunConfigBase,
    problems: tuple[str, ...],
    selections: str,
    allocations: str,
    policy: str,
    sampling: dict[str, Any],
) -> Any:
    """The rollout stage of a round; with GHPO's hints it reads the selections (their hint ratios) too."""
    hinted = cfg.select.hints.enabled
    params = {**sampling, "hints": cfg.select.hints.model_dump()} if hinted else dict(sampling)
    params.update(env_params(cfg))
    return run(
        ROLLOUT,
        cfg.rollout,
        at,
        inputs={
            "allocations": allocations,
            "problems": problems,
            "policy": policy,
            "selections": selections if hinted else None,
        },
        params=params,
    )


def env_params(cfg: RunConfigBase) -> dict[str, Any]:
    """The run's environment for the stages that play episodes (rollout, evaluate): its config and its
    "name@version" (a new version samples again); nothing for one turn, the default, so ids stay those of runs
    from before environments."""
    if not cfg.env.multi_turn:
        return {}
    return {"env": cfg.env.model_dump(mode="json"), "environment": environment_label(cfg.env)}


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
    params = {
        "phase": phase,
        "verifier": cfg.label,
        "device": cfg.policy.device,
        "max_error_rate": cfg.reward.max_error_rate,
        **engine_param(cfg),
        **env_params(cfg),
    }
    result = run(EVALUATE, cfg.evaluate, run_context(store, cfg, step), inputs=inputs, params=params)
    return float(result.table(open_store(store)).column("accuracy")[0].as_py())


@flow(name="rl-steps", validate_parameters=False)
def rl_steps(store: str, cfg: RunConfigBase, first: int, last: int, refs: StepRefs) -> StepRefs:
    """RL steps first..last; returns the refs after the last one."""
    if cfg.flow.async_level:
        return _async_steps(store, cfg, first, last, refs)
    for step in range(first, last + 1):
        refs, metrics = rl_step(store, cfg, step, refs)
        _after_step(store, cfg, step, refs, metrics)
    return refs


def _after_step(store: str, cfg: RunConfigBase, step: int, refs: StepRefs, metrics: dict[str, Any]) -> None:
    """Progress, and the evaluation and checkpoint a step may have."""
    report("step", step=step, reward=metrics["mean_reward"])
    final = step == cfg.train.steps
    if step % cfg.evaluate.every == 0 or final:
        report("eval", step=step, accuracy=evaluate(store, cfg, step, "rl", refs))
    if step % cfg.checkpoint.every == 0 or final:
        run(CHECKPOINT, cfg.checkpoint, run_context(store, cfg, step), inputs={"policy": refs.policy_ref})


@task(name="rl-generate", cache_policy=NONE)
def rl_generate(store: str, cfg: RunConfigBase, step: int, refs: StepRefs, sampler: Sampler) -> tuple[Generated, str]:
    """The sampling half of a step under flow.async_level with flow.sampler=thread, on a worker thread beside
    the trainer: its rounds (sampled by `sampler`) and the selection state after their outcomes, committed
    as one group. On a GPU its kernels go to a stream of their own (`own_stream`), beside the trainer's."""
    with own_stream(resolve_device(cfg.policy.device)), open_store(store).batch(background=True):
        at = run_context(store, cfg, step)
        made = _generate(at, cfg, refs, sampler)
        return made, _update_state(at, cfg, refs, made).id


def rl_train(store: str, cfg: RunConfigBase, step: int, refs: StepRefs, made: Generated) -> tuple[str, dict[str, Any]]:
    """The training half of a step under flow.async_level: the update on rounds an earlier policy sampled.

    Its stages run in place in the steps' subflow, as the sampler's do, rather than in a Prefect task run of
    their own: at the TRL benchmark's shape a task run a step kept the embedded Prefect server busy for half a
    core (~37 ms of its CPU a step), which the sampler and the trainer need (docs/training.md)."""
    with stages_in_place(), open_store(store).batch(background=True):
        trained = _train(run_context(store, cfg, step), cfg, refs, made)
        return trained["train_steps"], trained.table(open_store(store), "train_steps").to_pylist()[0]


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
    _after_step(store, cfg, step, refs, metrics)
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
            made = _generate(at, self.cfg, refs, job.sampler)
            state = _update_state(at, self.cfg, refs, made).id
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


@flow(name="rl-run", validate_parameters=False)
def rl_run(store: str, cfg: RunConfigBase) -> dict[str, Any]:
    """The whole run; returns the ids a summary needs. Stages fan their units out on `flow.executor`."""
    with use_executor(cfg.flow.executor, store):
        return _whole_run(store, cfg)


def _whole_run(store: str, cfg: RunConfigBase) -> dict[str, Any]:
    assert cfg.run_id is not None
    refuse_incompatible(cfg)  # a config made in Python, not loaded: its combinations and env keys too, before any work
    check_environment(cfg.env)
    check_async(cfg, store)
    check_clpo(cfg)
    config_id = commit_config(open_store(store), cfg)
    problems = problems_of_run(store, cfg, config_id)
    _warn_without_solutions(store, cfg, problems)
    announce_model_calls(store, cfg, problems)
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
    if cfg.train.data_parallel > 1:  # from here on the ranks sample too: difficulty, rollouts, evaluations
        share_policy(store, cfg, refs.policy_ref)
    refs = replace(refs, difficulty=estimate_difficulty(store, cfg, problems, refs.policy_ref))
    report("stage", name="rl")
    size = cfg.flow.steps_per_subflow
    try:
        for first in range(1, cfg.train.steps + 1, size):
            refs = rl_steps(store, cfg, first, min(first + size - 1, cfg.train.steps), refs)
    finally:
        stop_sampler_worker(store, cfg)
        if cfg.train.data_parallel > 1:
            end_rank_group()
    _keep_newest_train_state(store, cfg.run_id, refs.policy_ref)
    open_store(store).wait()
    return {"run_id": cfg.run_id, "config_id": config_id, "problems_id": problems, "policy_id": refs.policy_ref}


def share_policy(store: str, cfg: RunConfigBase, policy_ref: str) -> None:
    """With train.data_parallel > 1: the policy the RL steps start from, adopted by the run's rank group and kept
    in memory under its id, so that the difficulty estimate and the first step's rollouts are sampled on every
    rank as the later ones are."""
    ranks = Ranks(cfg.train.data_parallel, cfg.train.sharding)
    grpo, device = cfg.train.grpo, resolve_device(cfg.policy.device)
    state = take_trainer_state(open_store(store), policy_ref, grpo.lr, grpo.weight_decay, device=device, ranks=ranks)
    RESIDENTS.keep(policy_ref, state)


def end_rank_group() -> None:
    """Stop the run's data-parallel ranks, and forget the policy they held (a sharded model is no use without them)."""
    group = current_group()
    if group is None:
        return
    held = RESIDENTS.get_any()
    if isinstance(held, TrainerState) and held.policy.ranks is group:
        RESIDENTS.clear()
    close_group()


def _warn_without_solutions(store: str, cfg: RunConfigBase, problems: str) -> None:
    """GHPO's hints come from the problems' solutions: say so when they have none (the run goes on unhinted)."""
    if not cfg.select.hints.enabled:
        return
    table = TABLES.get(open_store(store), problems)
    if not solutions_of(table):
        message = (
            f"select.hints is on but none of the run's {table.num_rows} problems has a solution with a step before "
            "the one that states its answer, so no hint will be given (sources give one through a `solution` "
            "column or a worked reference: docs/data.md)"
        )
        log.warning(message)
        report("warning", message=message)


def planned_model_calls(cfg: RunConfigBase, problems: pa.Table) -> dict[str, dict[str, int]]:
    """For each model that scores some of the run's problems (a judge, a reward model), how many verdicts each part
    of the run asks of it at most: the evaluations (the held-out split, at each), the difficulty pass (k a problem)
    and the steps' labels (the rollouts a step samples, in the model's share of the training problems)."""
    rows = problems.select(["verifier", "split"]).to_pylist()
    evaluations = 1 + (1 if cfg.warmstart.steps else 0) + -(-cfg.train.steps // cfg.evaluate.every)
    planned: dict[str, dict[str, int]] = {}
    for name in sorted(MODEL_VERIFIERS):
        mine = [r["split"] for r in rows if cfg.label.verifier_of(r["verifier"]) == name]
        if not mine:
            continue
        trained = [split for split in mine if split in cfg.select.splits]
        pool = sum(1 for r in rows if r["split"] in cfg.select.splits) or 1
        per_step = cfg.select.batch_size * cfg.allocate.n * len(trained) / pool
        planned[name] = {
            "evaluations": evaluations * mine.count(cfg.evaluate.split),
            "difficulty": cfg.difficulty.k * sum(split in cfg.difficulty.splits for split in mine),
            "steps": round(cfg.train.steps * per_step),
        }
    return planned


def announce_model_calls(store: str, cfg: RunConfigBase, problems: str) -> None:
    """Before a run asks a model for its rewards, say how many verdicts it will ask for (a warning line), and plan the
    endpoint's measured rate for them: its first calls then give the estimate of the whole run's (rlvr/endpoints.py)."""
    if cfg.label.reward == "rlpr":
        return
    for name, parts in planned_model_calls(cfg, TABLES.get(open_store(store), problems)).items():
        if cfg.label.endpoint_version(name) is None:
            continue  # no endpoint: the label stage refuses in one line
        total = sum(parts.values())
        endpoint = endpoint_of(cfg.label, name)
        sample = 2 * cfg.label.judge.concurrency if name == "judge" and cfg.label.judge is not None else 1
        rate_of(endpoint).plan("this run", total, sample)
        split = ", ".join(f"{part} {calls:,}" for part, calls in parts.items())
        message = f"this run will ask {endpoint} for up to {total:,} verdicts ({split}; cached ones are not asked)"
        log.warning(message)
        report("warning", message=message)


def check_clpo(cfg: RunConfigBase) -> None:
    """restructure.join same_step needs prompts left for the drawn groups, as a one-line error before any work."""
    slots = cfg.restructure.rewrite_slots(cfg.select.batch_size)
    if slots and slots >= cfg.select.batch_size:
        raise UserError(
            f"restructure.join=same_step keeps {slots} of select.batch_size={cfg.select.batch_size} prompts for "
            "rewrites, leaving none to draw; raise select.batch_size or lower restructure.share"
        )


def check_async(cfg: RunConfigBase, store: str = "") -> None:
    """flow.async_level's limit that depends on the store, as a one-line error before any work (what it does not
    combine with in the config is refused when the config is loaded: flows/compatibility.py)."""
    if not cfg.flow.async_level:
        return
    if cfg.flow.sampler == "process" and store.startswith("memory://"):
        raise UserError(
            f"flow.sampler=process needs a store another process can open; {store} lives in this process's "
            "memory: use a local path or an object-store URL, or set flow.sampler=thread"
        )


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
