"""update: the selection strategy learns from the finished step (SEC's TD(0) update, ...).

Its state after the step is carried to the next step's select and update (kept in this stage's
`curriculum_state` manifest), and its audit rows (one per arm: the probability it used, pulls, the
reward it saw, its value before and after) are the `curriculum_state` view.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from rlvr.curricula.base import ProblemOutcome, SelectConfig, StepFeedback
from rlvr.curricula.hints import STATE_KEY, GroupOutcome, next_levels, solutions_of, starting_levels
from rlvr.curricula.pool import build_pool
from rlvr.curricula.registry import STRATEGIES, make_strategy
from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.trainer.grpo import group_advantages
from rlvr.verifiers.outcomes import solved


def step_outcomes(
    selections: Sequence[dict[str, Any]],
    rollouts: Sequence[dict[str, Any]],
    score_of: dict[str, float],
    advantage_scale: Literal["std", "none"],
) -> list[ProblemOutcome]:
    """Each slot's rewards and GRPO advantages (computed as the trainer does, over every group)."""
    by_slot: dict[int, list[dict[str, Any]]] = {}
    for r in sorted(rollouts, key=lambda r: (r["slot"], r["sample_index"])):
        by_slot.setdefault(r["slot"], []).append(r)
    slots = sorted(by_slot)
    rewards = [score_of[r["rollout_id"]] for slot in slots for r in by_slot[slot]]
    groups = [i for i, slot in enumerate(slots) for _ in by_slot[slot]]
    advantages = (
        group_advantages(
            torch.tensor(rewards, dtype=torch.float32), torch.tensor(groups, dtype=torch.long), scale=advantage_scale
        ).tolist()
        if rewards
        else []
    )
    outcomes, start = [], 0
    pick_of = {s["slot"]: s for s in selections}
    for slot in slots:
        size = len(by_slot[slot])
        pick = pick_of[slot]
        outcomes.append(
            ProblemOutcome(
                slot,
                pick["problem_id"],
                pick["arm"],
                tuple(rewards[start : start + size]),
                tuple(advantages[start : start + size]),
                responses=tuple(r["response"] for r in by_slot[slot]),
            )
        )
        start += size
    return outcomes


def build(inputs: Inputs, cfg: SelectConfig, ctx: StageContext) -> Built:
    """params: `advantage_scale` (the trainer's, so the advantages seen here are the trainer's)."""
    difficulty = inputs.rows("difficulty", ["problem_id", "bin", "pass_rate"])
    pool = build_pool(
        inputs.rows("problems", ["problem_id", "split", "category", "domain"]), difficulty, cfg.splits, cfg.arms
    )
    score_of = dict(zip(*inputs.table("rewards", ["rollout_id", "score"]).to_pydict().values()))
    outcomes = step_outcomes(
        inputs.rows("selections", ["slot", "problem_id", "arm"]),
        inputs.rows("rollouts", ["rollout_id", "slot", "sample_index", "response"]),
        score_of,
        ctx.params["advantage_scale"],
    )
    strategy = make_strategy(cfg)
    state = dict(ctx.state or {})
    levels = state.pop(STATE_KEY, {})
    strategy.load_state_dict(state)
    audit = strategy.observe(StepFeedback(ctx.step or 0, pool, outcomes))
    rows = [{"run_id": ctx.run_id, "step": ctx.step, "strategy": strategy.type, **row} for row in audit]
    after = strategy.state_dict()
    if cfg.hints.enabled:
        start = starting_levels(inputs.table("problems"), difficulty, cfg.hints)
        after[STATE_KEY] = next_levels(levels, hint_outcomes(inputs), hintable(inputs), cfg.hints, start)
    return Built(rows_to_table("curriculum_state", rows), state=after)


def hint_outcomes(inputs: Inputs) -> list[GroupOutcome]:
    """Each group of the step (every round) and whether any sample was correct: solved (verifiers/outcomes.py),
    not the reward, since a shaped reward can vary in a group that is all wrong."""
    correct = {
        r["rollout_id"]: solved(r["verifier"], r["status"]) is True
        for r in inputs.rows("rewards", ["rollout_id", "verifier", "status"])
    }
    groups: dict[int, GroupOutcome] = {}
    for r in inputs.rows("rollouts", ["rollout_id", "slot", "problem_id"]):
        seen = groups.get(r["slot"])
        any_correct = correct[r["rollout_id"]] or (seen is not None and seen.any_correct)
        groups[r["slot"]] = GroupOutcome(r["slot"], r["problem_id"], any_correct)
    return list(groups.values())


def hintable(inputs: Inputs) -> set[str]:
    """The problems with a solution to hint from."""
    return set(solutions_of(inputs.table("problems")))


UPDATE: Stage[SelectConfig] = Stage(
    name="update",
    # 3: solved as verifiers/outcomes.py reads it (an environment's reward at env.solved_at, not status "ok" alone);
    # 2: a problem whose solution cannot be hinted without its answer never moves level
    code_version="3",
    section="select",
    config=STRATEGIES.config_type,
    default=STRATEGIES.default_config,
    inputs=("state", "problems", "difficulty", "selections", "rollouts", "rewards"),
    outputs={"curriculum_state": Output("curriculum_state")},
    build=build,
    carries_state=True,
)
