"""One RL step's stages: select -> allocate -> rollout -> label (or rlpr) [-> filter, and refill rounds of these
four] [-> restructure] -> train -> update, and the evaluation and checkpoint after it (`after_step`). `StepRefs`
is what a step hands the next. flows/step_loop.py runs the steps of a subflow, flows/rl_run.py the whole run."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from rlvr.curricula.filtering import prompts_to_draw
from rlvr.environments.registry import environment_label
from rlvr.flows.config import RunConfigBase, engine_param
from rlvr.flows.executors import current_fan_out
from rlvr.flows.stages import RunContext, run, run_context, stages_in_place, step_of
from rlvr.progress import report
from rlvr.storage.store import open_store
from rlvr.tasks.allocate import ALLOCATE
from rlvr.tasks.checkpoint import CHECKPOINT
from rlvr.tasks.evaluate import EVALUATE
from rlvr.tasks.filter import FILTER
from rlvr.tasks.label import LABEL
from rlvr.tasks.restructure import RESTRUCTURE
from rlvr.tasks.rlpr import RLPR, RLPR_DEBIAS
from rlvr.tasks.rollout import ROLLOUT
from rlvr.tasks.select import SELECT
from rlvr.tasks.train import TRAIN
from rlvr.tasks.update import UPDATE
from rlvr.trainer.devices import own_stream, resolve_device

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


def run_step(store: str, cfg: RunConfigBase, step: int, refs: StepRefs) -> tuple[StepRefs, dict[str, Any]]:
    """One RL step; returns the refs for the next step and the step's train_steps row.

    The step's artifacts are committed as one group (`Store.batch`), in the background while the next
    step computes; a kill redoes the steps not yet on disk.
    """
    with open_store(store).batch(background=True):
        return _step_stages(store, cfg, step, refs)


def _step_stages(store: str, cfg: RunConfigBase, step: int, refs: StepRefs) -> tuple[StepRefs, dict[str, Any]]:
    at = run_context(store, cfg, step)
    rewrite_slots = cfg.restructure.rewrite_slots(cfg.select.batch_size)
    made = generate(at, cfg, refs, batch_size=cfg.select.batch_size - rewrite_slots)
    restructured = _restructure(at, cfg, refs, made, rewrite_slots) if cfg.restructure.enabled else None
    training = made
    if rewrite_slots and restructured is not None:  # CLPO, same step: the kept rewrites' groups train too
        training = replace(
            made, rollouts=[*made.rollouts, restructured["rollouts"]], rewards=[*made.rewards, restructured["rewards"]]
        )
    trained = _train(at, cfg, refs, training, restructured)
    updated = update_state(at, cfg, refs, made)
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


def update_state(at: RunContext, cfg: RunConfigBase, refs: StepRefs, made: Generated) -> Any:
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


def generate(
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
    elif cfg.train.grpo.correction != "none":  # the sampler's own log-probs, for the correction to weigh against
        sampling = {**sampling, "logprobs": "sampling", "logprob_temperature": cfg.train.grpo.temperature}
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


def after_step(store: str, cfg: RunConfigBase, step: int, refs: StepRefs, metrics: dict[str, Any]) -> None:
    """Progress, and the evaluation and checkpoint a step may have."""
    report("step", step=step, reward=metrics["mean_reward"])
    final = step == cfg.train.steps
    if step % cfg.evaluate.every == 0 or final:
        report("eval", step=step, accuracy=evaluate(store, cfg, step, "rl", refs))
    if step % cfg.checkpoint.every == 0 or final:
        run(CHECKPOINT, cfg.checkpoint, run_context(store, cfg, step), inputs={"policy": refs.policy_ref})


def generate_ahead(
    store: str, cfg: RunConfigBase, step: int, refs: StepRefs, sampler: Sampler
) -> tuple[Generated, str]:
    """The sampling half of a step under flow.async_level with flow.sampler=thread, on a worker thread beside
    the trainer: its rounds (sampled by `sampler`) and the selection state after their outcomes, committed
    as one group. On a GPU its kernels go to a stream of their own (`own_stream`), beside the trainer's."""
    with own_stream(resolve_device(cfg.policy.device)), open_store(store).batch(background=True):
        at = run_context(store, cfg, step)
        made = generate(at, cfg, refs, sampler)
        return made, update_state(at, cfg, refs, made).id


def rl_train(store: str, cfg: RunConfigBase, step: int, refs: StepRefs, made: Generated) -> tuple[str, dict[str, Any]]:
    """The training half of a step under flow.async_level: the update on rounds an earlier policy sampled.

    Its stages run in place in the steps' subflow, as the sampler's do, rather than in a Prefect task run of
    their own: at the TRL benchmark's shape a task run a step kept the embedded Prefect server busy for half a
    core (~37 ms of its CPU a step), which the sampler and the trainer need (docs/training.md)."""
    with stages_in_place(), open_store(store).batch(background=True):
        trained = _train(run_context(store, cfg, step), cfg, refs, made)
        return trained["train_steps"], trained.table(open_store(store), "train_steps").to_pylist()[0]
