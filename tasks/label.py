"""label: score every rollout with its problem's verifier (or `label.verifier` for all); statuses, not silent zeros.

Verdicts come from the store's reward cache when this (verifier version, response, reference) was
scored before, otherwise from the verifier pool (worker processes with a hard timeout). The new
cacheable verdicts are committed as a `reward_cache` artifact beside the step's `rewards`.
"""

from __future__ import annotations

from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.verifiers.cache import VerifierConfig, problem_references, score_rollouts, verifier_identity


def build(inputs: Inputs, cfg: VerifierConfig, ctx: StageContext) -> dict[str, Built]:
    rollouts = inputs.rows("rollouts", ["rollout_id", "problem_id", "response"])
    references = problem_references(inputs.table("problems", ["problem_id", "verifier", "reference"]))
    verdicts, entries = score_rollouts(ctx.store, cfg, rollouts, references)
    rows = [
        {"rollout_id": r["rollout_id"], "run_id": ctx.run_id, "step": ctx.step, "problem_id": r["problem_id"], **v}
        for r, v in zip(rollouts, verdicts)
    ]
    return {
        "reward_cache": Built(rows_to_table("reward_cache", entries)),
        "rewards": Built(rows_to_table("rewards", rows)),
    }


LABEL: Stage[VerifierConfig] = Stage(
    name="label",
    code_version="3",
    section="label",
    config=VerifierConfig,
    inputs=("rollouts", "problems"),
    outputs={"reward_cache": Output("reward_cache"), "rewards": Output("rewards")},
    build=build,
    identity=verifier_identity,
)
