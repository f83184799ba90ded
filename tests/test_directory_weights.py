"""A model directory's first checkpoint written a tensor at a time (trainer/directory_weights.py, used by `initialize`
with data-parallel ranks): the same files, byte for byte, as the whole model `from_pretrained` loads would give, from
one safetensors file or an index of shards, in the run's dtype; None for a directory whose tensors are not the
model's own, so the caller loads it whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from rlvr.trainer.devices import WEIGHTS_DTYPES
from rlvr.trainer.directory_weights import INDEX_FILE, SINGLE_FILE, weights_chunks
from rlvr.trainer.policy import WEIGHTS_FILE, PolicyConfig, init_policy, meta_policy, policy_files, static_files
from rlvr.trainer.tiny_model import TinyModelConfig

TWO_LAYERS = TinyModelConfig(num_layers=2)


def _directory(root: Path) -> Path:
    """The two-layer tiny model (tied embeddings) saved as a Hugging Face directory."""
    for name, data in policy_files(init_policy(PolicyConfig(tiny=TWO_LAYERS), seed=3)).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def _split_into_shards(directory: Path) -> None:
    """The directory's one weights file as two shards and an index, as large models are stored."""
    tensors = load_file(directory / SINGLE_FILE)
    names = sorted(tensors)
    weight_map = {}
    for number, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :]), start=1):
        file = f"model-0000{number}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / SINGLE_FILE).unlink()


def _both(directory: Path, dtype: str) -> tuple[dict[str, bytes], dict[str, bytes] | None]:
    cfg = PolicyConfig(model=str(directory), dtype=dtype)
    whole = policy_files(init_policy(cfg, seed=0))
    found = meta_policy(cfg)
    assert found is not None
    policy, source = found
    assert all(p.device.type == "meta" for p in policy.model.parameters())  # nothing loaded
    chunks = weights_chunks(policy.model, source, WEIGHTS_DTYPES[dtype])
    return whole, None if chunks is None else {**static_files(policy), WEIGHTS_FILE: b"".join(chunks)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["one file", "shards"])
def test_a_directory_streams_the_bytes_of_the_loaded_model(tmp_path, dtype, layout):
    directory = _directory(tmp_path / "model")
    if layout == "shards":
        _split_into_shards(directory)
    whole, streamed = _both(directory, dtype)
    assert streamed is not None and sorted(streamed) == sorted(whole)
    assert [name for name in whole if whole[name] != streamed[name]] == []


def test_a_directory_whose_tensors_are_not_the_models_is_left_to_a_whole_load(tmp_path):
    directory = _directory(tmp_path / "model")
    tensors = load_file(directory / SINGLE_FILE)
    tensors["model.renamed.weight"] = tensors.pop("model.norm.weight")  # a name transformers would convert
    save_file(tensors, directory / SINGLE_FILE, metadata={"format": "pt"})
    policy, source = meta_policy(PolicyConfig(model=str(directory)))  # type: ignore[misc]
    assert weights_chunks(policy.model, source, WEIGHTS_DTYPES["float32"]) is None


def test_the_tiny_model_and_lora_are_built_not_read(tmp_path):
    assert meta_policy(PolicyConfig()) is None
    assert meta_policy(PolicyConfig(model=str(_directory(tmp_path / "model")), lora={})) is None


def test_with_ranks_an_earlier_checkpoint_is_copied_not_loaded(tmp_path, monkeypatch):
    """`policy.checkpoint` with data-parallel ranks: its files copied (the weights in chunks), the same bytes as
    the one-process copy, no model built in this process; one to cast to another dtype is still loaded."""
    from rlvr.storage.stage import run_stage
    from rlvr.storage.store import Store
    from rlvr.tasks import initialize
    from rlvr.tasks.initialize import INITIALIZE

    store = Store.open(str(tmp_path / "s"), create=True)
    earlier = run_stage(store, INITIALIZE, PolicyConfig(), run_id="earlier", seed=3, step=0, params={"seed": 3}).id

    def start(run_id: str, ranks: int, dtype: str = "float32") -> str:
        cfg = PolicyConfig(checkpoint=earlier, dtype=dtype)
        params = {"seed": 5, "ranks": ranks}
        at = {"run_id": run_id, "seed": 5, "step": 0, "inputs": {"checkpoint": earlier}, "params": params}
        return run_stage(store, INITIALIZE, cfg, **at).id

    one = start("one", 1)
    monkeypatch.setattr(initialize, "policy_from_files", lambda *a, **k: pytest.fail("loaded the whole model"))
    two = start("two", 2)
    files = {aid: {e["path"]: e["sha256"] for e in store.manifest(aid).binary_files} for aid in (one, two, earlier)}
    assert files[two] == files[one] == files[earlier]
    assert store.manifest(two).parents == [earlier] and store.manifest(two).extra["n_params"] > 0
    with pytest.raises(pytest.fail.Exception, match="loaded the whole model"):  # a cast needs the model
        start("cast", 2, dtype="bfloat16")
