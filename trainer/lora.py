"""LoRA through peft (the `lora` extra): low-rank adapters on chosen linear layers; the rest stays frozen.

The adapters are injected into the Hugging Face model itself (`peft.inject_adapter_in_model`), so every
stage keeps working on a plain causal LM. Files keep the contract of trainer/policy.py: `model.safetensors`
holds the *merged* weights (W + scale·BA) under the model's own names, so a checkpoint still loads with
`from_pretrained` (vLLM, a server, a user); `adapter.lora` (safetensors bytes) holds the adapters and the base
weights of the adapted layers, and `lora.json` the settings, from which `policy_from_files`
rebuilds the trainable model exactly (merging is not invertible in floating point, so the base weights
travel too). Only adapter parameters get gradients and optimizer state.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from rlvr.errors import UserError
from rlvr.trainer.rng import seeded_rng

# Not `*.safetensors`: vLLM and other loaders read every such file of a model directory as its weights.
ADAPTER_FILE = "adapter.lora"  # safetensors bytes
SETTINGS_FILE = "lora.json"
_ADAPTER = "default"  # peft's adapter name; one adapter per policy


class LoraSettings(BaseModel):
    """`policy.lora`: rank, scale (alpha / r) and which linear layers (module name suffixes) get adapters."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(default=8, ge=1)
    alpha: float = Field(default=16.0, gt=0)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1)


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise UserError("policy.lora needs peft: pip install 'rlvr-pipeline[lora]' (or pip install peft)") from None
    return peft


def add_lora(model: torch.nn.Module, settings: LoraSettings, seed: int) -> None:
    """Inject adapters (B = 0, so the model computes what it did; A drawn from `seed`) and freeze the rest.

    Dropout on the adapters stays 0: the loss must see the network the sampler saw.
    """
    peft = _peft()
    config = peft.LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=0.0,
        target_modules=settings.target_modules,
        bias="none",
    )
    with seeded_rng(seed):
        try:
            peft.inject_adapter_in_model(config, model, adapter_name=_ADAPTER)
        except ValueError as exc:
            raise UserError(f"policy.lora.target_modules {settings.target_modules}: {exc}".splitlines()[0]) from None
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".lora_" in name)


def _adapted(model: torch.nn.Module) -> dict[str, Any]:
    """Module name -> LoRA layer, for every adapted layer."""
    return {name: module for name, module in model.named_modules() if hasattr(module, "lora_A")}


def has_lora(model: torch.nn.Module) -> bool:
    return bool(_adapted(model))


def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under their plain names with every adapter merged in (what `from_pretrained` reads);
    tied tensors stay shared, so `policy.stored_state` stores them once."""
    adapted = _adapted(model)
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        if owner and leaf == "weight":
            tensor = tensor + adapted[owner].get_delta_weight(_ADAPTER).to(tensor.dtype)
        merged[f"{owner}.{leaf}" if owner else name] = tensor
    return merged


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters and the base weights of the layers they adapt, under the injected model's names."""
    return {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if ".lora_" in name or ".base_layer." in name
    }


def settings_bytes(settings: LoraSettings) -> bytes:
    return settings.model_dump_json().encode("utf-8")


def settings_of(model: torch.nn.Module) -> LoraSettings:
    """The settings the adapters of `model` were injected with."""
    adapted = _adapted(model)
    first = next(iter(adapted.values()))
    suffixes = sorted({name.rsplit(".", 1)[-1] for name in adapted})
    return LoraSettings(r=first.r[_ADAPTER], alpha=first.lora_alpha[_ADAPTER], target_modules=suffixes)


def restore_lora(model: torch.nn.Module, files: dict[str, bytes]) -> None:
    """Turn a model loaded from merged weights back into the adapted model those files were written from."""
    from safetensors.torch import load as safetensors_load

    settings = LoraSettings.model_validate(json.loads(files[SETTINGS_FILE]))
    add_lora(model, settings, seed=0)  # the drawn A is replaced just below
    saved = safetensors_load(files[ADAPTER_FILE])
    expected = set(adapter_state(model))
    if set(saved) != expected:
        raise ValueError(
            f"{ADAPTER_FILE} does not match the model's adapters ({len(saved)} vs {len(expected)} tensors)"
        )
    model.load_state_dict(saved, strict=False)
