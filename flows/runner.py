"""Start, finish and resume runs: the run record around the flow. Used by the CLI and the tests.

While a run goes, its record (runs/RUN_ID.json) holds its progress (step of steps, the last held-out
accuracy, the phase) and a heartbeat, both refreshed every few seconds (RLVR_HEARTBEAT_S) by a thread; a failed
run's record names the stage that raised and the reason. `describe_run` turns a record into what
`rlvr runs` shows, including a resume command for a failed run (or one whose process died).

Prefect must be configured before it is imported, so the flow module is imported inside the
functions, after `configure_prefect`.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import socket
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from rlvr import openlineage_events, progress
from rlvr.errors import UserError
from rlvr.flows.prefect_env import configure_prefect
from rlvr.storage.stage import failed_stage
from rlvr.storage.store import Store, run_death, run_status, seconds_from_env
from rlvr.storage.views import query, sql_string

DEFAULT_HEARTBEAT_S = 5.0


def heartbeat_interval_s() -> float:
    """How often a running run's record is refreshed (RLVR_HEARTBEAT_S, default 5 s)."""
    return seconds_from_env("RLVR_HEARTBEAT_S", DEFAULT_HEARTBEAT_S)


def new_run_id() -> str:
    return datetime.now(UTC).strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _record(store: Store, run_id: str, **fields: Any) -> None:
    record = store.read_run(run_id) or {"run_id": run_id, "created_at": _now()}
    record.update(fields, updated_at=_now(), pid=os.getpid(), host=socket.gethostname())
    store.write_run(record)


class RunTracker:
    """Keeps a running run's record current: progress heard on the progress channel ("stage", "step",
    "eval") and a heartbeat, written together every `interval_s` (RLVR_HEARTBEAT_S) by a daemon thread.
    The thread beats whether or not the run progresses, so a record whose heartbeat stops belongs to a
    dead (or frozen) process."""

    def __init__(self, store: Store, run_id: str, interval_s: float | None = None) -> None:
        self.store, self.run_id = store, run_id
        self.interval_s = interval_s or heartbeat_interval_s()
        self.progress: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat_until_stopped, name=f"rlvr-heartbeat-{run_id}", daemon=True)

    def __enter__(self) -> RunTracker:
        progress.listen(self.hear)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        progress.stop_listening(self.hear)
        self._stopped.set()
        self._thread.join()

    def hear(self, event: str, fields: dict[str, Any]) -> None:
        with self._lock:
            if event == "stage":
                self.progress["phase"] = fields["name"]
            elif event == "step":
                self.progress.update(step=fields["step"], phase="rl")
            elif event == "eval" and fields.get("accuracy") is not None:
                self.progress.update(accuracy=fields["accuracy"], accuracy_step=fields["step"])

    def _beat_until_stopped(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                self.write(status="running")
            except Exception:  # a store hiccup must not end the run; the next beat tries again
                continue

    def write(self, **fields: Any) -> None:
        """The record with the progress heard so far, a fresh heartbeat and `fields`."""
        with self._lock:
            current = dict(self.progress)
        _record(self.store, self.run_id, heartbeat_at=_now(), **current, **fields)


def _tracked(store_root: str, cfg: Any, body: Callable[[], dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """Run `body` with the run record kept up to date (running, then completed or failed) and the run's
    OpenLineage events sent, if they are configured."""
    store = Store.open(store_root)
    store.cleanup_uncommitted()
    tracker = RunTracker(Store(store_root), cfg.run_id)  # its own Store: a beat never joins the flow's batches
    openlineage_events.configure_run(store_root, cfg.run_id, cfg.openlineage, kind=fields.get("kind", "rl"))
    steps = cfg.train.steps if fields.get("kind") == "rl" else None
    started_fields = dict(status="running", store_root=store_root, config_json=cfg.model_dump_json(), steps=steps)
    failure = dict(error=None, failed_stage=None, failed_step=None)
    _record(store, cfg.run_id, heartbeat_at=_now(), **started_fields, **failure, **fields)
    openlineage_events.run_event(store_root, cfg.run_id, "START")
    started = time.monotonic()
    try:
        with tracker:
            result = body()
    except BaseException as exc:
        stage, step = failed_stage(exc) or (None, None)
        reason = f"{type(exc).__name__}: {exc}"[:500]
        tracker.write(status="failed", error=reason, failed_stage=stage, failed_step=step)
        openlineage_events.run_event(store_root, cfg.run_id, "FAIL", exc)
        raise
    tracker.write(status="completed", **failure)
    openlineage_events.run_event(store_root, cfg.run_id, "COMPLETE")
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


def existing_run(store: Store, run_id: str) -> dict[str, Any]:
    """The record of run `run_id`; a one-line UserError naming the store's runs when there is none."""
    record = store.read_run(run_id)
    if record is None:
        known = ", ".join(sorted(r["run_id"] for r in store.list_runs())) or "none"
        raise UserError(f"unknown run id {run_id!r} in store {store.root}; runs there: {known}")
    return record


def resumable_run(store: Store, run_id: str) -> dict[str, Any]:
    """The record of a run that can be resumed; a one-line UserError otherwise."""
    record = existing_run(store, run_id)
    if run_status(record) == "running":
        raise UserError(f"run {run_id!r} is still running (pid {record.get('pid')} on {record.get('host')})")
    return record


def accuracy_summary(store: Store, run_id: str) -> dict[str, Any]:
    """Held-out accuracy at init, after the warm start and after the last RL step; the final checkpoint."""
    sql = f"SELECT phase, step, accuracy FROM evals WHERE run_id = {sql_string(run_id)} ORDER BY step"
    rows = query(store, sql).to_pylist()
    by_phase = last_by_phase(rows)
    return {
        "accuracy_init": by_phase.get("init"),
        "accuracy_warmstart": by_phase.get("warmstart"),
        "accuracy_final": by_phase.get("rl"),
        "evals": rows,
        "final_checkpoint": final_checkpoint(store, run_id),
    }


def last_by_phase(evals: Iterable[dict[str, Any]]) -> dict[str, float]:
    """The accuracy of each phase's last row, for `evals` rows (phase, accuracy) in step order."""
    return {row["phase"]: row["accuracy"] for row in evals}


def final_checkpoint(store: Store, run_id: str) -> str | None:
    """The checkpoint a run ended with: its highest step, the `checkpoint` stage's before others."""
    rows = query(
        store,
        f"SELECT artifact_id FROM checkpoints WHERE run_id = {sql_string(run_id)} "
        "ORDER BY step DESC, stage = 'checkpoint' DESC LIMIT 1",
    ).to_pylist()
    return str(rows[0]["artifact_id"]) if rows else None


def describe_run(record: dict[str, Any], store_root: str | None = None) -> dict[str, Any]:
    """What `rlvr runs` shows of a run: status, progress (step / steps), the last held-out accuracy, the age
    of its heartbeat; for a failed run (or one whose process died) where it failed, why, and the command
    that resumes it. `store_root`: the store as the user names it (default: as the run recorded it)."""
    config = json.loads(record.get("config_json") or "{}")
    kind = record.get("kind", "rl")
    died = run_death(record)  # once: a second look could see a heartbeat a moment older
    status = "failed" if died is not None else str(record.get("status"))
    steps = record.get("steps") or (config.get("train", {}).get("steps") if kind == "rl" else None)
    step = record.get("step")
    if step is None and status == "completed":
        step = steps  # a record written before runs reported their progress
    beat = record.get("heartbeat_at") or record.get("updated_at")
    age = _age_s(beat)
    row: dict[str, Any] = {
        "run_id": record["run_id"],
        "kind": kind,
        "status": status,
        "step": step,
        "steps": steps,
        "progress": f"{step or 0}/{steps}" if steps else "",
        "accuracy": record.get("accuracy"),
        "heartbeat_at": beat,
        "heartbeat_age_s": None if age is None else round(age, 1),
        "heartbeat": "" if age is None else f"{format_age(age)} ago",
        "created_at": record.get("created_at"),
        "updated_at": record.get("updated_at"),
        "failed_stage": None,
        "reason": None,
        "resume": None,
    }
    if status == "failed":
        row["failed_stage"] = _where_it_failed(record, died is not None)
        row["reason"] = died or record.get("error") or "unknown (the run recorded no error)"
        root = store_root or record.get("store_root") or "."
        row["resume"] = f"rlvr resume {shlex.quote(str(record['run_id']))} --store {shlex.quote(str(root))}"
    return row


def _where_it_failed(record: dict[str, Any], died: bool) -> str:
    """The stage that raised (and its step); for a dead process, the phase it was last heard in."""
    stage, step = record.get("failed_stage"), record.get("failed_step")
    if stage and not died:
        return stage if step is None else f"{stage} (step {step})"
    phase = record.get("phase")
    if phase == "rl":
        return f"rl (step {int(record.get('step') or 0) + 1})"
    return phase or "start"


def _age_s(timestamp: Any) -> float | None:
    try:
        return max(0.0, (datetime.now(UTC) - datetime.fromisoformat(str(timestamp))).total_seconds())
    except (TypeError, ValueError):
        return None


def format_age(seconds: float) -> str:
    """A duration in its largest unit, rounded: "40 s", "12 min", "3 h", "2 d"."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"
