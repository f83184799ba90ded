"""Which stored weights a policy is rebuilt from, read from manifests alone (no model is loaded).

A train step commits its weights and optimizer state (its `train_state`) every `train.state_every` steps;
the steps between commit a `train_state` that holds only its row (manifest extra `weights: false`). Such
a policy is rebuilt by loading the newest stored state before it and replaying the train steps after it
from their committed rollouts and rewards (trainer/checkpoints.py). A state that should hold weights
and is gone (only a run's newest is kept) cannot be replayed: its policy is no longer stored.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlvr.storage.errors import ArtifactNotFound
from rlvr.storage.store import Store


@dataclass(frozen=True)
class PolicyChain:
    """`base`: the policy reference whose weights are stored (a checkpoint, or a train step whose
    train_state holds weights); `replay`: the train_steps ids to replay after it, oldest first."""

    base: str
    replay: tuple[str, ...] = ()


def train_state_of(store: Store, train_steps_id: str) -> str:
    """The train_state artifact the train run of `train_steps_id` committed beside it."""
    return str(store.manifest(train_steps_id).extra["stage_run"]["outputs"]["train_state"])


def holds_weights(store: Store, artifact_id: str) -> bool:
    """Whether `artifact_id` (a train_state or checkpoint) is stored with its weights. A state deleted between
    the two reads (the run's commits prune the trainer states a newer one replaced, in the background, while
    the next step's train stage and the sampler process ask) holds none: SmolLM2 at flow.async_level=2 failed
    on it once with ArtifactNotFound."""
    try:
        return store.exists(artifact_id) and store.manifest(artifact_id).extra.get("weights", True) is not False
    except ArtifactNotFound:
        return False


def state_every(store: Store, train_steps_id: str) -> int:
    """How often the train run of `train_steps_id` stored its state (1: every step)."""
    return int(store.manifest(train_steps_id).config.get("state_every", 1))


def policy_chain(store: Store, policy_ref: str) -> PolicyChain | None:
    """How `policy_ref` (a checkpoints or train_steps id) is rebuilt: from its own stored weights, or from
    an earlier step's with the steps between replayed; None when the weights it needs are gone."""
    replay: list[str] = []
    ref = policy_ref
    while (manifest := store.manifest(ref)).kind == "train_steps":
        if holds_weights(store, train_state_of(store, ref)):
            break
        every = state_every(store, ref)
        if every == 1 or (manifest.step or 0) % every == 0:
            return None  # it was stored with weights and has been replaced since
        replay.append(ref)
        ref = manifest.extra["stage_run"]["inputs"]["policy"][0]
    return PolicyChain(base=ref, replay=tuple(reversed(replay)))


def weights_needed(store: Store, policy_ref: str) -> list[str]:
    """The train_state ids that must stay stored for `policy_ref` to be rebuilt (none when it starts from a
    checkpoint, which is kept forever)."""
    chain = policy_chain(store, policy_ref)
    if chain is None or store.manifest(chain.base).kind != "train_steps":
        return []
    return [train_state_of(store, chain.base)]


def sampler_needs(store: Store, policy_ref: str, count: int) -> list[str]:
    """The train_state ids that keep `policy_ref` and the `count` - 1 policies before it rebuildable: with
    flow.async_level k, samplers still read the policies entering the last k steps after the newest state."""
    needed: list[str] = []
    ref = policy_ref
    for _ in range(count):
        manifest = store.manifest(ref)
        if manifest.kind != "train_steps":
            break  # a checkpoint, kept forever
        state = train_state_of(store, ref)
        needed += [state] if holds_weights(store, state) else weights_needed(store, ref)
        ref = manifest.extra["stage_run"]["inputs"]["policy"][0]
    return list(dict.fromkeys(needed))
