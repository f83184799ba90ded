"""allocate: how many rollouts each selected problem gets (`allocate.type`), under a total budget of
prompts x `allocate.n`; ragged groups allowed. Each row says why: the estimate used and where it came
from, its case, the allocator's value for the count, and whether a fallback placed it.

Estimates: a problem's outcome buffer (its last 16 outcomes in this run, valid from 8: solved or not, RLPR's
reward as it is, nothing for a row whose verdict failed; verifiers/outcomes.py) when valid, else
the difficulty stage's pass rate (unless Knapsack's `unknown` is "uniform": then none, as in the paper).
Buffers are kept in memory from step to step; a process that has not built them (a resumed run) rebuilds
them with one query over the run's rewards, so resume never depends on what a process remembered.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from rlvr.curricula.base import AllocateConfig, Estimate, Pick
from rlvr.curricula.buffers import BUFFER_LENGTH, OutcomeBuffers
from rlvr.curricula.registry import ALLOCATORS, make_allocator
from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.storage.store import Store
from rlvr.storage.views import data_paths, duckdb_connection, parquet_scan
from rlvr.verifiers.outcomes import OUTCOME_SQL, outcome


def build(inputs: Inputs, cfg: AllocateConfig, ctx: StageContext) -> Built:
    """Inputs: the step's selections, the difficulty stage's pass rates, and the previous step's rewards
    (every round of it; none at step 1)."""
    slots = inputs.rows("selections", ["slot", "problem_id", "arm", "probability"])
    stats = {r["problem_id"]: r for r in inputs.rows("difficulty", ["problem_id", "pass_rate", "k"])}
    columns = ["problem_id", "step", "rollout_id", "verifier", "status", "score"]
    previous = inputs.table("rewards", columns) if inputs.ids["rewards"] else None
    buffers = buffers_before(ctx.store, ctx.run_id, ctx.step or 1, previous)
    picks = [Pick(s["problem_id"], s["arm"], s["probability"]) for s in slots]
    prior = cfg.prior_for_unknown
    estimates = [
        buffers.estimate(s["problem_id"])
        or (difficulty_estimate(stats.get(s["problem_id"])) if prior else Estimate(None))
        for s in slots
    ]
    allocator = make_allocator(cfg)
    allocations = allocator.allocate(picks, estimates, total_budget=len(picks) * cfg.n)
    rows = [
        {
            "run_id": ctx.run_id,
            "step": ctx.step,
            "slot": s["slot"],
            "problem_id": s["problem_id"],
            "n_rollouts": a.n,
            "p_hat": e.p_hat,
            "p_hat_source": e.source,
            "buffer_count": len(buffers.outcomes(s["problem_id"])),
            "case": a.case,
            "value": a.value,
            "fallback": a.fallback,
            "allocator": allocator.type,
        }
        for s, e, a in zip(slots, estimates, allocations)
    ]
    return Built(rows_to_table("allocations", rows))


def difficulty_estimate(stat: dict[str, Any] | None) -> Estimate:
    """The difficulty stage's pass rate (k rollouts of the reference policy), when it estimated the problem."""
    if stat is None or stat["pass_rate"] is None:  # not estimated, or no sample of it got a verdict
        return Estimate(None)
    return Estimate(stat["pass_rate"], count=stat["k"], source="difficulty")


_kept: dict[tuple[str, str], tuple[int, OutcomeBuffers]] = {}  # (store, run) -> (last step included, buffers)


def buffers_before(store: Store | None, run_id: str, step: int, previous: pa.Table | None) -> OutcomeBuffers:
    """The outcome buffers of every reward of the run before `step` (outcomes ordered by step, rollout id).

    `previous` holds the rewards of step - 1: added to the buffers kept from the step before, or, in a
    process that kept none, the buffers are rebuilt from the store by `rebuild_buffers`.
    """
    if previous is None or step <= 1:
        return OutcomeBuffers()
    if store is None:  # a build tested on its own: the given rewards are the whole history
        return _with_outcomes(OutcomeBuffers(), previous)
    key = (store.root, run_id)
    kept_step, kept = _kept.get(key, (-1, OutcomeBuffers()))
    if kept_step == step - 1:
        return kept
    buffers = _with_outcomes(kept, previous) if kept_step == step - 2 else rebuild_buffers(store, run_id, step)
    _kept[key] = (step - 1, buffers)
    return buffers


def _with_outcomes(buffers: OutcomeBuffers, rewards: pa.Table) -> OutcomeBuffers:
    rows = sorted(rewards.to_pylist(), key=lambda r: (r["step"], r["rollout_id"]))
    for row in rows:
        found = outcome(row["verifier"], row["status"], row["score"])
        if found is not None:  # an error row has no outcome (verifiers/outcomes.py)
            buffers.add(row["problem_id"], [found])
    return buffers


def rebuild_buffers(store: Store, run_id: str, step: int, length: int = BUFFER_LENGTH) -> OutcomeBuffers:
    """The buffers from scratch: one query over the run's rewards before `step`, newest `length` per problem.

    This process's background commits are drained first: the rewards of the steps before may still be on their
    way to the store (a first allocation in a process after steps that needed none: step 1, or steps whose
    allocations a resumed run found committed), and a listing without them would give other buffers."""
    store.wait()
    manifests = [m for m in store.manifests(kind="rewards", run_id=run_id) if m.step is not None and m.step < step]
    buffers = OutcomeBuffers(length=length)
    if not manifests:
        return buffers
    paths = [path for m in manifests for path in data_paths(store, m)]
    con = duckdb_connection(store)
    try:
        rows = con.execute(
            f"""SELECT problem_id, list(score ORDER BY step, rollout_id) AS outcomes FROM (
                    SELECT problem_id, {OUTCOME_SQL} AS score, step, rollout_id, row_number() OVER (
                        PARTITION BY problem_id ORDER BY step DESC, rollout_id DESC) AS recency
                    FROM {parquet_scan(paths)} WHERE run_id = ? AND status <> 'error')
                WHERE recency <= ? GROUP BY problem_id ORDER BY problem_id""",
            [run_id, length],
        ).fetchall()
    finally:
        con.close()
    for problem_id, outcomes in rows:
        buffers.add(problem_id, outcomes)
    return buffers


ALLOCATE: Stage[AllocateConfig] = Stage(
    name="allocate",
    code_version="4",  # 4: buffers hold outcomes (solved or not; RLPR's reward), error rows none
    section="allocate",
    config=ALLOCATORS.config_type,
    default=ALLOCATORS.default_config,
    inputs=("selections", "difficulty", "rewards"),
    outputs={"allocations": Output("allocations")},
    build=build,
)
