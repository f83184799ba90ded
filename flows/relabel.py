"""Relabelling as a Prefect flow: re-score rewards artifacts with the current verifier versions."""

from __future__ import annotations

from prefect import flow

from rlvr.errors import UserError
from rlvr.flows.stages import RunContext, run
from rlvr.storage.store import open_store
from rlvr.tasks.relabel import RELABEL
from rlvr.verifiers.cache import VerifierConfig


@flow(name="relabel", validate_parameters=False)
def relabel_rewards(store: str, rewards_ids: list[str], cfg: VerifierConfig) -> list[tuple[str, str]]:
    """(relabeled_rewards id, relabel_flips id) for each input rewards artifact, in order."""
    results = []
    for rewards_id in rewards_ids:
        old = open_store(store).manifest(rewards_id)
        if old.kind != "rewards":
            raise UserError(f"{rewards_id} is a {old.kind} artifact; relabel takes a rewards artifact")
        rollouts_id, problems_id = old.parents[0], old.parents[1]
        at = RunContext(store, str(old.run_id), step=old.step)
        done = run(RELABEL, cfg, at, inputs={"rewards": rewards_id, "rollouts": rollouts_id, "problems": problems_id})
        results.append((done["relabeled_rewards"], done["relabel_flips"]))
    return results
