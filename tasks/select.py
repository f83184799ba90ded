"""select: the selection strategy (`select.type`) picks the step's problems; each pick is a row with its
arm and probability, so "why was problem X trained at step t" is a query."""

from __future__ import annotations

import random

from rlvr.curricula.base import SelectConfig
from rlvr.curricula.pool import build_pool
from rlvr.curricula.registry import STRATEGIES, make_strategy
from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, carried_state, rows_to_table


def build(inputs: Inputs, cfg: SelectConfig, ctx: StageContext) -> Built:
    """Inputs: the problems, their difficulty, and the strategy state after the previous step (none at first)."""
    pool = build_pool(
        inputs.rows("problems", ["problem_id", "split", "category", "domain"]),
        inputs.rows("difficulty", ["problem_id", "bin", "pass_rate"]),
        cfg.splits,
        cfg.arms,
    )
    strategy = make_strategy(cfg)
    if inputs.id("state") is not None:
        strategy.load_state_dict(inputs.load("state", carried_state))
    picks = strategy.select(pool, cfg.batch_size, random.Random(ctx.derive_seed("select", ctx.step)))
    rows = [
        {
            "run_id": ctx.run_id,
            "step": ctx.step,
            "slot": slot,
            "problem_id": pick.problem_id,
            "arm": pick.arm,
            "probability": pick.probability,
            "strategy": strategy.type,
        }
        for slot, pick in enumerate(picks)
    ]
    return Built(rows_to_table("selections", rows))


SELECT: Stage[SelectConfig] = Stage(
    name="select",
    code_version="2",
    section="select",
    config=STRATEGIES.config_type,
    default=STRATEGIES.default_config,
    inputs=("problems", "difficulty", "state"),
    outputs={"selections": Output("selections")},
    build=build,
)
