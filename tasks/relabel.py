"""relabel: re-score a committed `rewards` artifact with a verifier at its current version.

Writes `relabeled_rewards` (the rewards schema; a kind of its own so the `rewards` view keeps meaning
"what training saw") and a `relabel_flips` report of the rows whose score or status changed.
Verdicts the current version already gave come from the reward cache; the new ones are cached. A problem judged
by a model (the judge, a reward model) is asked again with its question, of the endpoint the run was given
(`cfg.judge`, `cfg.reward_model`: the run's reward section, which `rlvr relabel` reads from the run's config), as
the label stage asks it, except that the step's share of failed verdicts stops no relabelling (they stay `error`
rows); the endpoint's circuit breaker still stops one that fails call after call (rlvr/endpoints.py).
"""

from __future__ import annotations

from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.verifiers.cache import VerifierConfig, problem_references, score_rollouts, verifier_identity
from rlvr.verifiers.model_rewards import model_verdicts, split_by_model


def build(inputs: Inputs, cfg: VerifierConfig, ctx: StageContext) -> dict[str, Built]:
    """Inputs: the old `rewards`, and the `rollouts` and `problems` it was labelled from."""
    before = {r["rollout_id"]: r for r in inputs.rows("rewards")}
    rollouts = inputs.rows("rollouts", ["rollout_id", "problem_id", "prompt", "response"])
    references = problem_references(inputs.table("problems", ["problem_id", "verifier", "reference"]))
    judged, plain = split_by_model(cfg, rollouts, references)
    by_model, model_entries = model_verdicts(ctx.store, cfg, judged, references, max_error_rate=None)
    scored, entries = score_rollouts(ctx.store, cfg, plain, references)
    verdict_of = by_model | {r["rollout_id"]: v for r, v in zip(plain, scored)}
    verdicts = [verdict_of[r["rollout_id"]] for r in rollouts]
    rows, flips = [], []
    for r, v in zip(rollouts, verdicts):
        was = before[r["rollout_id"]]
        rows.append({**was, **v})
        if (was["score"], was["status"]) != (v["score"], v["status"]):
            flips.append(
                {
                    "rollout_id": r["rollout_id"],
                    "run_id": was["run_id"],
                    "step": was["step"],
                    "old_verifier_version": was["verifier_version"],
                    "new_verifier_version": v["verifier_version"],
                    "old_score": was["score"],
                    "new_score": v["score"],
                    "old_status": was["status"],
                    "new_status": v["status"],
                }
            )
    return {
        "reward_cache": Built(rows_to_table("reward_cache", [*entries, *model_entries])),
        "relabeled_rewards": Built(rows_to_table("relabeled_rewards", rows)),
        "relabel_flips": Built(rows_to_table("relabel_flips", flips)),
    }


RELABEL: Stage[VerifierConfig] = Stage(
    name="relabel",
    code_version="4",
    section=None,
    config=VerifierConfig,
    inputs=("rewards", "rollouts", "problems"),
    outputs={
        "reward_cache": Output("reward_cache"),
        "relabeled_rewards": Output("relabeled_rewards"),
        "relabel_flips": Output("relabel_flips"),
    },
    build=build,
    identity=verifier_identity,
)
