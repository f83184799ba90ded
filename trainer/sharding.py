"""A policy's model spread over the data-parallel ranks with FSDP2 (`torch.distributed.fsdp.fully_shard`).

`train.sharding` picks how (`shard`):
- `fsdp`: parameters, gradients and optimizer state are split over the ranks, each decoder layer one unit (its
  weights gathered for its forward and backward only) and the rest (embeddings, final norm, LM head) the root's.
- `replicate`: every rank holds everything and gradients are all-reduced: FSDP2's hybrid mode over a
  (ranks x 1) mesh, i.e. torch's replication through the same wrapper, so both strategies share one code path.

On a GPU the units compute in bf16 and reduce gradients in float32 over float32 master weights
(`MixedPrecisionPolicy`); on the CPU everything stays float32. Gradients are *summed* over the ranks (the divide
factor is 1): each rank weights its loss by its share of the whole minibatch (trainer/distributed.py), so the
sum is the one-process gradient.

Every forward of a sharded unit gathers its weights, a collective: all ranks must run the same passes.
`whole_weights` gathers everything once so that each rank can then decode on its own for as many steps as its
prompts need (rollouts and evaluations on every rank).
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from rlvr.trainer.state_tensors import first_names, local

Sharding = Literal["fsdp", "replicate"]
SHARDINGS: tuple[Sharding, ...] = ("fsdp", "replicate")
# how fsdp ranks decode: a unit gathered at a time in lockstep (trainer/lockstep_decoding.py), or from the whole
# weights gathered once a call (`whole_weights`): faster, when the whole model fits on each device
DecodeWeights = Literal["units", "whole"]
DCP_PREFIX = "dcp"  # a state file's name in the store: "dcp" + DCP's own name (".metadata", "__0_0.distcp")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers, the FSDP units: the modules of the classes its `_no_split_modules` names
    (every transformers decoder declares them)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    # by class name through the class's bases too: once sharded, a layer's class is FSDP2's subclass of it
    layers = [m for m in model.modules() if any(base.__name__ in names for base in type(m).__mro__)]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules) to shard by")
    return layers


def mesh_for(sharding: Sharding, device: torch.device) -> DeviceMesh:
    """fsdp: one dimension over every rank; replicate: (ranks, 1), FSDP2's hybrid mode with shards of one."""
    world = dist.get_world_size()
    if sharding == "fsdp":
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(device.type, (world, 1), mesh_dim_names=("replicate", "shard"))


def shard(model: torch.nn.Module, sharding: Sharding, device: torch.device) -> None:
    """Wrap `model` in place (its class becomes an FSDPModule subclass; parameters become DTensors)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"train.sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
    mesh = mesh_for(sharding, device)
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    mixed = device.type == "cuda" and floats == {torch.float32}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    options: dict[str, Any] = {"mesh": mesh, **({"mp_policy": policy} if policy is not None else {})}
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    for unit in units(model):  # sums, by plain SUM reductions (gloo has no pre-multiplied sum)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


def units(model: torch.nn.Module) -> list[FSDPModule]:
    """The FSDP units of a sharded model, root last."""
    found: list[FSDPModule] = [module for module in model.modules() if isinstance(module, FSDPModule)]
    return found[::-1]


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


@contextmanager
def whole_weights(model: torch.nn.Module) -> Iterator[None]:
    """Every unit's weights gathered (a collective: every rank enters together), and kept whole through every
    forward inside, so that each rank may then run as many forwards as it needs on its own; resharded on exit
    (no collective)."""
    found = units(model)
    before = [_reshards_after_forward(unit) for unit in found]
    for unit in found:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        for unit in found:
            unit.unshard()
        yield
    finally:
        for unit, setting in zip(found, before):
            unit.reshard()
            unit.set_reshard_after_forward(setting, recurse=False)


@contextmanager
def resharded(model: torch.nn.Module) -> Iterator[None]:
    """Forwards inside gather each unit for its own pass only (FSDP2's default), and on exit every unit is
    resharded, the root too (which FSDP2 otherwise keeps gathered after a forward, for the backward that follows;
    a pass without one would leave it so). No collective of its own."""
    try:
        yield
    finally:
        for unit in units(model):
            unit.reshard()


def _reshards_after_forward(unit: FSDPModule) -> bool:
    """Whether a unit frees its gathered weights after each forward (FSDP2's default: every unit but the root,
    which keeps them for the backward that follows)."""
    group = unit._get_fsdp_state()._fsdp_param_group  # FSDP2 has no public getter
    return bool(group is not None and group._reshard_after_forward)


@contextmanager
def accumulating(model: torch.nn.Module) -> Iterator[None]:
    """Backward passes inside keep their gradients on the rank (no reduction): gradient accumulation over
    micro-batches, reduced by the next backward outside."""
    found = units(model)
    for unit in found:
        unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for unit in found:
            unit.set_requires_gradient_sync(True, recurse=False)


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """The bytes of parameters, gradients and optimizer state this rank holds (its shards only), counted."""
    params = [p for p in model.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    state = [
        value
        for entry in (optimizer.state.values() if optimizer is not None else ())
        for value in entry.values()
        if isinstance(value, torch.Tensor)
    ]
    size = lambda tensors: sum(local(t).numel() * local(t).element_size() for t in tensors)  # noqa: E731
    return {"parameters": size(params), "gradients": size(grads), "optimizer": size(state)}


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on the CPU under their plain names, on rank 0 (a collective; the other ranks
    get an empty dict)."""
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: value for name, value in whole.items() if isinstance(value, torch.Tensor)}


def load_whole(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any] | None,
) -> None:
    """Rank 0's whole weights (and optimizer state, FSDP's full form keyed by parameter names) into every
    rank's shards (a collective; the other ranks pass empty dicts and None)."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, dict(weights), options=options)
    if optimizer is not None and optimizer_state is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)


def plain_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A one-process optimizer's state in FSDP's full form (keyed by parameter names), for `load_whole`."""
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """The model's and optimizer's shards with torch.distributed.checkpoint into `directory` (a collective:
    each rank writes its own `__<rank>_0.distcp`, rank 0 also `.metadata`), with the buffers no state dict holds
    (rotary frequencies); loadable at any rank count (`load_sharded`)."""
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "buffers": unsaved_buffers(model),
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), single_file_per_rank=True))


def load_sharded(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, directory: Path, *, alone: bool
) -> None:
    """Inverse of `save_sharded` into a model built without weights (to_empty) and an optimizer over it: each
    rank of the default group reads the slices its shards need, or, `alone`, this process reads everything into
    its whole model (no collective, whether or not a group exists)."""
    state: dict[str, Any] = {"model": get_model_state_dict(model), "buffers": unsaved_buffers(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    with warnings.catch_warnings():  # alone: DCP warns that it "assumes" one process, which is what is asked
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=alone)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    for name, value in state["buffers"].items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[leaf] = value


def load_hf_weights(model: torch.nn.Module, directory: Path) -> None:
    """The weights of the Hugging Face safetensors files in `directory` into a sharded model built without them
    (`to_empty`), each rank reading only the slices its shards need (DCP's Hugging Face reader opens the files with
    safetensors' `safe_open` and reads slices: no rank, rank 0 included, holds a whole copy). Tied tensors are read
    under their first name, as the file stores them, and the model's non-persistent buffers (rotary frequencies)
    are computed again from its config on the device."""
    unique = first_names(get_model_state_dict(model))
    dcp.load(unique, storage_reader=dcp.HuggingFaceStorageReader(str(directory)))
    set_model_state_dict(model, unique, options=StateDictOptions(strict=False))
    rebuild_buffers(model)


def rebuild_buffers(model: torch.nn.Module) -> None:
    """Compute the buffers no state dict holds (each module's non-persistent buffers, left empty by `to_empty`)
    by building that module again from the model's config on the buffers' device; a module whose class is not
    built from a config alone (transformers' rotary embeddings are) raises ValueError."""
    kept = set(model.state_dict())
    owners = {name.rpartition(".")[0] for name, _ in model.named_buffers() if name not in kept}
    for owner in sorted(owners):
        module = model.get_submodule(owner) if owner else model
        device = next(module.buffers()).device
        try:
            with torch.device(device):
                fresh = type(module)(getattr(module, "config", None) or model.config)
        except TypeError as refused:
            raise ValueError(f"{type(module).__name__} is not built from a config alone: {refused}") from None
        for leaf, buffer in fresh.named_buffers(recurse=False):
            if f"{owner}.{leaf}".lstrip(".") not in kept:
                module._buffers[leaf] = buffer


def unsaved_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict leaves out (non-persistent: computed at build time, which the meta device
    skips), by name."""
    kept = set(model.state_dict())
    return {name: buffer for name, buffer in model.named_buffers() if name not in kept}


def stored_name(dcp_name: str) -> str:
    """The store's name for one of DCP's files (the store's names start with a letter or digit)."""
    return f"{DCP_PREFIX}{dcp_name}"


def dcp_name(stored: str) -> str | None:
    """Inverse of `stored_name`; None for a file that is not part of a DCP state."""
    return (
        stored[len(DCP_PREFIX) :]
        if stored.startswith(f"{DCP_PREFIX}.") or stored.startswith(f"{DCP_PREFIX}__")
        else None
    )


@contextmanager
def scratch_dir(prefix: str = "rlvr-dcp-") -> Iterator[Path]:
    """A private temp directory, removed on exit."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)
