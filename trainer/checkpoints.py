"""Policies in the store: where weights and optimizer state live, and the live trainer state in memory.

A *policy reference* (`policy_ref`) is the id of an artifact that durably names a policy: a
`checkpoints` artifact (a whole Hugging Face model directory beside its rows) or a `train_steps`
artifact (its weights and optimizer state sit in the `train_state` artifact the same train run
committed, named in its manifest; the config and tokenizer files, which training never changes, are
those of the checkpoint the chain of train steps started from). Only the newest train_state of a run
is kept; train_steps rows and checkpoints are kept forever, so lineage always walks through them.

Stages talk only through these ids. To keep a tiny model's step cheap, the newest trainer state
(model + optimizer) stays in memory under its reference (`RESIDENTS`); any other reference is loaded
from the store, so a fresh process (a resumed run) computes exactly what the original one would have.
A train step whose state was not stored (`train.state_every` > 1) is rebuilt from the newest stored state
before it by replaying the updates between (`rebuilt_state`; storage/policy_chain.py says from where).
"""

from __future__ import annotations

import copy
import json
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from safetensors.torch import load as safetensors_load

from rlvr.errors import UserError
from rlvr.storage.errors import DamagedArtifact
from rlvr.storage.files import damage_message, file_problem
from rlvr.storage.policy_chain import holds_weights, policy_chain
from rlvr.storage.stage import RESIDENTS, Built, Inputs, StageContext, rows_to_table
from rlvr.storage.store import Store
from rlvr.trainer.devices import model_device
from rlvr.trainer.grpo import GRPOConfig
from rlvr.trainer.lora import ADAPTER_FILE, has_lora
from rlvr.trainer.policy import (
    MODEL_BUILD_LOCK,
    WEIGHTS_FILE,
    Policy,
    load_optimizer_state,
    make_optimizer,
    policy_files,
    policy_from_files,
    static_files,
)
from rlvr.trainer.ranks.launch import RankGroup, rank_group
from rlvr.trainer.ranks.operations import ready, skeleton
from rlvr.trainer.ranks.state import fetch_state_files
from rlvr.trainer.sharding import DecodeWeights, Sharding, load_sharded, scratch_dir, stored_name
from rlvr.trainer.streamed_weights import SAFETENSORS_DTYPES, safetensors_chunks
from rlvr.trainer.updates import step_batch, update_policy

OPTIMIZER_FILE = "optimizer.safetensors"
POLICY_KINDS = ("checkpoints", "train_steps")


def weights_artifact(store: Store, policy_ref: str) -> str:
    """The artifact whose files hold the weights of `policy_ref`."""
    manifest = store.manifest(policy_ref)
    if manifest.kind == "checkpoints":
        return policy_ref
    if manifest.kind == "train_steps":
        return str(manifest.extra["stage_run"]["outputs"]["train_state"])
    raise ValueError(f"{policy_ref} is a {manifest.kind} artifact, not a policy (checkpoints or train_steps)")


def require_policy(store: Store, policy_ref: str, what: str) -> str:
    """`policy_ref` when it names a policy in `store` (a checkpoints or train_steps artifact), else a one-line
    UserError naming `what` was given (e.g. "policy.checkpoint")."""
    kind = store.manifest(policy_ref).kind if store.exists(policy_ref) else None
    if kind not in POLICY_KINDS:
        found = "no artifact" if kind is None else f"a {kind} artifact"
        raise UserError(
            f"{what} {policy_ref!r} is {found} in store {store.root}, not a policy (checkpoints or train_steps); "
            'list checkpoints with rlvr query "SELECT run_id, step, artifact_id FROM checkpoints"'
        )
    return policy_ref


def is_weights_file(name: str) -> bool:
    """Files that change as the policy trains (the rest of a model directory is config and tokenizer)."""
    return name.endswith((".safetensors", ".safetensors.index.json", ADAPTER_FILE))


def _files(store: Store, artifact_id: str, keep: Callable[[str], bool]) -> dict[str, bytes]:
    names = [f["path"].removeprefix("files/") for f in store.manifest(artifact_id).binary_files]
    return {name: store.read_file(artifact_id, name) for name in names if keep(name) and name != OPTIMIZER_FILE}


_sources: dict[tuple[str, str], str] = {}  # (store root, policy id) -> its chain's checkpoint; ids never change


def source_checkpoint(store: Store, policy_ref: str) -> str:
    """The checkpoint a chain of train steps started from (walking each step's input policy). The answers are
    remembered, so a sampler asking for each step's policy in turn reads one manifest a step, not one per
    step trained so far."""
    root, walked, ref = str(store.root), [], policy_ref
    while (root, ref) not in _sources and (manifest := store.manifest(ref)).kind == "train_steps":
        walked.append(ref)
        ref = manifest.extra["stage_run"]["inputs"]["policy"][0]
    source = _sources.get((root, ref), ref)
    if len(_sources) > 100_000:
        _sources.clear()
    _sources.update({(root, step): source for step in walked})
    return source


def policy_files_of(store: Store, policy_ref: str) -> dict[str, bytes]:
    """The Hugging Face model directory (file name -> bytes) of `policy_ref`, without optimizer state."""
    source = weights_artifact(store, policy_ref)
    if not holds_weights(store, source) or holds_sharded_state(store, source):
        live = RESIDENTS.get(policy_ref)
        if isinstance(live, TrainerState):
            return policy_files(live.policy)  # gathered whole from the ranks when they hold it
        if not holds_weights(store, source):
            return policy_files(rebuilt_state(store, policy_ref).policy)
        return policy_files(plain_from_state(store, policy_ref, device=torch.device("cpu")).policy)
    if source == policy_ref:
        return _files(store, source, lambda name: True)
    static = _files(store, source_checkpoint(store, policy_ref), lambda name: not is_weights_file(name))
    return {**static, **_files(store, source, is_weights_file)}


@dataclass
class TrainerState:
    policy: Policy
    optimizer: torch.optim.Optimizer | None


def load_policy(store: Store, policy_ref: str, *, device: torch.device) -> Policy:
    """The policy named by `policy_ref` on `device`, for generation only (never modify it in place). The live
    one serves when it is on that device (it is, within a run: every stage uses the run's device)."""
    live = RESIDENTS.get(policy_ref)
    if isinstance(live, TrainerState) and model_device(live.policy.model) == device:
        return live.policy
    return _stored_policy(store, policy_ref, device)


def _stored_policy(store: Store, policy_ref: str, device: torch.device) -> Policy:
    """The policy loaded from the store: its stored weights, or rebuilt by replaying the steps since them."""
    if not holds_weights(store, weights_artifact(store, policy_ref)):
        return rebuilt_state(store, policy_ref, device=device).policy
    if holds_sharded_state(store, weights_artifact(store, policy_ref)):
        return plain_from_state(store, policy_ref, device=device).policy
    return policy_from_files(policy_files_of(store, policy_ref), device=device)


def holds_sharded_state(store: Store, artifact_id: str) -> bool:
    """Whether a train_state holds a sharded state (torch.distributed.checkpoint files, written by the
    data-parallel ranks) rather than a whole model directory's weights and optimizer state."""
    return f"files/{stored_name('.metadata')}" in {entry["path"] for entry in store.manifest(artifact_id).files}


def _sharded_state_of(store: Store, policy_ref: str) -> tuple[str, dict[str, bytes], torch.dtype]:
    """The train_state holding `policy_ref`'s sharded state, the static files of its chain's checkpoint (config,
    tokenizer) and the weights' dtype, recorded when the ranks wrote it."""
    artifact = weights_artifact(store, policy_ref)
    static = _files(store, source_checkpoint(store, policy_ref), lambda name: not is_weights_file(name))
    return artifact, static, getattr(torch, str(store.manifest(artifact).extra.get("dtype", "float32")))


def plain_from_state(
    store: Store,
    policy_ref: str,
    *,
    device: torch.device,
    lr: float | None = None,
    weight_decay: float = 0.0,
) -> TrainerState:
    """The policy of `policy_ref` whole in this process from its sharded state (any rank count wrote it), and
    with `lr` an optimizer holding its state: torch.distributed.checkpoint reads every shard, no collective."""
    artifact, static, dtype = _sharded_state_of(store, policy_ref)
    with MODEL_BUILD_LOCK:
        policy = skeleton(static, dtype, torch.get_num_threads())
    policy.model.to_empty(device=device)
    policy.model.tie_weights()  # to_empty gave each name of a tied weight a tensor of its own
    optimizer = make_optimizer(policy, lr, weight_decay) if lr is not None else None
    with scratch_dir() as directory:
        fetch_state_files(store, artifact, directory)
        load_sharded(policy.model, optimizer, directory, alone=True)
    return TrainerState(ready(policy), optimizer)


_snapshots: dict[str, Policy] = {}
_snapshots_lock = threading.Lock()


def keep_snapshots(policy_refs: set[str]) -> None:
    """Keep a private copy of each of `policy_refs` that is live in this process, and drop the other copies.

    With flow.async_level > 0 a sampler on another thread samples from an earlier policy while the trainer
    updates the live one in place; the flow calls this before the trainer takes that policy, so the sampler
    (`sampler_policy`) reads a copy that no update touches."""
    with _snapshots_lock:
        for ref in set(_snapshots) - policy_refs:
            del _snapshots[ref]
        for ref in policy_refs - set(_snapshots):
            live = RESIDENTS.get(ref)
            if isinstance(live, TrainerState):
                with MODEL_BUILD_LOCK:
                    _snapshots[ref] = copy.deepcopy(live.policy)


def sampler_policy(store: Store, policy_ref: str, *, device: torch.device) -> Policy:
    """The policy named by `policy_ref` for a sampler beside the trainer: the copy `keep_snapshots` kept, else
    one loaded from the store; never the live one, which the trainer may be updating."""
    with _snapshots_lock:
        kept = _snapshots.get(policy_ref)
    if kept is not None and model_device(kept.model) == device:
        return kept
    return reloaded_policy(store, policy_ref, device=device)


@dataclass
class _Reloadable:
    source: str  # the checkpoint the chain of policies started from (config and tokenizer)
    policy_ref: str  # whose weights the model holds now
    policy: Policy


_reloadable: list[_Reloadable] = []  # at most one: a sampler samples one policy at a time


def reloaded_policy(store: Store, policy_ref: str, *, device: torch.device) -> Policy:
    """The policy named by `policy_ref`, loaded from the store, for a sampler that samples one policy after
    another (flow.sampler=process): the model built for the previous one gets the new stored weights in place,
    since building a model every step would cost more than a small model's whole step. Anything else (LoRA,
    sharded or unstored weights, another chain or device) is built afresh. Callers must not keep the returned
    policy past their next call."""
    source = source_checkpoint(store, policy_ref)
    kept = _reloadable[0] if _reloadable else None
    if kept is not None and kept.source == source and model_device(kept.policy.model) == device:
        if kept.policy_ref == policy_ref:
            return kept.policy
        weights = _plain_weights(store, policy_ref)
        if weights is not None and _load_in_place(kept.policy.model, weights):
            kept.policy_ref = policy_ref
            return kept.policy
    policy = _stored_policy(store, policy_ref, device)
    _reloadable[:] = [_Reloadable(source, policy_ref, policy)]
    return policy


def _plain_weights(store: Store, policy_ref: str) -> dict[str, torch.Tensor] | None:
    """The tensors of `policy_ref`'s stored `model.safetensors` when that one file holds all its weights."""
    artifact = weights_artifact(store, policy_ref)
    if not holds_weights(store, artifact):
        return None
    files = _files(store, artifact, is_weights_file)  # the optimizer state left out, as everywhere
    return safetensors_load(files["model.safetensors"]) if set(files) == {"model.safetensors"} else None


def _load_in_place(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> bool:
    """Copy `weights` into `model`'s parameters; False (model untouched or partly written, so the caller
    builds afresh) unless every parameter is either loaded or tied to a loaded one."""
    result = model.load_state_dict(weights, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {param.data_ptr() for name, param in params.items() if name in weights}
    untied = [name for name in result.missing_keys if name not in params or params[name].data_ptr() not in loaded]
    return not result.unexpected_keys and not untied


def checkpoint_built(
    ctx: StageContext,
    files: Mapping[str, bytes],
    n_params: int,
    policy_id: str | None,
    live: Policy | None = None,
    placed: Sequence[Mapping[str, Any]] = (),
    optimizer: torch.optim.Optimizer | None = None,
) -> Built:
    """The `checkpoints` output of the stage in `ctx`: one row naming the checkpoint and where it came
    from, its model directory as files (and `placed`: the entries of files already written into its folder, the
    weights the ranks streamed), the parameter count (later checkpoints copy it from the manifest), and the live
    policy to keep in memory when the stage has one, with `optimizer` (the next training's, when it is already
    made: a policy on the data-parallel ranks is then taken as it is, never read again from the store)."""
    row = {
        "run_id": ctx.run_id,
        "step": ctx.step or 0,
        "artifact_id": ctx.output_ids["checkpoints"],
        "stage": ctx.stage,
        "policy_id": policy_id,
        "n_params": n_params,
    }
    resident = TrainerState(live, optimizer) if live is not None else None
    table = rows_to_table("checkpoints", [row])
    return Built(table, files=files, extra={"n_params": n_params}, resident=resident, placed=placed)


def streamed_checkpoint(
    store: Store, policy_ref: str, artifact_id: str
) -> tuple[dict[str, bytes], list[dict[str, Any]]] | None:
    """`streamed_files` of `policy_ref`'s live policy into checkpoint `artifact_id`; None when none is live."""
    live = RESIDENTS.get(policy_ref)
    return streamed_files(store, live.policy, artifact_id) if isinstance(live, TrainerState) else None


def streamed_files(
    store: Store, policy: Policy, artifact_id: str
) -> tuple[dict[str, bytes], list[dict[str, Any]]] | None:
    """A checkpoint's model directory without the whole weights' bytes in memory: its static files (config,
    tokenizer), and the entry of its `model.safetensors`, streamed into checkpoint `artifact_id`'s folder a tensor
    at a time (by the data-parallel ranks from their shards when they hold the policy; nothing whole in any
    process), the bytes `policy_files` would give. None under LoRA, whose files merge the adapters."""
    if has_lora(policy.model):
        return None
    if policy.ranks is not None:
        entry = policy.ranks.write_weights(str(store.root), "checkpoints", artifact_id)
    else:
        entry = store.place_file("checkpoints", artifact_id, WEIGHTS_FILE, safetensors_chunks(policy.model))
    return static_files(policy), [entry]


def parameter_count(policy: Policy) -> int:
    return sum(p.numel() for p in policy.model.parameters())


@lru_cache(maxsize=2)
def reference_policy(store: Store, policy_ref: str, *, device: torch.device) -> Policy:
    """A frozen policy on `device` to measure KL against (the RL run's starting checkpoint), loaded once per
    process: a committed checkpoint never changes, so keeping it is always right."""
    policy = policy_from_files(policy_files_of(store, policy_ref), device=device)
    for parameter in policy.model.parameters():
        parameter.requires_grad_(False)
    return policy


@dataclass(frozen=True)
class Ranks:
    """Where updates run: `data_parallel` ranks (1: this process alone), the model spread by `sharding`."""

    data_parallel: int = 1
    sharding: Sharding = "fsdp"
    decode: DecodeWeights = "units"  # how fsdp ranks decode (train.decode_weights)


ONE_PROCESS = Ranks()


def take_trainer_state(
    store: Store,
    policy_ref: str,
    lr: float,
    weight_decay: float,
    *,
    device: torch.device,
    ranks: Ranks = ONE_PROCESS,
) -> TrainerState:
    """Model and optimizer on `device` to continue training from `policy_ref`; the caller now owns them. With
    `ranks.data_parallel` > 1 they are the rank group's (trainer/ranks/): sharded over its ranks.

    Taking the state out of memory means a failed update can never leave a half-updated model
    filed under the old reference. A resumed run builds the optimizer over the placed model, so the
    saved moments (CPU tensors in the file) are loaded onto its device.
    """
    live = RESIDENTS.take(policy_ref)
    if not isinstance(live, TrainerState) or model_device(live.policy.model) != device:
        live = None  # nothing live here, or on another device: load from the store
    if live is not None and live.optimizer is not None:
        return distributed(live, ranks, device, lr, weight_decay)
    if not holds_weights(store, weights_artifact(store, policy_ref)):
        rebuilt = rebuilt_state(store, policy_ref, device=device)  # a step between stored states
        return distributed(rebuilt, ranks, device, lr, weight_decay)
    if holds_sharded_state(store, weights_artifact(store, policy_ref)):
        return sharded_state(store, policy_ref, ranks, device, lr, weight_decay)
    if ranks.data_parallel > 1 and one_weights_file(store, policy_ref):
        live = None  # a whole copy in memory is let go before the ranks read their slices
        return adopted_by_slices(store, policy_ref, ranks, device, lr, weight_decay)
    policy = live.policy if live is not None else load_policy(store, policy_ref, device=device)
    state = TrainerState(policy, stored_optimizer(store, policy_ref, policy, lr, weight_decay))
    return distributed(state, ranks, device, lr, weight_decay)


def sharded_state(
    store: Store, policy_ref: str, ranks: Ranks, device: torch.device, lr: float, weight_decay: float
) -> TrainerState:
    """The trainer state of `policy_ref` from its sharded state: read by the rank group at its own rank count
    (each rank the slices its shards need), or whole by this process alone."""
    if ranks.data_parallel == 1:
        return plain_from_state(store, policy_ref, device=device, lr=lr, weight_decay=weight_decay)
    artifact, static, dtype = _sharded_state_of(store, policy_ref)
    group = rank_group(ranks.data_parallel, ranks.sharding, device, torch.get_num_threads(), ranks.decode)
    policy, optimizer = group.load_state(static, dtype, str(store.root), artifact, lr, weight_decay)
    return TrainerState(policy, optimizer)


def one_weights_file(store: Store, policy_ref: str) -> bool:
    """Whether `policy_ref` is a checkpoint whose weights are one safetensors file and nothing else trained (no
    optimizer state, no LoRA adapters): what the ranks can read by slices (`adopted_by_slices`)."""
    if weights_artifact(store, policy_ref) != policy_ref or store.manifest(policy_ref).kind != "checkpoints":
        return False
    names = {entry["path"].removeprefix("files/") for entry in store.manifest(policy_ref).binary_files}
    return {name for name in names if is_weights_file(name)} == {WEIGHTS_FILE} and OPTIMIZER_FILE not in names


def adopted_by_slices(
    store: Store, policy_ref: str, ranks: Ranks, device: torch.device, lr: float, weight_decay: float
) -> TrainerState:
    """Checkpoint `policy_ref` adopted by the run's rank group without its whole weights in any process: rank 0
    checks the file against its manifest (hashed in chunks), then every rank reads the slices its shards need."""
    static, dtype = checked_weights_file(store, policy_ref)
    group = rank_group(ranks.data_parallel, ranks.sharding, device, torch.get_num_threads(), ranks.decode)
    policy, optimizer = group.load_state(static, dtype, str(store.root), policy_ref, lr, weight_decay, whole_file=True)
    return TrainerState(policy, optimizer)


def checked_weights_file(store: Store, policy_ref: str) -> tuple[dict[str, bytes], torch.dtype]:
    """The static files and weights dtype of checkpoint `policy_ref`, whose one weights file is checked against its
    manifest (hashed in chunks, never whole in memory)."""
    manifest, path = store.manifest(policy_ref), store.file_path(policy_ref, WEIGHTS_FILE)
    entry = next(e for e in manifest.binary_files if e["path"] == f"files/{WEIGHTS_FILE}")
    problem = file_problem(store.fs, path, entry)
    if problem is not None:
        raise DamagedArtifact(damage_message(manifest, path, problem), policy_ref, path)
    return _files(store, policy_ref, lambda name: not is_weights_file(name)), stored_file_dtype(store, path)


def file_chunks(store: Store, artifact_id: str, name: str, size: int = 64 << 20) -> Iterator[bytes]:
    """A stored file's bytes, `size` at a time (a checkpoint copied without its weights whole in memory)."""
    with store.fs.open(store.file_path(artifact_id, name), "rb") as handle:
        while chunk := handle.read(size):
            yield chunk


def kl_reference(store: Store, policy_ref: str, *, device: torch.device, group: RankGroup | None) -> Policy | None:
    """The frozen KL reference of an update: whole in this process (`reference_policy`), or, for a policy held by a
    data-parallel rank `group`, read by its ranks as slices of the checkpoint's weights file (None here: the group
    holds it)."""
    if group is None or not one_weights_file(store, policy_ref):
        return reference_policy(store, policy_ref, device=device)
    if group.reference_id != policy_ref:  # checked (hashed) once a run, not at every step
        static, dtype = checked_weights_file(store, policy_ref)
        group.read_reference(static, dtype, str(store.root), policy_ref)
    return None


def stored_file_dtype(store: Store, path: str) -> torch.dtype:
    """The dtype of a safetensors file's tensors, read from its header alone."""
    with store.fs.open(path, "rb") as handle:
        length = struct.unpack("<Q", handle.read(8))[0]
        header = json.loads(handle.read(length))
    dtypes = {value["dtype"] for name, value in header.items() if name != "__metadata__"}
    names = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in names:
        raise ValueError(f"{path}: weights of dtypes {sorted(dtypes)}, not one floating dtype")
    return names[next(iter(dtypes))]


def distributed(
    state: TrainerState, ranks: Ranks, device: torch.device, lr: float, weight_decay: float
) -> TrainerState:
    """`state` as `ranks` train it: as it is for one process or when already the group's, else adopted by this
    process's rank group (the whole policy and optimizer state go to the ranks, which shard them)."""
    if ranks.data_parallel == 1 or state.policy.ranks is not None:
        return state
    group = rank_group(ranks.data_parallel, ranks.sharding, device, torch.get_num_threads(), ranks.decode)
    policy, optimizer = group.adopt(state.policy, state.optimizer, lr, weight_decay)
    return TrainerState(policy, optimizer)


def stored_optimizer(
    store: Store, policy_ref: str, policy: Policy, lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """An optimizer over `policy` with the moments stored beside the weights of `policy_ref` (fresh at a
    checkpoint, which stores none)."""
    optimizer = make_optimizer(policy, lr=lr, weight_decay=weight_decay)
    source = weights_artifact(store, policy_ref)
    names = {f["path"] for f in store.manifest(source).files}
    if f"files/{OPTIMIZER_FILE}" in names:
        load_optimizer_state(optimizer, store.read_file(source, OPTIMIZER_FILE))
    return optimizer


def rebuilt_state(store: Store, policy_ref: str, *, device: torch.device | None = None) -> TrainerState:
    """The trainer state after `policy_ref`, rebuilt from the newest stored state before it by replaying the
    updates of the train steps between, each from its committed inputs and recorded settings: the same
    computation as the run's, so on the CPU the same bits. `device` defaults to the CPU."""
    device = device or torch.device("cpu")
    chain = policy_chain(store, policy_ref)
    if chain is None:
        raise UserError(
            f"the weights of policy {policy_ref} are no longer stored in {store.root} (only a run's newest "
            'trainer state is kept); use a checkpoint: rlvr query "SELECT step, artifact_id FROM checkpoints"'
        )
    first = GRPOConfig.model_validate(_grpo_settings(store, chain.replay[0])) if chain.replay else GRPOConfig()
    ranks = _recorded_ranks(store, chain.replay[0]) if chain.replay else ONE_PROCESS
    if holds_sharded_state(store, weights_artifact(store, chain.base)):  # read by the ranks that replay
        state = sharded_state(store, chain.base, ranks, device, first.lr, first.weight_decay)
    else:
        policy = policy_from_files(policy_files_of(store, chain.base), device=device)
        state = TrainerState(policy, stored_optimizer(store, chain.base, policy, first.lr, first.weight_decay))
    for train_steps_id in chain.replay:
        replay_update(store, state, train_steps_id, device)
    return state


def _grpo_settings(store: Store, train_steps_id: str) -> dict[str, object]:
    settings = dict(store.manifest(train_steps_id).config)
    settings.pop("state_every", None)
    return settings


def _recorded_ranks(store: Store, train_steps_id: str) -> Ranks:
    """The ranks a train step ran its update on (recorded in its manifest), which its replay uses again."""
    extra = store.manifest(train_steps_id).extra
    return Ranks(int(extra.get("data_parallel", 1)), extra.get("sharding", "fsdp"))


def replay_update(store: Store, state: TrainerState, train_steps_id: str, device: torch.device) -> None:
    """Apply the update train step `train_steps_id` made to `state` again, from its committed inputs."""
    manifest = store.manifest(train_steps_id)
    grpo = GRPOConfig.model_validate(_grpo_settings(store, train_steps_id))
    inputs = Inputs(store, manifest.extra["stage_run"]["inputs"])
    assert state.optimizer is not None
    ranks = _recorded_ranks(store, train_steps_id)
    if ranks.data_parallel > 1 and state.policy.ranks is None:  # replayed on the ranks that made it: same sums
        adopted = distributed(state, ranks, device, grpo.lr, grpo.weight_decay)
        state.policy, state.optimizer = adopted.policy, adopted.optimizer
    assert state.optimizer is not None
    reference = None
    if grpo.kl_beta > 0:
        reference = kl_reference(store, inputs.require_id("reference"), device=device, group=state.policy.ranks)
    update_policy(state.policy, state.optimizer, step_batch(inputs, grpo), grpo, reference)
