"""The cache of dequantised GGUF models (trainer/gguf_models.py) trusts only what it wrote: a cached folder is
used when it records the sha256 of the GGUF file being loaded, and the default folder in the shared temp dir
must be this user's alone. The conversion itself (transformers reading the GGUF file) is replaced by a stand-in
that writes a config: tests/test_real_model.py runs the real one."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from rlvr.errors import UserError
from rlvr.trainer import gguf_models
from rlvr.trainer.gguf_models import MODEL_CACHE_ENV, SOURCE_FILE, dequantised_directory


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """Every GGUF file converted, in order; the stand-in writes a config naming the file's bytes."""
    converted: list[Path] = []

    def convert(path: Path, out_dir: Path) -> None:
        out_dir.mkdir()
        (out_dir / "config.json").write_text(json.dumps({"from": path.read_text()}))
        converted.append(path)

    monkeypatch.setattr(gguf_models, "_convert", convert)
    monkeypatch.setattr(gguf_models, "require_gguf_reader", lambda: None)
    monkeypatch.setenv(MODEL_CACHE_ENV, str(tmp_path / "cache"))
    return converted


def _gguf(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "model.gguf"
    path.write_text(text)
    return path


def test_a_conversion_records_the_files_sha256_and_is_used_again(conversions, tmp_path):
    path = _gguf(tmp_path, "weights A")
    first = dequantised_directory(path)
    digest = hashlib.sha256(b"weights A").hexdigest()
    assert first == tmp_path / "cache" / f"model-{digest[:16]}"
    assert json.loads((first / SOURCE_FILE).read_text()) == {"gguf_file": "model.gguf", "gguf_sha256": digest}
    assert dequantised_directory(path) == first
    assert conversions == [path]  # the second load used the cache
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]  # no scratch folder left


@pytest.mark.parametrize(
    "planted",
    [None, {"gguf_file": "model.gguf", "gguf_sha256": "0" * 64}, "not json"],
    ids=["no-record", "other-file", "unreadable-record"],
)
def test_a_cached_folder_that_does_not_record_this_file_is_converted_again(conversions, tmp_path, planted):
    path = _gguf(tmp_path, "weights A")
    target = tmp_path / "cache" / f"model-{hashlib.sha256(b'weights A').hexdigest()[:16]}"
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({"from": "someone else"}))
    if planted is not None:
        (target / SOURCE_FILE).write_text(planted if isinstance(planted, str) else json.dumps(planted))
    assert dequantised_directory(path) == target
    assert conversions == [path]
    assert json.loads((target / "config.json").read_text()) == {"from": "weights A"}


def test_the_default_cache_in_the_temp_dir_must_be_this_users_alone(conversions, tmp_path, monkeypatch):
    monkeypatch.delenv(MODEL_CACHE_ENV)
    monkeypatch.setattr(gguf_models.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    path = _gguf(tmp_path, "weights A")
    made = dequantised_directory(path)
    cache = tmp_path / "tmp" / f"rlvr-{os.getuid()}" / "models"
    assert made.parent == cache and (cache.stat().st_mode & 0o777) == 0o700
    cache.parent.chmod(0o777)  # a folder anyone may write into: a model there could be anyone's
    with pytest.raises(UserError, match=r"rlvr-\d+ belongs to another user or is writable by others; remove it"):
        dequantised_directory(path)
    cache.parent.chmod(0o755)
    cache.chmod(0o775)
    with pytest.raises(UserError, match=r"models belongs to another user or is writable by others"):
        dequantised_directory(path)
    assert conversions == [path]
