"""filter: dynamic sampling (DAPO): groups whose rewards are all equal give GRPO no gradient, so the
step over-samples prompts, keeps the first `select.batch_size` groups with reward variance, and asks
for refill rounds (new prompts) until it has them or `filter.max_refills` is reached.

One run per round, deciding over every group of the step so far; its rows are the groups of its own
round (a group's fate is settled when it is made: the first B groups with variance train), so the
`filtered_groups` view has one row per group. Its manifest says whether a refill is wanted
(`refill_prompts`) or the limit was hit (`limit_reached`: the step trains on fewer groups; the flow warns
once).

With RLPR's std filter (`filter.std`) the stage carries the EMA of the steps' mean group std: every round of a step
reads the state the step before left (its last round's) and computes the same threshold; the state a round leaves
counts every group of the step so far. RLPR's rewards (verifier `rlpr`) have no correctness, so a group's variance
is that of its rewards.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from rlvr.curricula.filtering import DynamicSamplingConfig, filter_groups, group_std, std_filter_state, step_std_ema
from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.verifiers.outcomes import is_error, outcome


def build(inputs: Inputs, cfg: DynamicSamplingConfig, ctx: StageContext) -> Built:
    """Inputs: the step's rollouts and rewards, every round so far; with `filter.std`, the `state` the step before
    left. params: batch_size, refills_done and first_slot (where this round's slots start)."""
    # Outcomes, not the reward (verifiers/outcomes.py): a shaped reward (partial credit, a format bonus, a game's
    # penalty) can vary in a group that is all wrong, and such a group must still count as one without signal.
    # RLPR's rewards have no correctness: their own variance counts. A row whose verdict failed has no outcome
    # and is left out of its group.
    rows_in = inputs.table("rewards", ["rollout_id", "status", "score", "verifier"]).to_pylist()
    signal_of = {r["rollout_id"]: outcome(r["verifier"], r["status"], r["score"]) for r in rows_in}
    score_of = {r["rollout_id"]: r["score"] for r in rows_in if not is_error(r["status"])}
    by_slot: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in inputs.rows("rollouts", ["rollout_id", "slot", "sample_index", "problem_id"]):
        by_slot[r["slot"]].append(r)
    slots = sorted(by_slot)
    ordered = [sorted(by_slot[s], key=lambda r: r["sample_index"]) for s in slots]
    groups = [[s for r in group if (s := signal_of[r["rollout_id"]]) is not None] for group in ordered]
    scores = [[score_of[r["rollout_id"]] for r in group if r["rollout_id"] in score_of] for group in ordered]
    ema, state, floor = None, None, None
    if cfg.std is not None:
        step = ctx.step or 0
        ema = step_std_ema(ctx.state, step, cfg.std)
        floor = None if ema is None else cfg.std.beta * ema
        stds = [std for std in map(group_std, scores) if std is not None]
        state = std_filter_state(ctx.state, step, ema, stds, cfg.std)
    decision = filter_groups(groups, ctx.params["batch_size"], ctx.params["refills_done"], cfg, scores, floor)
    reason = {i: "kept" for i in decision.keep}
    reason.update({i: "zero variance" for i in decision.zero_variance})
    reason.update({i: "outside band" for i in decision.outside_band})
    reason.update({i: "low std" for i in decision.low_std})
    reason.update({i: "surplus" for i in decision.surplus})
    first_slot = ctx.params.get("first_slot", 0)
    rows = [
        {
            "run_id": ctx.run_id,
            "step": ctx.step,
            "round": ctx.params["refills_done"],
            "slot": slot,
            "problem_id": by_slot[slot][0]["problem_id"],
            "rollouts": len(rewards),
            "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
            "kept": reason.get(i) == "kept",
            "reason": reason.get(i, "waiting for refill"),
        }
        for i, (slot, rewards) in enumerate(zip(slots, groups))
        if slot >= first_slot
    ]
    extra: dict[str, Any] = {
        "refill_prompts": decision.refill_prompts,
        "limit_reached": decision.limit_reached,
        "effective_ratio": decision.effective_ratio,
        "kept": len(decision.keep),
    }
    if cfg.std is not None:
        extra |= {"std_ema": ema, "std_floor": floor}
    return Built(rows_to_table("filtered_groups", rows), extra=extra, state=state)


FILTER: Stage[DynamicSamplingConfig] = Stage(
    name="filter",
    code_version="2",  # 2: outcomes through verifiers/outcomes.py; error rows have none
    section="filter",
    config=DynamicSamplingConfig,
    inputs=("rollouts", "rewards", "state"),  # state: only with filter.std, so other runs keep their ids
    outputs={"filtered_groups": Output("filtered_groups")},
    build=build,
    carries_state=True,
)
