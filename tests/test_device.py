"""`policy.device` and `policy.dtype`: every stage that touches the model puts it on the run's device, the
device and peak accelerator memory are recorded, and bf16 weights stay plain Hugging Face checkpoints.

Written for a CPU machine: CUDA itself is never touched here (its availability is faked where only the
parsing of `cuda:N` is under test).
"""

from __future__ import annotations

import tempfile
import threading
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from rlvr.errors import ConfigError, UserError
from rlvr.flows.config import load_config
from rlvr.storage.stage import on_stage_run
from rlvr.storage.store import Store
from rlvr.storage.views import query
from rlvr.trainer import devices
from rlvr.trainer.devices import CPU, resolve_device
from rlvr.trainer.policy import (
    PolicyConfig,
    init_policy,
    make_optimizer,
    optimizer_state_bytes,
    policy_files,
    policy_from_files,
    stored_dtype,
)
from rlvr.trainer.sft import sft_warmstart
from tests.cli_helpers import rlvr
from tests.conftest import TINY_OVERRIDES

# The stages that load, sample or train the model; every other stage must not ask for a device.
MODEL_STAGES = {"initialize", "evaluate", "warmstart", "difficulty", "rollout", "restructure", "train"}


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_device_names_resolve_to_the_first_gpu_an_index_or_the_cpu(monkeypatch):
    fake_gpus(monkeypatch, 2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == CPU
    with pytest.raises(UserError, match=r"'cuda:2' but this machine has 2 CUDA device\(s\) \(cuda:0 to cuda:1\)"):
        resolve_device("cuda:2")
    fake_gpus(monkeypatch, 0)
    assert resolve_device("auto") == CPU


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_a_gpu_is_one_line_naming_the_device(monkeypatch, name):
    fake_gpus(monkeypatch, 0)
    with pytest.raises(UserError) as error:
        resolve_device(name)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"policy.device is '{name}' but this machine has no usable CUDA device")
    assert message.endswith("set policy.device to 'cpu' or 'auto'")


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "CPU", "cuda:-1", "mps"])
def test_unknown_device_names_are_config_errors(name):
    with pytest.raises(ValidationError, match="is not one of auto, cpu, cuda or cuda:N"):
        PolicyConfig(device=name)
    with pytest.raises(ConfigError, match="policy.device"):
        load_config(None, [f"policy.device={name}"])


def test_defaults_are_auto_and_float32():
    cfg = PolicyConfig()
    assert (cfg.device, cfg.dtype) == ("auto", "float32")


def test_rlvr_run_asking_for_a_missing_gpu_fails_before_any_work(tmp_path, rlvr_forks):
    """cuda:99 exists on no machine, so the command fails the same way with or without GPUs."""
    done = rlvr("run", "--store", str(tmp_path / "s"), "--set", "policy.device=cuda:99", forks=rlvr_forks)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "policy.device is 'cuda:99' but this machine has" in lines[0], done.stderr


def test_device_and_dtype_are_left_out_of_ids_unless_bf16():
    """The device says where work runs, so no id depends on it; float32 is what every earlier run computed in,
    so it is left out too and those runs' ids stay what they were. bf16 weights are other artifacts."""
    from rlvr.flows.config import CONFIG
    from rlvr.tasks.initialize import INITIALIZE

    def ids(*overrides: str) -> tuple[dict, dict]:
        cfg = load_config(None, ["run_id=r", *overrides])
        config_id = CONFIG.output_ids("r", None, cfg, {}, {})
        initial = INITIALIZE.output_ids("r", 0, cfg.policy, {"seed": 0}, {"config": config_id["config"]})
        return config_id, initial

    assert ids() == ids("policy.device=cpu") == ids("policy.device=cuda:1") == ids("policy.dtype=float32")
    bf16 = ids("policy.dtype=bfloat16")
    assert bf16[0] != ids()[0] and bf16[1] != ids()[1]


def test_float32_is_the_model_of_before_and_moves_nothing_on_the_cpu():
    policy = init_policy(PolicyConfig(device="cpu"), seed=3)
    again = init_policy(PolicyConfig(), seed=3)
    assert all(p.dtype == torch.float32 and p.device == CPU for p in policy.model.parameters())
    assert policy_files(policy) == policy_files(again)
    assert stored_dtype(policy_files(policy)) == torch.float32


def test_bfloat16_weights_train_save_and_load_as_a_plain_bf16_model_on_the_cpu():
    policy = init_policy(PolicyConfig(dtype="bfloat16", device="cpu"), seed=3)
    assert {p.dtype for p in policy.model.parameters()} == {torch.bfloat16}
    optimizer = make_optimizer(policy, lr=1e-2, weight_decay=0.0)
    losses = sft_warmstart(policy, optimizer, [("1+1=", "2"), ("2+2=", "4")], steps=2, batch_size=2, seed=0)
    assert all(torch.isfinite(torch.tensor(losses)))
    # What AdamW keeps for bf16 weights: its moments are made like the parameters, so they are bf16 too.
    moments = [s[name] for s in optimizer.state.values() for name in ("exp_avg", "exp_avg_sq")]
    assert moments and {m.dtype for m in moments} == {torch.bfloat16}
    assert optimizer_state_bytes(optimizer)

    files = policy_files(policy)
    assert stored_dtype(files) == torch.bfloat16
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        plain = AutoModelForCausalLM.from_pretrained(tmp, local_files_only=True)  # what a user would do
    assert plain.device == CPU and {p.dtype for p in plain.parameters()} == {torch.bfloat16}
    reloaded = policy_from_files(files)  # a later stage: the dtype it was stored in
    for name, tensor in policy.model.state_dict().items():
        assert torch.equal(plain.state_dict()[name], tensor), name
        assert torch.equal(reloaded.model.state_dict()[name], tensor), name
    assert torch.equal(
        policy_from_files(files, dtype=torch.float32).model.state_dict()["lm_head.weight"],
        policy.model.state_dict()["lm_head.weight"].float(),
    )


def test_usage_on_the_cpu_names_it_and_has_no_peak():
    policy = init_policy(PolicyConfig(), seed=0)
    assert devices.stage_device(None) == CPU and devices.stage_device("cpu") == CPU
    assert devices.usage(policy.model) == {"device": "cpu", "peak_memory_bytes": None}


def test_own_stream_on_the_cpu_runs_the_block_as_it_is():
    ran = []
    with devices.own_stream(CPU):
        ran.append(torch.ones(3).sum().item())
    assert ran == [3.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_own_stream_gives_a_thread_a_stream_that_sees_the_work_queued_before_it():
    """flow.sampler=thread: the sampler's kernels leave the default stream, yet read the policy copy that the
    trainer's thread queued there just before; the stream is kept for the next step."""
    device = torch.device("cuda", 0)
    copied = torch.empty(4096, 4096, device=device)
    copied.fill_(1.0)  # queued on the default stream (a sum of 2**24 ones is exact in float32)
    seen: dict[str, object] = {}

    def sampler() -> None:
        with devices.own_stream(device):
            stream = torch.cuda.current_stream(device)
            seen["own"] = stream != torch.cuda.default_stream(device)
            seen["sum"] = copied.sum().item()
        seen["after"] = torch.cuda.current_stream(device) == torch.cuda.default_stream(device)
        with devices.own_stream(device):
            seen["same stream next time"] = torch.cuda.current_stream(device) == stream

    thread = threading.Thread(target=sampler)
    thread.start()
    thread.join()
    assert seen == {"own": True, "sum": 2.0**24, "after": True, "same stream next time": True}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_optimizer_on_a_gpu_is_fused_and_steps():
    policy = init_policy(PolicyConfig(device="cuda"), seed=0)
    optimizer = make_optimizer(policy, lr=1e-2, weight_decay=0.0)
    assert optimizer.param_groups[0]["fused"] is True
    before = [p.detach().clone() for p in policy.model.parameters()]
    sft_warmstart(policy, optimizer, [("1+1=", "2"), ("2+2=", "4")], steps=1, batch_size=2, seed=0)
    assert all(not torch.equal(a, p) for a, p in zip(before, policy.model.parameters(), strict=True))


# ----- a real run: every model stage asks for the run's device, and records where its model ran ----------


def run_recording_devices(root: str, run_id: str, device: str, monkeypatch: pytest.MonkeyPatch):
    """A two-step run with CLPO's policy rewriter and a KL reference; returns {stage: device names it asked for}."""
    from rlvr.flows.runs import execute

    asked: list[str] = []
    by_stage: dict[str, set[str]] = defaultdict(set)
    resolve = devices.resolve_device

    def recording(name: str) -> torch.device:
        asked.append(name)
        return resolve(name)

    def stage_ran(result) -> None:
        by_stage[result.stage].update(asked)
        asked.clear()

    monkeypatch.setattr(devices, "resolve_device", recording)
    stop = on_stage_run(stage_ran)
    overrides = [
        f"run_id={run_id}",
        *TINY_OVERRIDES,
        "train.steps=2",
        "evaluate.every=2",
        "checkpoint.every=2",
        "flow.steps_per_subflow=2",
        "restructure.enabled=true",
        "restructure.rewriter=policy",
        "train.grpo.kl_beta=0.1",
        f"policy.device={device}",
    ]
    try:
        execute(root, load_config(None, overrides))
    finally:
        stop()
    return {stage: names for stage, names in by_stage.items() if names}


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_every_stage_that_touches_the_model_uses_the_run_device(tmp_path, prefect_api, monkeypatch, device):
    root = str(tmp_path / "s")
    asked = run_recording_devices(root, "dev", device, monkeypatch)
    assert asked == {stage: {device} for stage in MODEL_STAGES}
    store = Store.open(root)
    stage_runs = query(store, "SELECT stage, device, peak_memory_bytes FROM stage_runs").to_pylist()
    used = {r["stage"]: set() for r in stage_runs}
    for r in stage_runs:
        used[r["stage"]].add((r["device"], r["peak_memory_bytes"]))
    assert {stage for stage, seen in used.items() if seen != {(None, None)}} == MODEL_STAGES
    # `auto` takes the first GPU where there is one (peak memory counted), the CPU elsewhere (no count).
    expected = "cuda:0" if device == "auto" and torch.cuda.is_available() else "cpu"
    assert all({name for name, _ in used[stage]} == {expected} for stage in MODEL_STAGES)
    peaks = [peak for stage in MODEL_STAGES for _, peak in used[stage]]
    assert all(peak is None for peak in peaks) if expected == "cpu" else all(peak > 0 for peak in peaks)
    steps = query(store, "SELECT step, device, peak_memory_bytes FROM train_steps ORDER BY step").to_pylist()
    assert [(r["step"], r["device"]) for r in steps] == [(1, expected), (2, expected)]
    assert all((r["peak_memory_bytes"] is None) == (expected == "cpu") for r in steps)
