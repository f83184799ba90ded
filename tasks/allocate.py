"""allocate: how many rollouts each selected problem gets (`allocate.type`), under a total budget of
prompts x `allocate.n`; ragged groups allowed. Each row says why: the estimate used, its case, the value."""

from __future__ import annotations

from rlvr.curricula.base import AllocateConfig, Estimate, Pick
from rlvr.curricula.registry import ALLOCATORS, make_allocator
from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table


def build(inputs: Inputs, cfg: AllocateConfig, ctx: StageContext) -> Built:
    """Inputs: the step's selections and the difficulty stage's pass rates (the estimate of each pick)."""
    slots = inputs.rows("selections", ["slot", "problem_id", "arm", "probability"])
    stats = {r["problem_id"]: r for r in inputs.rows("difficulty", ["problem_id", "pass_rate", "k"])}
    picks = [Pick(s["problem_id"], s["arm"], s["probability"]) for s in slots]
    estimates = [_difficulty_estimate(stats.get(s["problem_id"])) for s in slots]
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
            "buffer_count": e.count,
            "case": a.case,
            "value": a.value,
            "fallback": a.fallback,
            "allocator": allocator.type,
        }
        for s, e, a in zip(slots, estimates, allocations)
    ]
    return Built(rows_to_table("allocations", rows))


def _difficulty_estimate(stat: dict | None) -> Estimate:
    if stat is None:
        return Estimate(None)
    return Estimate(stat["pass_rate"], count=stat["k"], source="difficulty")


ALLOCATE: Stage[AllocateConfig] = Stage(
    name="allocate",
    code_version="2",
    section="allocate",
    config=ALLOCATORS.config_type,
    default=ALLOCATORS.default_config,
    inputs=("selections", "difficulty"),
    outputs={"allocations": Output("allocations")},
    build=build,
)
