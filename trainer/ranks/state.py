"""The training state of a data-parallel group on disk: every rank writes and reads its own shards of the weights and
optimizer state with torch.distributed.checkpoint (DCP), as files of a store artifact, so a state saved at one rank
count loads at another.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlvr.storage.store import Store, open_store
from rlvr.trainer.policy import WEIGHTS_FILE, Policy, make_optimizer
from rlvr.trainer.ranks.operations import RankState, ready, skeleton
from rlvr.trainer.ranks.transport import gather_bytes
from rlvr.trainer.sharding import dcp_name, load_hf_weights, load_sharded, save_sharded, scratch_dir, shard, stored_name
from rlvr.trainer.streamed_weights import safetensors_chunks


def save_share(state: RankState, header: dict[str, Any]) -> list[dict[str, Any]]:
    """This rank's files of a sharded state, written into the artifact's folder; every entry on rank 0."""
    assert state.policy is not None and state.optimizer is not None
    store = open_store(header["root"])
    with scratch_dir() as directory:
        save_sharded(state.policy.model, state.optimizer, directory)
        entries = [
            store.place_file(header["kind"], header["artifact_id"], stored_name(path.name), path.read_bytes())
            for path in sorted(directory.iterdir())
        ]
    parts = gather_bytes(json.dumps(entries).encode(), state.device)
    return [entry for part in parts for entry in json.loads(part)]


def write_weights_share(state: RankState, header: dict[str, Any]) -> dict[str, Any]:
    """Every rank: the policy's weights streamed, a tensor at a time, into `model.safetensors` of the artifact
    `header` names (rank 0 writes the file; the others gather each tensor with it); the file's manifest entry on
    rank 0, an empty dict elsewhere."""
    assert state.policy is not None
    chunks = safetensors_chunks(state.policy.model)
    if dist.get_rank() != 0:
        for _ in chunks:
            pass
        return {}
    store = open_store(header["root"])
    return store.place_file(header["kind"], header["artifact_id"], WEIGHTS_FILE, chunks)


def empty_model(state: RankState, static: dict[str, bytes], header: dict[str, Any]) -> Policy:
    """The policy built from its static files in `header`'s dtype, sharded, materialised without values
    (`to_empty`): what a rank then reads its slices into."""
    policy = skeleton(static, getattr(torch, header["dtype"]), state.threads)
    shard(policy.model, state.sharding, state.device)
    policy.model.to_empty(device=state.device)
    return policy


def empty_sharded(
    state: RankState, static: dict[str, bytes], header: dict[str, Any]
) -> tuple[Policy, torch.optim.Optimizer]:
    """`empty_model`, and an optimizer over its shards."""
    policy = empty_model(state, static, header)
    return policy, make_optimizer(policy, header["lr"], header["weight_decay"])


def adopt_share(
    state: RankState, static: dict[str, bytes], header: dict[str, Any]
) -> tuple[Policy, torch.optim.Optimizer]:
    """Every rank: the model built empty and sharded, its shards read as slices of the stored weights file that
    `header` names (a Hugging Face checkpoint's `model.safetensors`), and a fresh optimizer over them."""
    policy, optimizer = empty_sharded(state, static, header)
    return _read_slices(policy, header), optimizer


def reference_share(state: RankState, static: dict[str, bytes], header: dict[str, Any]) -> Policy:
    """Every rank: the KL reference, frozen, its shards read as slices of the stored weights file `header` names."""
    policy = empty_model(state, static, header)
    policy.model.requires_grad_(False)
    return _read_slices(policy, header)


def _read_slices(policy: Policy, header: dict[str, Any]) -> Policy:
    store = open_store(header["root"])
    with scratch_dir() as directory:
        source = store.local_file_path(header["artifact_id"], WEIGHTS_FILE)
        if source is not None:  # read in place: each rank maps the slices it needs
            (directory / WEIGHTS_FILE).symlink_to(source)
        else:  # object storage: a copy on this machine's disk (never in memory), read the same way
            store.fs.get_file(store.file_path(header["artifact_id"], WEIGHTS_FILE), str(directory / WEIGHTS_FILE))
        load_hf_weights(policy.model, directory)
    policy.model.tie_weights()
    return ready(policy)


def load_share(
    state: RankState, static: dict[str, bytes], header: dict[str, Any]
) -> tuple[Policy, torch.optim.Optimizer]:
    """Every rank: the model built empty and sharded, and its shards (and the optimizer's) read from the state
    files of artifact `header["artifact_id"]`."""
    policy, optimizer = empty_sharded(state, static, header)
    with scratch_dir() as directory:
        fetch_state_files(open_store(header["root"]), header["artifact_id"], directory)
        load_sharded(policy.model, optimizer, directory, alone=False)
    policy.model.tie_weights()
    return ready(policy), optimizer


def fetch_state_files(store: Store, artifact_id: str, directory: Path) -> None:
    """The torch.distributed.checkpoint files of a stored state into `directory`, under DCP's own names (each
    read checked against its manifest's sha256)."""
    for entry in store.manifest(artifact_id).binary_files:
        name = entry["path"].removeprefix("files/")
        own = dcp_name(name)
        if own is not None:
            (directory / own).write_bytes(store.read_file(artifact_id, name))
