"""Where a run's models live and in what precision (`policy.device`, `policy.dtype`), and how much accelerator
memory a stage's model work took.

Every stage that touches a model is given the run's `policy.device` as the execution param `device` (like
`fan_out`, it says where work runs, not what it computes, so it is part of no artifact id) and puts its model
there through `stage_device`. Resolving happens in each process, so `auto` picks the GPU of the machine that
does the work. On the CPU nothing is moved or cast: a CPU run computes exactly what it did before devices
existed. What each stage used is recorded in its stage run (`stage_runs.device`, `stage_runs.peak_memory_bytes`)
and, for the update, in `train_steps`.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from rlvr.errors import UserError

CPU = torch.device("cpu")
DEFAULT_DEVICE = "auto"
DEVICE_FORMS = "auto, cpu, cuda or cuda:N"
_DEVICE_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")

WeightsDtype = Literal["float32", "bfloat16"]
WEIGHTS_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_device_name(name: str) -> str:
    """`name` when it is one of the forms `policy.device` takes, else a ValueError saying which those are."""
    if not _DEVICE_NAME.fullmatch(name):
        raise ValueError(f"device {name!r} is not one of {DEVICE_FORMS}")
    return name


def resolve_device(name: str) -> torch.device:
    """The torch device a `policy.device` value means on this machine: `auto` is the first CUDA device when
    there is one, else the CPU; `cuda` is the current CUDA device (cuda:0 unless the process chose another).
    Asking for CUDA where there is none, or for a GPU index past the last one, is a one-line UserError."""
    check_device_name(name)
    if name == "cpu":
        return CPU
    available = torch.cuda.is_available()
    if name == "auto":
        return torch.device("cuda", 0) if available else CPU
    if not available:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise UserError(
            f"policy.device is '{name}' but this machine has no usable CUDA device (torch {torch.__version__}, "
            f"{build}); set policy.device to 'cpu' or 'auto'"
        )
    index = int(name.partition(":")[2]) if ":" in name else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise UserError(
            f"policy.device is '{name}' but this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1}); "
            "set policy.device to one of them, 'cuda' or 'auto'"
        )
    return torch.device("cuda", index)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's parameters (a model here is never split across devices)."""
    return next(model.parameters()).device


def reset_peak_memory(device: torch.device) -> None:
    """Start counting the peak memory allocated on `device` from now (nothing to count on the CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    """Bytes of accelerator memory allocated at the peak since `reset_peak_memory` (torch's caching allocator:
    tensors, not what it reserved); None on the CPU, where torch keeps no such count."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def stage_device(name: str | None) -> torch.device:
    """The device a stage puts its model on: `name` is the run's `policy.device` (a stage's `device` param;
    None, when a stage is run without one, means `auto`). Its peak-memory count starts here: call it before
    the model is loaded."""
    device = resolve_device(name or DEFAULT_DEVICE)
    reset_peak_memory(device)
    return device


def usage(model: torch.nn.Module) -> dict[str, Any]:
    """What a stage records about its model work: the device the model ran on and the peak accelerator memory
    since `stage_device` (None on the CPU)."""
    device = model_device(model)
    return {"device": str(device), "peak_memory_bytes": peak_memory(device)}


_streams: dict[torch.device, Any] = {}  # own_stream's, one per CUDA device
_streams_lock = threading.Lock()


@contextmanager
def own_stream(device: torch.device) -> Iterator[None]:
    """On a CUDA device, the calling thread's kernels go to a CUDA stream of their own until the block ends, so
    that they can run beside another thread's on the same GPU instead of queueing behind them on the default
    stream (flow.sampler=thread: the sampler's decoding beside the trainer's update). The stream first waits for
    the work queued so far (the policy copy the sampler reads), and the block ends only once its own work is
    done, so nothing it made is read or freed while a kernel still uses it. Elsewhere nothing changes.

    One stream per device for the process's life: torch's caching allocator keeps freed memory for the stream
    that allocated it, so a new stream each step would leave each step's generation memory cached apart."""
    if device.type != "cuda":
        yield
        return
    with _streams_lock:
        if device not in _streams:
            _streams[device] = torch.cuda.Stream(device)
        stream = _streams[device]
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        stream.synchronize()
