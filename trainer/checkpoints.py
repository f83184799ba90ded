"""Policies in the store: where weights and optimizer state live, and the one live trainer state in memory.

A *policy reference* is the id of an artifact that durably names a policy: a `checkpoints` artifact
(weights beside its rows) or a `train_steps` artifact (its weights and optimizer state sit in the
`train_state` artifact derived from it). Only the newest train_state of a run is kept; train_steps
rows and checkpoints are kept forever, so lineage always walks through them.

Stages talk only through these ids. To keep a tiny model's step cheap, the process keeps the newest
trainer state (model + optimizer) in memory under its reference; any other reference is loaded from
the store, so a fresh process (a resumed run) computes exactly what the original one would have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlvr.storage.ids import artifact_id
from rlvr.storage.store import Store
from rlvr.trainer.policy import Policy, load_optimizer_state, make_optimizer, policy_from_files

STATE_CODE_VERSION = "1"
OPTIMIZER_FILE = "optimizer.pt"


def train_state_id(train_steps_id: str, run_id: str) -> str:
    """The id of the train_state artifact that holds the weights named by `train_steps_id`."""
    return artifact_id("train_state", "train", STATE_CODE_VERSION, {}, [train_steps_id], run_id)


def weights_artifact(store: Store, policy_ref: str) -> str:
    """The artifact whose files hold the weights of `policy_ref`."""
    kind = store.manifest(policy_ref).kind
    if kind == "checkpoints":
        return policy_ref
    if kind == "train_steps":
        return train_state_id(policy_ref, store.manifest(policy_ref).run_id)
    raise ValueError(f"{policy_ref} is a {kind} artifact, not a policy (checkpoints or train_steps)")


def policy_files_of(store: Store, policy_ref: str) -> dict[str, bytes]:
    """The Hugging Face model directory (file name -> bytes) of `policy_ref`, without optimizer state."""
    source = weights_artifact(store, policy_ref)
    names = [f["path"] for f in store.manifest(source).files]
    return {
        name.removeprefix("files/"): store.read_file(source, name.removeprefix("files/"))
        for name in names
        if name.startswith("files/") and not name.endswith(OPTIMIZER_FILE)
    }


@dataclass
class TrainerState:
    policy: Policy
    optimizer: torch.optim.Optimizer | None


_live: dict[str, TrainerState] = {}


def load_policy(store: Store, policy_ref: str) -> Policy:
    """The policy named by `policy_ref`, for generation only (never modify it in place)."""
    if policy_ref in _live:
        return _live[policy_ref].policy
    return policy_from_files(policy_files_of(store, policy_ref))


def take_trainer_state(store: Store, policy_ref: str, lr: float, weight_decay: float) -> TrainerState:
    """Model and optimizer to continue training from `policy_ref`; the caller now owns them.

    Taking the state out of the cache means a failed update can never leave a half-updated model
    filed under the old reference.
    """
    state = _live.pop(policy_ref, None)
    if state is not None and state.optimizer is not None:
        return state
    policy = state.policy if state is not None else load_policy(store, policy_ref)
    optimizer = make_optimizer(policy, lr=lr, weight_decay=weight_decay)
    source = weights_artifact(store, policy_ref)
    names = {f["path"] for f in store.manifest(source).files}
    if f"files/{OPTIMIZER_FILE}" in names:
        load_optimizer_state(optimizer, store.read_file(source, OPTIMIZER_FILE))
    return TrainerState(policy, optimizer)


def keep_trainer_state(policy_ref: str, state: TrainerState) -> None:
    """File the newest trainer state under its reference (the only one kept in memory)."""
    _live.clear()
    _live[policy_ref] = state

