"""`rlvr plan`: each stage's peak memory per rank for a run config, before any work (trainer/memory_plan.py).

Registered in flows/cli/commands.py. Exit status 0 when the run fits `--device-gb` (or none is given), 1 when a
stage does not fit.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from rlvr.errors import UserError

if TYPE_CHECKING:
    from rlvr.trainer.memory_plan import MemoryPlan

out = Console(soft_wrap=True)
GB = 1e9
TERMS = (
    "weights",
    "gradients",
    "optimizer",
    "SFT optimizer",
    "KL reference",
    "whole weights",
    "gathered units",
    "gradient reduction",
    "gathered tensor",
    "gathered weights",
    "activations",
    "KV cache",
    "file chunk",
    "process",
)


def plan(
    config: Path | None = typer.Option(None, "--config", help="the run's YAML file"),
    ranks: int | None = typer.Option(None, "--ranks", min=1, help="data-parallel ranks (default: train.data_parallel)"),
    device: str | None = typer.Option(
        None, "--device", help="cpu or cuda (default: policy.device; auto plans for cuda when this machine has one)"
    ),
    device_gb: float | None = typer.Option(None, "--device-gb", min=0.1, help="say whether every stage fits this"),
    prompt_tokens: int = typer.Option(128, "--prompt-tokens", min=1, help="a prompt's length in tokens"),
    model_config: Path | None = typer.Option(
        None, "--model-config", help="the model's config.json, when policy.model is not on this machine"
    ),
    set_: list[str] = typer.Option([], "--set", help="override a config key, e.g. --set train.sharding=replicate"),
) -> None:
    """Print each stage's peak memory per rank: weights, gradients, optimizer state, activations at the configured
    micro-batch and the largest gathered unit, counted on the real model built on the meta device and sharded over
    a fake group of N ranks in this process (no weights loaded, no GPU)."""
    from rlvr.flows.config import load_config
    from rlvr.trainer.memory_plan import make_plan

    cfg = load_config(config, set_)
    n = ranks or cfg.train.data_parallel
    target = _device(device or cfg.policy.device)
    result = make_plan(
        cfg, n, target, prompt_tokens, model_config, run_modules=lambda: import_module("rlvr.flows.runs")
    )
    _print(result)
    if device_gb is not None and not _fits(result, device_gb):
        raise typer.Exit(1)


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = name.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise UserError(f"--device {name!r}: plans are made for cpu or cuda")
    return kind


def _print(result: MemoryPlan) -> None:
    where = "the process's resident memory" if result.device == "cpu" else "GPU memory"
    out.print(
        f"{result.model}: {result.parameters:,} parameters, {result.ranks} rank(s), {result.sharding}, "
        f"{result.device} ({where}; GB = 10^9 bytes)"
    )
    table = Table("stage", "rank", "GB", "of which (GB)", "note")
    for stage in result.stages:
        parts = ", ".join(f"{term} {stage.terms[term] / GB:.2f}" for term in _in_order(stage.terms))
        table.add_row(stage.stage, stage.rank, f"{stage.total / GB:.2f}", parts, stage.note)
    out.print(table)
    for rank in result.rank_names():
        peak = result.peak(rank)
        out.print(f"peak on rank {rank}: {peak.total / GB:.2f} GB ({peak.stage})")
    for note in result.notes:
        out.print(f"note: {note}", markup=False)


def _in_order(terms: dict[str, int]) -> list[str]:
    """A stage's terms in TERMS's order, any other after it: every term the total adds is shown."""
    return [term for term in TERMS if term in terms] + [term for term in terms if term not in TERMS]


def _fits(result: MemoryPlan, device_gb: float) -> bool:
    over = [s for s in result.stages if s.total > device_gb * GB]
    for stage in over:
        out.print(f"does not fit {device_gb:g} GB: {stage.stage} on rank {stage.rank} needs {stage.total / GB:.2f} GB")
    if not over:
        out.print(f"fits {device_gb:g} GB: every stage on every rank")
    return not over
