"""select: the selection strategy (`select.type`) picks the step's problems; each pick is a row with its
arm and probability, so "why was problem X trained at step t" is a query. With `select.hints` (GHPO) a
pick also has the share of its problem's solution the rollouts see as a hint (curricula/hints.py)."""

from __future__ import annotations

import random

from rlvr.curricula.base import SelectConfig
from rlvr.curricula.hints import STATE_KEY, level_of, ratio_of, starting_levels
from rlvr.curricula.pool import build_pool
from rlvr.curricula.registry import STRATEGIES, make_strategy
from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, carried_state, rows_to_table


def build(inputs: Inputs, cfg: SelectConfig, ctx: StageContext) -> Built:
    """Inputs: the problems, their difficulty, and the strategy state after the previous step (none at first).

    params (refill rounds of dynamic sampling only): `round`, `count` (prompts to draw) and `first_slot`
    (slots keep counting across a step's rounds, so (step, slot) names one group).
    """
    difficulty = inputs.rows("difficulty", ["problem_id", "bin", "pass_rate"])
    pool = build_pool(
        inputs.rows("problems", ["problem_id", "split", "category", "domain"]), difficulty, cfg.splits, cfg.arms
    )
    strategy = make_strategy(cfg)
    levels: dict[str, int] = {}
    if inputs.id("state") is not None:
        state = inputs.load("state", carried_state)
        levels = state.pop(STATE_KEY, {})
        strategy.load_state_dict(state)
    round_ = ctx.params.get("round", 0)
    seed = ctx.derive_seed("select", ctx.step, round_) if round_ else ctx.derive_seed("select", ctx.step)
    picks = strategy.select(pool, ctx.params.get("count", cfg.batch_size), random.Random(seed))
    first = ctx.params.get("first_slot", 0)
    start = starting_levels(inputs.table("problems"), difficulty, cfg.hints) if cfg.hints.from_difficulty else {}
    rows = [
        {
            "run_id": ctx.run_id,
            "step": ctx.step,
            "slot": first + slot,
            "problem_id": pick.problem_id,
            "arm": pick.arm,
            "probability": pick.probability,
            "strategy": strategy.type,
            "hint_ratio": ratio_of(level_of(pick.problem_id, levels, start), cfg.hints),
        }
        for slot, pick in enumerate(picks)
    ]
    return Built(rows_to_table("selections", rows))


SELECT: Stage[SelectConfig] = Stage(
    name="select",
    code_version="3",  # 3: GHPO hints stop before the step that states the answer (curricula/hints.py)
    section="select",
    config=STRATEGIES.config_type,
    default=STRATEGIES.default_config,
    inputs=("problems", "difficulty", "state"),
    outputs={"selections": Output("selections")},
    build=build,
)
