"""A pretrained model directory turned into a run's first checkpoint without the model whole in any process.

With data-parallel ranks the run's process never needs the starting policy in memory: the ranks read their slices
of the stored checkpoint (trainer/checkpoints.py, `adopted_by_slices`). So `initialize` builds the model on the
meta device (its config, tokenizer and generation settings, no weights), and writes the checkpoint's one
`model.safetensors` a tensor at a time from the directory's safetensors files (one file or an index of shards),
each cast to the run's dtype: the bytes `policy_files` writes for the model `from_pretrained` loads. A directory
whose tensor names or shapes are not the model's own (an architecture transformers converts while loading) gives
None, and the caller loads the model whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from rlvr.trainer.streamed_weights import header_bytes, safetensors_order

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def tensor_files(directory: Path) -> dict[str, Path] | None:
    """Each stored tensor's name and the file that holds it; None for a directory without safetensors weights."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / SINGLE_FILE
    if not single.is_file():
        return None
    with safe_open(str(single), framework="pt") as handle:
        return {name: single for name in handle.keys()}  # noqa: SIM118 (safe_open is not iterable)


def meta_model(directory: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The directory's model on the meta device in `dtype`, with its generation settings: shapes, no weights."""
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory, local_files_only=True)
    return model


def stored_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The (meta) model's state tensors, each tied one once under its first name, in safetensors' order (largest
    element first, then by name). Tied meta tensors share no storage to compare, so parameters are compared."""
    seen: set[int] = set()
    found = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            found.append((name, tensor))
    return safetensors_order(found)


def weights_chunks(model: torch.nn.Module, directory: Path, dtype: torch.dtype) -> Iterator[bytes] | None:
    """`model.safetensors` of `model` (built by `meta_model`) read from `directory`, a tensor at a time; None when
    a tensor of the model is missing from the directory's files or stored in another shape."""
    files = tensor_files(directory)
    if files is None:
        return None
    tensors = stored_tensors(model)
    for name, tensor in tensors:
        if name not in files:
            return None
        with safe_open(str(files[name]), framework="pt") as handle:
            if list(handle.get_slice(name).get_shape()) != list(tensor.shape):
                return None
    return _chunks(tensors, files, dtype)


def _chunks(tensors: list[tuple[str, torch.Tensor]], files: dict[str, Path], dtype: torch.dtype) -> Iterator[bytes]:
    yield header_bytes(tensors, {"format": "pt"})
    for name, _ in tensors:
        with safe_open(str(files[name]), framework="pt") as handle:
            value = handle.get_tensor(name).to(dtype).contiguous()
        data = value.view(torch.uint8).numpy().tobytes() if value.numel() else b""
        del value  # one tensor at a time, as the store writes each chunk
        yield data
