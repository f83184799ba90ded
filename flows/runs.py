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
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from rlvr import progress
from rlvr.errors import RunTakenOver, Stopped, UserError, environment_failure, stop_reason
from rlvr.flows import openlineage_events
from rlvr.flows.prefect_env import configure_prefect, quiet_run_failure_logs
from rlvr.storage.errors import DamagedFile
from rlvr.storage.integrity import repair_run
from rlvr.storage.leases import Lease, LeaseLost, owning
from rlvr.storage.processes import seconds_from_env
from rlvr.storage.run_records import run_death, run_status
from rlvr.storage.stage import failed_stage
from rlvr.storage.store import Store, open_store
from rlvr.storage.views import query, sql_string

DEFAULT_HEARTBEAT_S = 5.0
# What the heartbeat thread sends the run's main thread when it finds the run taken over: a signal, so that a main
# thread blocked in a wait wakes at once (a flag would be seen only at its next write).
TAKEN_OVER_SIGNAL = signal.SIGUSR1


def heartbeat_interval_s() -> float:
    """How often a running run's record is refreshed (RLVR_HEARTBEAT_S, default 5 s)."""
    return seconds_from_env("RLVR_HEARTBEAT_S", DEFAULT_HEARTBEAT_S)


def new_run_id() -> str:
    return datetime.now(UTC).strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _record(store: Store, run_id: str, **fields: Any) -> None:
    try:
        record = store.read_run(run_id) or {"run_id": run_id, "created_at": _now()}
    except DamagedFile:
        record = {"run_id": run_id, "created_at": _now()}  # written anew from what the run knows
    record.update(fields, updated_at=_now(), pid=os.getpid(), host=socket.gethostname())
    store.write_run(record)


class RunTracker:
    """Keeps a running run's record current: progress heard on the progress channel ("stage", "step",
    "eval") and a heartbeat, written together every `interval_s` (RLVR_HEARTBEAT_S) by a daemon thread.
    The thread beats whether or not the run progresses, so a record whose heartbeat stops belongs to a
    dead (or frozen) process. When it finds the run's lease taken over, it stops beating and calls
    `on_taken_over` (which stops the run's main thread)."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        interval_s: float | None = None,
        lease: Lease | None = None,
        on_taken_over: Callable[[], None] | None = None,
    ) -> None:
        self.store, self.run_id, self.lease, self.on_taken_over = store, run_id, lease, on_taken_over
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
                if self.lease is None or self.lease.beat():
                    self.write(status="running")
            except Exception:  # a store hiccup must not end the run; the next beat tries again
                pass
            if self.lease is not None and self.lease.lost is not None:  # found by the beat, or by the record's write
                if self.on_taken_over is not None:
                    self.on_taken_over()
                return

    def write(self, **fields: Any) -> None:
        """The record with the progress heard so far, a fresh heartbeat and `fields`."""
        with self._lock:
            current = dict(self.progress)
        _record(self.store, self.run_id, heartbeat_at=_now(), **current, **fields)


def _tracked(
    store_root: str, cfg: Any, body: Callable[[], dict[str, Any]], *, new: bool = False, **fields: Any
) -> dict[str, Any]:
    """Own the run (storage/leases.py; `new`: it must not exist yet) and run `body` with the run record kept
    up to date (running, then completed or failed) and the run's OpenLineage events sent, if configured.
    Before `body`, what killed writers of this run left is removed and damaged artifacts of the run are set
    aside to be rebuilt (storage/integrity.py)."""
    from rlvr.trainer.ranks.launch import return_freed_memory  # torch: only where a run is executed

    return_freed_memory()  # a CPU run's resident memory follows its live tensors, not every step's high-water mark
    store = open_store(store_root)
    with owning(store, cfg.run_id, new=new) as lease:
        store.cleanup_run(cfg.run_id)
        for line in repair_run(store, cfg.run_id):
            progress.report("warning", message=line)
        progress.report("stage", name="starting")
        return _tracked_body(store, lease, cfg, body, fields)


def _tracked_body(
    store: Store, lease: Lease, cfg: Any, body: Callable[[], dict[str, Any]], fields: dict[str, Any]
) -> dict[str, Any]:
    store_root = store.root
    in_main = threading.current_thread() is threading.main_thread()
    stop_main = _signal_main_thread if in_main else None  # elsewhere the run stops at its next write (LeaseLost)
    tracker = RunTracker(store, cfg.run_id, lease=lease, on_taken_over=stop_main)  # a beat never joins a batch
    openlineage_events.configure_run(store_root, cfg.run_id, cfg.openlineage, kind=fields.get("kind", "rl"))
    steps = cfg.train.steps if fields.get("kind") == "rl" else None
    started_fields = dict(status="running", store_root=store_root, config_json=cfg.model_dump_json(), steps=steps)
    failure = dict(error=None, failed_stage=None, failed_step=None)
    _record(store, cfg.run_id, heartbeat_at=_now(), **started_fields, **failure, **fields)
    openlineage_events.run_event(store_root, cfg.run_id, "START")
    started = time.monotonic()
    try:
        with _sigterm_raises_stopped(lease), tracker:
            result = body()
    except BaseException as exc:
        if lease.lost is not None:  # the run is another process's now: not a word more to its record
            raise RunTakenOver(lease.lost) from exc
        stage, step = failed_stage(exc) or (None, None)
        reason = f"{type(exc).__name__}: {exc}"[:500]
        try:  # best effort: on a full disk this write fails too, and the run's own error is the one to show
            tracker.write(status="failed", error=reason, failed_stage=stage, failed_step=step)
        except OSError:
            pass
        except LeaseLost as lost:
            raise RunTakenOver(str(lost)) from exc
        openlineage_events.run_event(store_root, cfg.run_id, "FAIL", exc)
        if isinstance(exc, (KeyboardInterrupt, Stopped)):
            how = "interrupted" if isinstance(exc, KeyboardInterrupt) else str(exc)
            progress.report(
                "warning",
                message=f"run {cfg.run_id!r} {how}; what it committed is intact: "
                f"`{_resume_command(cfg.run_id, store_root)}` continues from there",
            )
        machine = environment_failure(exc) or _disk_full(store)
        if machine is not None:
            raise UserError(
                f"run {cfg.run_id!r} stopped: {machine}; what it committed is intact: fix that, then "
                f"`{_resume_command(cfg.run_id, store_root)}` continues from there"
            ) from exc
        raise
    try:
        tracker.write(status="completed", **failure)
    except LeaseLost as lost:
        raise RunTakenOver(str(lost)) from None
    openlineage_events.run_event(store_root, cfg.run_id, "COMPLETE")
    return {**result, "seconds": time.monotonic() - started, "store": store_root}


def _resume_command(run_id: str, store_root: str) -> str:
    return f"rlvr resume {shlex.quote(run_id)} --store {shlex.quote(store_root)}"


@contextmanager
def _sigterm_raises_stopped(lease: Lease | None = None) -> Iterator[None]:
    """In the main thread, SIGTERM raises `Stopped` while the block runs. Prefect's flow engine handles the
    signal first (it records the flow run as crashed), then sends it again to the handler it found: this one.
    TAKEN_OVER_SIGNAL, sent by the run's heartbeat thread once `lease` is lost, raises `RunTakenOver`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_stopped(signum: int, _frame: Any) -> None:
        raise Stopped(stop_reason(signum, f"stopped by {signal.Signals(signum).name}"), 128 + signum)

    def raise_taken_over(_signum: int, _frame: Any) -> None:
        if lease is not None and lease.lost is not None:
            raise RunTakenOver(lease.lost)

    previous = signal.signal(signal.SIGTERM, raise_stopped)
    previous_taken = signal.signal(TAKEN_OVER_SIGNAL, raise_taken_over)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _redeliver_dropped_stops(previous_hook)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(TAKEN_OVER_SIGNAL, previous_taken)
        sys.unraisablehook = previous_hook


def _signal_main_thread() -> None:
    """Stop the run's main thread (from its heartbeat thread): the signal interrupts what it waits on."""
    signal.pthread_kill(threading.main_thread().ident or 0, TAKEN_OVER_SIGNAL)


def _redeliver_dropped_stops(previous_hook: Callable[[Any], Any]) -> Callable[[Any], None]:
    """An unraisable-exception hook that sends the process its signal again when the exception Python dropped is
    a stop: a signal handler runs between any two bytecodes of the main thread, also inside a `__del__` or a
    weakref callback, whose exceptions Python prints ("Exception ignored in ...") and drops, and the run then went
    on as if never signalled (seen once in CI: a SIGTERM lost in a WeakKeyDictionary callback). The process sends
    itself the signal again from a thread, 10 ms later: raised from the hook itself, it would be dropped too."""

    def hook(unraisable: Any) -> None:
        previous_hook(unraisable)
        signum = _stop_signal(unraisable.exc_value)
        if signum is not None:
            again = threading.Timer(0.01, os.kill, (os.getpid(), signum))
            again.daemon = True
            again.start()

    return hook


def _stop_signal(exc: BaseException | None) -> int | None:
    """The signal a stop exception was raised for: Ctrl-C's KeyboardInterrupt, our `Stopped`, Prefect's
    TerminationSignal (its flow engine's SIGTERM handler); None for any other exception."""
    from prefect.exceptions import TerminationSignal

    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(exc, RunTakenOver):
        return TAKEN_OVER_SIGNAL
    if isinstance(exc, Stopped):
        return exc.status - 128
    if isinstance(exc, TerminationSignal):
        return exc.signal
    return None


FULL_DISK_BYTES = 1 << 20


def _disk_full(store: Store) -> str | None:
    """ "no space left ..." when the disk of a local store (and of its Prefect database) is all but full: the
    failure may have surfaced elsewhere first, e.g. as an HTTP 500 from Prefect's server, whose database
    could not grow."""
    if store.local_root is None:
        return None
    try:
        free = shutil.disk_usage(store.local_root).free
    except OSError:
        return None
    return (
        f"no space left on the device holding {store.local_root} ({free} bytes free)"
        if free < FULL_DISK_BYTES
        else None
    )


def execute(store_root: str, cfg: Any, *, new: bool = False) -> dict[str, Any]:
    """Run (or continue) `cfg`'s run in the store at `store_root`; return the summary. `new`: refuse a run
    id that exists already (`rlvr run`), instead of continuing it."""
    configure_prefect(open_store(store_root, create=True))
    from rlvr.flows.rl_run import rl_run  # after configure_prefect: Prefect reads settings on import

    quiet_run_failure_logs()

    summary = _tracked(store_root, cfg, lambda: rl_run(store_root, cfg), new=new, kind="rl")
    return {**summary, **accuracy_summary(open_store(store_root), cfg.run_id)}


def execute_data(store_root: str, cfg: Any, policy: str | None = None, *, new: bool = False) -> dict[str, Any]:
    """Run (or continue) the data stages of `cfg` (`rlvr data`); difficulty too when `policy` is given."""
    configure_prefect(open_store(store_root, create=True))
    from rlvr.flows.data_run import data_run

    quiet_run_failure_logs()

    body = lambda: data_run(store_root, cfg, policy)  # noqa: E731
    return _tracked(store_root, cfg, body, new=new, kind="data", policy=policy)


def resume(store_root: str, run_id: str, placement: list[str] | None = None) -> dict[str, Any]:
    """Finish a failed or killed run (RL or data) from its last committed work; `placement`: `key=value`
    changes of where it works (flows/config.py, PLACEMENT_KEYS), which change no artifact id."""
    from rlvr.flows.config import config_from_json, with_placement

    record = resumable_run(open_store(store_root), run_id)
    cfg = with_placement(config_from_json(record["config_json"]), placement or [])
    if record.get("kind") == "data":
        return execute_data(store_root, cfg, record.get("policy"))
    return execute(store_root, cfg)


def existing_run(store: Store, run_id: str) -> dict[str, Any]:
    """The record of run `run_id`; a one-line UserError naming the store's runs when there is none. A damaged
    record is rebuilt from the run's committed config (`recovered_record`)."""
    try:
        record = store.read_run(run_id)
    except DamagedFile:
        record = recovered_record(store, run_id)
    if record is None:
        known = ", ".join(sorted(r["run_id"] for r in store.list_runs())) or "none"
        raise UserError(f"unknown run id {run_id!r} in store {store.root}; runs there: {known}")
    return record


def recovered_record(store: Store, run_id: str) -> dict[str, Any] | None:
    """What resume needs of a run whose record is unreadable, from its `config` artifact (None without one):
    the config, and the kind of run (an RL run has an `initialize` stage, a data run does not)."""
    manifests = store.manifests(run_id=run_id)
    configs = [m for m in manifests if m.kind == "config"]
    if not configs:
        return None
    config_json = store.read_table(configs[0].artifact_id).column("config_json")[0].as_py()
    kind = "rl" if any(m.stage == "initialize" for m in manifests) else "data"
    return {"run_id": run_id, "status": "failed", "kind": kind, "config_json": config_json, "policy": None}


def resumable_run(store: Store, run_id: str) -> dict[str, Any]:
    """The record of a run that can be resumed; a one-line UserError otherwise."""
    record = existing_run(store, run_id)
    if run_status(record) == "running":
        raise UserError(f"run {run_id!r} is still running (pid {record.get('pid')} on {record.get('host')})")
    return record


def accuracy_summary(store: Store, run_id: str) -> dict[str, Any]:
    """Held-out accuracy at init, after the warm start and after the last RL step; the final checkpoint."""
    sql = f"SELECT * FROM evals WHERE run_id = {sql_string(run_id)} ORDER BY step"  # * : a store before mean@k
    rows = query(store, sql).to_pylist()
    by_phase = last_by_phase(rows)
    sampled = [row for row in rows if row.get("mean_at_k") is not None]
    return {
        "accuracy_init": by_phase.get("init"),
        "accuracy_warmstart": by_phase.get("warmstart"),
        "accuracy_final": by_phase.get("rl"),
        "sampled_final": {k: sampled[-1][k] for k in ("samples", "mean_at_k", "mean_at_k_low", "mean_at_k_high")}
        if sampled
        else None,
        "evals": [{k: row[k] for k in ("phase", "step", "accuracy")} for row in rows],
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


def describe_run(record: dict[str, Any], store_root: str | None = None, store: Store | None = None) -> dict[str, Any]:
    """What `rlvr runs` shows of a run: status, progress (step / steps), the last held-out accuracy, the age
    of its heartbeat; for a failed run (or one whose process died) where it failed, why, and the command
    that resumes it. `store_root`: the store as the user names it (default: as the run recorded it).
    `store`: where to read how far a dead run really got (its record's progress is up to a heartbeat old)."""
    config = json.loads(record.get("config_json") or "{}")
    kind = record.get("kind", "rl")
    died = run_death(record)  # once: a second look could see a heartbeat a moment older
    status = "failed" if died is not None else str(record.get("status"))
    steps = record.get("steps") or (config.get("train", {}).get("steps") if kind == "rl" else None)
    step = record.get("step")
    if step is None and status == "completed":
        step = steps  # a record written before runs reported their progress
    if died is not None and store is not None:
        record = {**record, **committed_progress(store, str(record["run_id"]))}
        step = record.get("step", step)
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
        row["resume"] = _resume_command(str(record["run_id"]), str(root))
    return row


def committed_progress(store: Store, run_id: str) -> dict[str, Any]:
    """How far a run got by what it committed: the last RL step trained ("rl" phase), or the stage of its
    newest artifact; {} when it committed nothing."""
    manifests = store.manifests(run_id=run_id)
    trained = [m.step for m in manifests if m.kind == "train_steps" and m.step is not None]
    if trained:
        return {"phase": "rl", "step": max(trained)}
    if not manifests:
        return {}
    return {"phase": f"the stage after {max(manifests, key=lambda m: m.created_at).stage}"}


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
