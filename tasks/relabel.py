"""relabel: re-score a committed `rewards` artifact with a verifier at its current version.

Writes `relabeled_rewards` (the rewards schema; a kind of its own so the `rewards` view keeps meaning
"what training saw") and a `relabel_flips` report of the rows whose score or status changed.
Verdicts the current version already gave come from the reward cache; the new ones are cached. A problem judged
by a model (the judge, a reward model) is asked again with its question, of the endpoint the run was given
(`cfg.judge`, `cfg.reward_model`: the run's reward section, which `rlvr relabel` reads from the run's config).
"""

from __future__ import annotations

from typing import Any

from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.verifiers.cache import VerifierConfig, problem_references, score_rollouts, verifier_identity
from rlvr.verifiers.model_rewards import model_given, model_rollouts
from rlvr.verifiers.registry import verifier_class


def build(inputs: Inputs, cfg: VerifierConfig, ctx: StageContext) -> dict[str, Built]:
    """Inputs: the old `rewards`, and the `rollouts` and `problems` it was labelled from."""
    before = {r["rollout_id"]: r for r in inputs.rows("rewards")}
    rollouts = inputs.rows("rollouts", ["rollout_id", "problem_id", "prompt", "response"])
    references = problem_references(inputs.table("problems", ["problem_id", "verifier", "reference"]))
    by_model, model_entries, plain = model_verdicts(ctx, cfg, rollouts, references)
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


def model_verdicts(
    ctx: StageContext,
    cfg: VerifierConfig,
    rollouts: list[dict[str, Any]],
    references: dict[str, tuple[str | None, Any]],
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The verdicts of the rollouts a model the run was given scores (rollout_id -> rewards columns, asked as the
    label stage asks: cache first), their new cache entries, and the rollouts left for the verifiers. Unlike a
    run, no error rate stops a relabelling: failed verdicts are rows with status `error`."""
    answers = {pid: ref for pid, (_, ref) in references.items()}
    groups: dict[str, list[dict[str, Any]]] = {}
    plain: list[dict[str, Any]] = []
    for r in rollouts:
        name = cfg.verifier_of(references[r["problem_id"]][0])
        if model_given(name) and cfg.endpoint_version(name) not in (None, verifier_class(name).version):
            groups.setdefault(name, []).append(r)
        else:
            plain.append(r)
    found: dict[str, dict[str, Any]] = {}
    entries: list[dict[str, Any]] = []
    for name, mine in sorted(groups.items()):
        rows, made = model_rollouts(ctx.store, cfg, name, mine, answers)
        found |= {r["rollout_id"]: row for r, row in zip(mine, rows, strict=True)}
        entries += made
    return found, entries, plain


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
