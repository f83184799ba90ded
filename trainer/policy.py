"""The policy being trained: model + tokenizer, how it is created, and how it becomes bytes and back.

Checkpoints are plain Hugging Face model directories (as a dict of file name -> bytes), so any stage,
vLLM or a user can load them with `from_pretrained`; the optimizer state travels as separate bytes.
"""

import json
import struct
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from weakref import WeakKeyDictionary

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as transformers_logging

from rlvr.errors import UserError
from rlvr.trainer.devices import (
    CPU,
    DEFAULT_DEVICE,
    DEVICE_FORMS,
    WEIGHTS_DTYPES,
    WeightsDtype,
    check_device_name,
    model_device,
    resolve_device,
)
from rlvr.trainer.gguf_models import dequantised_directory, gguf_file, require_gguf_reader
from rlvr.trainer.lora import (
    ADAPTER_FILE,
    SETTINGS_FILE,
    LoraSettings,
    adapter_state,
    add_lora,
    has_lora,
    merged_state,
    restore_lora,
    settings_bytes,
    settings_of,
)
from rlvr.trainer.state_tensors import first_names
from rlvr.trainer.tiny_model import TinyModelConfig, build_tiny_model, build_tiny_tokenizer

WEIGHTS_FILE = "model.safetensors"  # a single-file model's weights, as save_pretrained names them

# Checkpoints are written and read every RL step; per-call progress bars would flood the console.
transformers_logging.disable_progress_bar()


class PolicyConfig(BaseModel):
    """Which model to start from, where it runs, in what precision its weights are, and how many CPU threads
    torch may use.

    `model`: "tiny" (built in, no download), a local Hugging Face model directory, a hub id that is
    already in the local Hugging Face cache (nothing is downloaded), a `.gguf` file, or the name of a model
    that an installed package ships as GGUF ("smollm2-135m-instruct", from `make smollm2`); a GGUF model is
    dequantised once into a cached model directory (trainer/gguf_models.py). `checkpoint`: the id of a
    `checkpoints` artifact in the same store to start from instead (it overrides `model`; the run's
    initial checkpoint then has it as its parent, so lineage crosses runs; recurring schedules set it).
    `threads` is fixed, not "all cores", because CPU matmul results depend on the thread count: a
    fixed count keeps runs bit-identical across machines and processes.

    `device` is where every stage of the run puts its models (trainer/devices.py); it says where work runs,
    not what it computes, so no artifact id depends on it. `dtype` is the precision the weights are stored
    and computed in from `initialize` on: float32 (the default; on a GPU, train under `train.grpo.autocast:
    bf16`) or bfloat16 (half the weight memory, and AdamW's moments are then bf16 too: docs/methods.md,
    "Device and precision"). Later stages load a checkpoint in the dtype it was stored in.
    """

    model_config = ConfigDict(extra="forbid")

    model: str = "tiny"
    checkpoint: str | None = None
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    threads: int = Field(default=1, ge=1)
    lora: LoraSettings | None = Field(default=None, description="train LoRA adapters only (peft; trainer/lora.py)")
    device: str = Field(default=DEFAULT_DEVICE, description=f"{DEVICE_FORMS}: where every stage runs the model")
    dtype: WeightsDtype = Field(
        default="float32", description="weights' precision: float32 (with bf16 autocast on a GPU) or bfloat16"
    )

    @field_validator("device")
    @classmethod
    def _known_device(cls, name: str) -> str:
        return check_device_name(name)


@dataclass
class Policy:
    """A causal LM, its tokenizer (left padding, pad token set) and where it came from. `ranks`: the data-parallel
    group the model is sharded over (trainer/ranks/launch.py), whose operations every use of it goes through;
    None for a model whole in this process."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: str
    ranks: Any = field(default=None, repr=False, compare=False)
    # on a rank, during a decoding operation over fsdp shards: its rounds (trainer/lockstep_decoding.py)
    lockstep: Any = field(default=None, repr=False, compare=False)


def set_threads(threads: int) -> None:
    """Fix torch's intra-op threads (see PolicyConfig.threads for why)."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _prepare(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, source: str, dtype: torch.dtype = torch.float32
) -> Policy:
    """Left padding and a pad token are what batched generation and the loss expect; dropout stays off
    so that the logprobs of the sampler and of the trainer agree. The weights are cast to `dtype`."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if dtype == torch.float32:
        model.float()
    else:
        torch.nn.Module.to(model, dtype=dtype)  # transformers' decorated .to is opaque to mypy
    model.eval()
    return Policy(model=model, tokenizer=tokenizer, source=source)


# transformers builds a model under process-wide switches (empty weights on the meta device, skipped inits);
# two threads building at once (flow.async_level: the sampler loads a policy while the trainer loads its own)
# break each other's models, so every build in this process holds this lock.
MODEL_BUILD_LOCK = threading.RLock()


def _load_directory(path: str, source: str, local_files_only: bool, dtype: torch.dtype = torch.float32) -> Policy:
    with MODEL_BUILD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=local_files_only)
        tokenizer = load_tokenizer(path, local_files_only=local_files_only)
        return _prepare(model, tokenizer, source, dtype)


GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(path: str, local_files_only: bool = True) -> PreTrainedTokenizerBase:
    """The tokenizer saved in directory `path`, as it was saved. `AutoTokenizer` picks the class of the model's
    type from config.json (Qwen2Tokenizer for a Qwen2 model), which rebuilds a generic tokenizer's pipeline: the
    tiny built-in model's then encoded every letter as nothing at all (so a multi-turn environment's messages
    became no tokens). A tokenizer saved as the generic class is loaded as that class, from its tokenizer.json."""
    config_file = Path(path) / "tokenizer_config.json"
    if config_file.is_file() and (Path(path) / "tokenizer.json").is_file():
        saved_class = json.loads(config_file.read_text()).get("tokenizer_class")
        if saved_class in GENERIC_TOKENIZER_CLASSES:
            return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=local_files_only)
    return AutoTokenizer.from_pretrained(path, local_files_only=local_files_only)


def place(policy: Policy, device: torch.device) -> Policy:
    """The policy with its model on `device` (moved in place; a model already there, as every model of a CPU
    run is, is left alone). Checkpoints are made from CPU copies of the weights whatever the device."""
    if model_device(policy.model) != device:
        torch.nn.Module.to(policy.model, device)  # transformers' decorated .to is opaque to mypy
    return policy


def _looks_like_path(name: str) -> bool:
    """A hub id is `name` or `org/name`; anything else (./x, /x, ~/x, a/b/c) is meant as a directory."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def init_policy(cfg: PolicyConfig, seed: int) -> Policy:
    """The starting policy of a run, in `cfg.dtype` on `cfg.device`. `seed` draws the tiny model's initial
    weights and LoRA's A matrices (both on the CPU, so a seed gives the same model on every device)."""
    device = resolve_device(cfg.device)
    policy = _base_policy(cfg, seed)
    if cfg.lora is not None:
        add_lora(policy.model, cfg.lora, seed)
    return place(policy, device)


def check_policy_source(cfg: PolicyConfig) -> str:
    """Where `policy.model` points, checked without loading anything: "tiny", a model directory, or a hub id
    found in the local Hugging Face cache; a one-line UserError otherwise. Runs call it before any stage."""
    if cfg.model == "tiny":
        return "tiny"
    packed = gguf_file(cfg.model)
    if packed is not None:
        require_gguf_reader()
        return str(packed)
    path = Path(cfg.model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(
                f"model directory '{cfg.model}' has no config.json; "
                "point policy.model at a Hugging Face model directory"
            )
        return str(path)
    if path.exists():
        raise UserError(
            f"policy.model '{cfg.model}' is a file, not a model directory; point it at a Hugging Face model directory"
        )
    if _looks_like_path(cfg.model) or not _in_hub_cache(cfg.model):
        raise UserError(
            f"policy.model '{cfg.model}' is neither a model directory here nor a model in the local Hugging Face "
            "cache, and this machine does not download from the hub; set policy.model to 'tiny' or to an "
            "existing Hugging Face model directory"
        )
    return cfg.model


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repo id
        return False
    return isinstance(found, str)


def meta_policy(cfg: PolicyConfig) -> tuple[Policy, Path] | None:
    """The policy `init_policy` would load from a model directory (or the hub cache), built on the meta device:
    its config, tokenizer and generation settings, no weights; and the directory. None for the tiny model and
    LoRA, whose starting weights are made, not read."""
    from huggingface_hub import try_to_load_from_cache

    from rlvr.trainer.directory_weights import meta_model

    source = check_policy_source(cfg)
    if source == "tiny" or cfg.lora is not None:
        return None
    path = Path(source).expanduser()
    if source.endswith(".gguf"):  # dequantised once into a cached directory (whole, the first time only)
        directory, named = dequantised_directory(path), cfg.model
    elif path.is_dir():
        directory, named = path, str(path.resolve())
    else:
        directory, named = Path(str(try_to_load_from_cache(source, "config.json"))).parent, source
    dtype = WEIGHTS_DTYPES[cfg.dtype]
    with MODEL_BUILD_LOCK:
        model = meta_model(directory, dtype)
        tokenizer = load_tokenizer(str(directory))
        return _prepare(model, tokenizer, named, dtype), directory


def _base_policy(cfg: PolicyConfig, seed: int) -> Policy:
    set_threads(cfg.threads)
    source = check_policy_source(cfg)
    dtype = WEIGHTS_DTYPES[cfg.dtype]
    if source == "tiny":
        with MODEL_BUILD_LOCK:
            return _prepare(build_tiny_model(cfg.tiny, seed), build_tiny_tokenizer(), "tiny", dtype)
    if source.endswith(".gguf"):
        return _load_directory(str(dequantised_directory(Path(source))), cfg.model, local_files_only=True, dtype=dtype)
    resolved = str(Path(source).resolve()) if Path(source).expanduser().is_dir() else source
    return _load_directory(source, resolved, local_files_only=True, dtype=dtype)


def _saved_files(policy: Policy) -> dict[str, bytes]:
    """What `save_pretrained` writes for the model and tokenizer, read back as bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        policy.model.save_pretrained(tmp)
        policy.tokenizer.save_pretrained(tmp)
        return {
            path.relative_to(tmp).as_posix(): path.read_bytes()
            for path in sorted(Path(tmp).rglob("*"))
            if path.is_file()
        }


def plain_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Every weight under the name a plain model has (LoRA adapters merged in), tied ones under each name, as
    `state_dict` lists them: what vLLM's weight reload takes (it leaves a tied `lm_head` it is not sent stale)."""
    return merged_state(model) if has_lora(model) else model.state_dict()


def stored_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """`plain_state` with each shared (tied) tensor once, under its first name: what `save_pretrained` writes,
    on the CPU (a checkpoint loads on any machine)."""
    # the same tensor when it is on the CPU
    return {name: tensor.detach().to(CPU).contiguous() for name, tensor in first_names(plain_state(model)).items()}


def weights_bytes(model: PreTrainedModel) -> bytes:
    """`stored_state` as one safetensors file: the same bytes `save_pretrained` writes for a single-file model,
    without a temp directory."""
    return safetensors_save(stored_state(model), metadata={"format": "pt"})


# Everything but the weights (config, tokenizer, generation config) per model object: it does not
# change while training, and re-saving it every RL step cost more than the step's own bookkeeping.
_static_files: "WeakKeyDictionary[PreTrainedModel, dict[str, bytes]]" = WeakKeyDictionary()


def static_files(policy: Policy) -> dict[str, bytes]:
    """The files of the policy's directory that training never changes (config, generation config, tokenizer,
    LoRA settings), written without serialising the weights (what data-parallel ranks build a model from)."""
    cached = _static_files.get(policy.model)
    if cached is not None:
        return dict(cached)
    with tempfile.TemporaryDirectory() as tmp:
        policy.model.config.save_pretrained(tmp)
        policy.model.generation_config.save_pretrained(tmp)
        policy.tokenizer.save_pretrained(tmp)
        files = {p.relative_to(tmp).as_posix(): p.read_bytes() for p in sorted(Path(tmp).rglob("*")) if p.is_file()}
    if has_lora(policy.model):
        files[SETTINGS_FILE] = settings_bytes(settings_of(policy.model))
    return files


def policy_files(policy: Policy) -> dict[str, bytes]:
    """The files of a `from_pretrained`-loadable directory (config, safetensors weights, tokenizer,
    generation config). Tied embeddings are stored once, as `save_pretrained` does. Under LoRA the weights
    are merged, and the adapters (with the base weights of the layers they adapt) and their settings are
    written beside them."""
    if policy.ranks is not None:  # sharded over data-parallel ranks: gathered whole on this one (rank 0)
        return dict(policy.ranks.whole_files())
    lora = has_lora(policy.model)
    static = _static_files.get(policy.model)
    if static is None:
        saved = _saved_files(policy)
        if not lora and WEIGHTS_FILE not in saved:
            return saved  # sharded weights: what save_pretrained wrote, every time
        static = {name: data for name, data in saved.items() if not name.endswith(".safetensors")}
        if lora:
            static[SETTINGS_FILE] = settings_bytes(settings_of(policy.model))
        _static_files[policy.model] = static
    files = {**static, WEIGHTS_FILE: weights_bytes(policy.model)}
    if lora:
        files[ADAPTER_FILE] = safetensors_save({name: t.to(CPU) for name, t in adapter_state(policy.model).items()})
    return files


def policy_from_files(
    files: dict[str, bytes],
    *,
    source: str = "files",
    threads: int = 1,
    device: torch.device = CPU,
    dtype: torch.dtype | None = None,
) -> Policy:
    """Inverse of `policy_files`: the same weights bit for bit, ties restored by `from_pretrained`, on `device`,
    in `dtype` (None: the dtype the weights were stored in, `stored_dtype`).

    `threads` is set as in `init_policy`, since a stage that resumes from a checkpoint never calls it.
    """
    set_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            target = Path(tmp) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        policy = _load_directory(tmp, source, local_files_only=True, dtype=dtype or stored_dtype(files))
    if SETTINGS_FILE in files:
        restore_lora(policy.model, files)
    return place(policy, device)


def stored_dtype(files: dict[str, bytes]) -> torch.dtype:
    """The dtype a model directory's weights load in: bfloat16 when its safetensors weights are stored in bf16
    (a checkpoint of a `policy.dtype: bfloat16` run), else float32, as every checkpoint loaded before."""
    weights = sorted(name for name in files if name.startswith("model") and name.endswith(".safetensors"))
    for name in weights:  # model.safetensors, or the shards model-00001-of-0000N.safetensors
        data = files[name]
        header_length = struct.unpack("<Q", data[:8])[0]
        for key, entry in json.loads(data[8 : 8 + header_length]).items():
            if key != "__metadata__" and entry["dtype"] in ("F64", "F32", "F16", "BF16"):  # a float tensor
                return torch.bfloat16 if entry["dtype"] == "BF16" else torch.float32
    return torch.float32


def make_optimizer(policy: Policy, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters (a tied embedding is one parameter, updated once; under
    LoRA only the adapters).

    On a GPU the fused kernel, as TRL's default (`adamw_torch_fused`): one pass over each tensor, where the
    multi-tensor kernel torch picks otherwise makes a temporary the size of all the weights (1.84 GiB at 0.5B
    parameters in float32) during the step. On the CPU torch's default (a loop over the parameters), as the
    figures of every CPU run were made with."""
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    fused = bool(trainable) and all(p.device.type == "cuda" for p in trainable)
    return torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, fused=fused or None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> bytes:
    """The optimizer's state_dict as one safetensors file: every state tensor (moments, step counts)
    under "<param index>.<name>", the param groups (hyperparameters) as JSON in the metadata.

    safetensors, not torch.save: nothing pickled, and about four times faster for a per-step save.
    """
    state_dict = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in state_dict["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{name}"] = value.to(CPU).contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    metadata = {"param_groups": json.dumps(state_dict["param_groups"]), "scalars": json.dumps(scalars)}
    return safetensors_save(tensors, metadata=metadata)


def load_optimizer_state(optimizer: torch.optim.Optimizer, data: bytes) -> None:
    """Restore what `optimizer_state_bytes` saved into an optimizer built over the same parameters."""
    tensors = safetensors_load(data)
    metadata = safetensors_metadata(data)
    groups = json.loads(metadata["param_groups"])
    scalars = json.loads(metadata["scalars"])
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        index, _, name = key.partition(".")
        state.setdefault(int(index), {})[name] = tensor
    for index, values in scalars.items():
        state.setdefault(int(index), {}).update(values)
    for group, own in zip(groups, optimizer.param_groups, strict=False):  # a count mismatch: torch says so below
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
        for kernel in ("fused", "foreach"):  # the kernel this device's optimizer chose, not the saving one's
            group[kernel] = own[kernel]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def safetensors_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors file held in memory (from its JSON header: 8-byte length, then JSON)."""
    header_length = struct.unpack("<Q", data[:8])[0]
    return dict(json.loads(data[8 : 8 + header_length]).get("__metadata__", {}))
