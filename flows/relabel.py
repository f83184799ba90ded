"""Relabelling as a Prefect flow: re-score rewards artifacts with the current verifier versions."""

from __future__ import annotations

from prefect import flow

from rlvr.tasks.label import relabel
from rlvr.verifiers.cache import VerifierConfig


@flow(name="relabel", validate_parameters=False)
def relabel_rewards(store: str, rewards_ids: list[str], cfg: VerifierConfig) -> list[tuple[str, str]]:
    """(new rewards id, flips id) for each input rewards artifact, in order."""
    return [relabel(store, rewards_id, cfg) for rewards_id in rewards_ids]
