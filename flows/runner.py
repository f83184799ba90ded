"""Start, finish and resume runs: the run record around the flow. Used by the CLI and the tests.

Prefect must be configured before it is imported, so the flow module is imported inside the
functions, after `configure_prefect`.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from rlvr.errors import UserError
from rlvr.flows.prefect_env import configure_prefect
from rlvr.storage.store import Store, run_status
from rlvr.storage.views import query


def new_run_id() -> str:
    return datetime.now(UTC).strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _record(store: Store, run_id: str, **fields: Any) -> None:
    record = store.read_run(run_id) or {"run_id": run_id, "created_at": _now()}
    record.update(fields, updated_at=_now(), pid=os.getpid(), host=socket.gethostname())
    store.write_run(record)


def _tracked(store_root: str, cfg: Any, body: Callable[[], dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """Run `body` with the run record kept up to date (running, then completed or failed)."""
    store = Store.open(store_root)
    store.cleanup_uncommitted()
    config_json = cfg.model_dump_json()
    _record(store, cfg.run_id, status="running", store_root=store_root, config_json=config_json, error=None, **fields)
    started = time.monotonic()
    try:
        result = body()
    except BaseException as exc:
        _record(store, cfg.run_id, status="failed", error=f"{type(exc).__name__}: {exc}"[:500])
        raise
    _record(store, cfg.run_id, status="completed", error=None)
    return {**result, "seconds": time.monotonic() - started, "store": store_root}


def execute(store_root: str, cfg: Any) -> dict[str, Any]:
    """Run (or continue) `cfg`'s run in the store at `store_root`; return the summary."""
    configure_prefect(Store.open(store_root, create=True))
    from rlvr.flows.rl_run import rl_run  # after configure_prefect: Prefect reads settings on import

    summary = _tracked(store_root, cfg, lambda: rl_run(store_root, cfg), kind="rl")
    return {**summary, **accuracy_summary(Store.open(store_root), cfg.run_id)}


def execute_data(store_root: str, cfg: Any, policy: str | None = None) -> dict[str, Any]:
    """Run (or continue) the data stages of `cfg` (`rlvr data`); difficulty too when `policy` is given."""
    configure_prefect(Store.open(store_root, create=True))
    from rlvr.flows.data_run import data_run

    return _tracked(store_root, cfg, lambda: data_run(store_root, cfg, policy), kind="data", policy=policy)


def resume(store_root: str, run_id: str) -> dict[str, Any]:
    """Finish a failed or killed run (RL or data) from its last committed work."""
    from rlvr.flows.config import config_from_json

    record = resumable_run(Store.open(store_root), run_id)
    cfg = config_from_json(record["config_json"])
    if record.get("kind") == "data":
        return execute_data(store_root, cfg, record.get("policy"))
    return execute(store_root, cfg)


def resumable_run(store: Store, run_id: str) -> dict[str, Any]:
    """The record of a run that can be resumed; a one-line UserError otherwise."""
    record = store.read_run(run_id)
    if record is None:
        known = ", ".join(sorted(r["run_id"] for r in store.list_runs())) or "none"
        raise UserError(f"unknown run id {run_id!r} in store {store.root}; runs there: {known}")
    if run_status(record) == "running":
        raise UserError(f"run {run_id!r} is still running (pid {record.get('pid')} on {record.get('host')})")
    return record


def accuracy_summary(store: Store, run_id: str) -> dict[str, Any]:
    """Held-out accuracy at init, after the warm start and after the last RL step; the final checkpoint."""
    rows = query(store, f"SELECT phase, step, accuracy FROM evals WHERE run_id = '{run_id}' ORDER BY step").to_pylist()
    by_phase: dict[str, float] = {}
    for row in rows:
        by_phase[row["phase"]] = row["accuracy"]  # the last row of each phase wins (highest step)
    final = query(
        store,
        f"SELECT artifact_id FROM checkpoints WHERE run_id = '{run_id}' "
        "ORDER BY step DESC, stage = 'checkpoint' DESC LIMIT 1",
    ).to_pylist()
    return {
        "accuracy_init": by_phase.get("init"),
        "accuracy_warmstart": by_phase.get("warmstart"),
        "accuracy_final": by_phase.get("rl"),
        "evals": rows,
        "final_checkpoint": final[0]["artifact_id"] if final else None,
    }


def describe_run(record: dict[str, Any]) -> dict[str, Any]:
    config = json.loads(record.get("config_json") or "{}")
    kind = record.get("kind", "rl")
    return {
        "run_id": record["run_id"],
        "kind": kind,
        "status": run_status(record),
        "steps": config.get("train", {}).get("steps") if kind == "rl" else None,
        "created_at": record.get("created_at"),
        "updated_at": record.get("updated_at"),
    }
