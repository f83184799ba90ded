"""Recurring pipelines through Prefect: `rlvr schedule NAME (--interval SECONDS | --cron EXPR)`.

A schedule is a Prefect deployment of the `rlvr-pipeline` flow, named NAME, served by the `rlvr schedule`
process (Prefect's Runner runs each firing in a subprocess). Each firing is a fresh run
`NAME-<UTC time of the firing, YYYYmmdd-HHMMSS>` with the pipeline's config that continues the pipeline:
it starts from the final checkpoint of the newest completed run of NAME (`policy.checkpoint`, so lineage
links the new run to it), skips the warm start, synthesizes its data again, re-estimates difficulty with
that checkpoint, trains and evaluates. The first firing starts as the config says (warm start included).

Never two runs of a pipeline at once: the deployment has a concurrency limit of 1 with Prefect's
CANCEL_NEW strategy, so the server cancels a firing while the previous run holds the slot. The serving
process records each such skip in the store (a `firings` row, outcome `skipped`), and every firing that
starts records itself (outcome `started`, with the checkpoint it started from).

Import this module only after Prefect is configured (PREFECT_API_URL, prefect_env.configure_prefect).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import re
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import pyarrow as pa
from prefect import flow, get_client
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy, FlowRun, StateType
from prefect.client.schemas.sorting import DeploymentSort, FlowRunSort
from prefect.context import FlowRunContext
from prefect.exceptions import ObjectNotFound
from prefect.runner import Runner
from prefect.states import Cancelled, State
from prefect.types.entrypoint import EntrypointType
from pydantic import ValidationError

from rlvr.errors import UserError
from rlvr.flows.runs import final_checkpoint
from rlvr.flows.ui import sigterm_as_interrupt
from rlvr.startup_objects import freeze_after_run_imports
from rlvr.storage.ids import artifact_id
from rlvr.storage.manifest import utc_now
from rlvr.storage.run_records import run_status
from rlvr.storage.schemas import SCHEMAS
from rlvr.storage.store import Store, open_store
from rlvr.storage.views import query, sql_string

FLOW_NAME = "rlvr-pipeline"
FIRINGS = "firings"
FIRINGS_VERSION = "1"
Say = Callable[[str], None]


# ----- naming and the store's view of a pipeline ------------------------------------------------------


def firing_run_id(name: str, when: datetime) -> str:
    """The run id of the firing scheduled at `when`: NAME-YYYYmmdd-HHMMSS in UTC."""
    return f"{name}-{when.astimezone(UTC):%Y%m%d-%H%M%S}"


def _is_pipeline_run(run_id: str, name: str) -> bool:
    return re.fullmatch(re.escape(name) + r"-\d{8}-\d{6}", run_id) is not None


def pipeline_runs(store: Store, name: str) -> list[dict[str, Any]]:
    """The run records of pipeline `name`, oldest first (run ids sort by firing time)."""
    runs = [r for r in store.list_runs() if _is_pipeline_run(str(r.get("run_id")), name)]
    return sorted(runs, key=lambda r: str(r["run_id"]))


def newest_checkpoint(store: Store, name: str, before: str | None = None) -> tuple[str, str] | None:
    """(run id, final checkpoint) of the newest completed run of the pipeline (older than run `before`)."""
    for record in reversed(pipeline_runs(store, name)):
        run_id = str(record["run_id"])
        if (before is None or run_id < before) and run_status(record) == "completed":
            checkpoint = final_checkpoint(store, run_id)
            if checkpoint is not None:
                return run_id, checkpoint
    return None


def running_run(store: Store, name: str, other_than: str) -> str | None:
    """A run of the pipeline that is still running (its process alive), other than `other_than`."""
    running = [str(r["run_id"]) for r in pipeline_runs(store, name) if run_status(r) == "running"]
    return next((r for r in reversed(running) if r != other_than), None)


def firing_config(store: Store, name: str, config_json: str, run_id: str) -> Any:
    """The config of firing `run_id`: the pipeline's, continuing from the final checkpoint of its newest
    completed run (`policy.checkpoint`; the first run starts as the config says).

    Continuing skips the warm start: it is how a pipeline begins, not something each firing repeats.
    """
    from rlvr.flows.config import config_from_json

    tree = json.loads(config_json)
    tree["run_id"] = run_id
    newest = newest_checkpoint(store, name, before=run_id)
    if newest is not None:
        tree.setdefault("policy", {})["checkpoint"] = newest[1]
        tree.setdefault("warmstart", {})["steps"] = 0
    return config_from_json(json.dumps(tree))


@dataclass(frozen=True)
class Firing:
    """One firing of a schedule as the store records it (a row of the `firings` view)."""

    schedule: str
    run_id: str
    scheduled_at: str
    outcome: str  # started | skipped
    reason: str
    flow_run_id: str
    start_checkpoint: str | None = None
    blocked_by: str | None = None


def record_firing(store: Store, firing: Firing) -> str:
    """Commit the firing as a one-row `firings` artifact (once per Prefect flow run and outcome)."""
    parents = [firing.start_checkpoint] if firing.start_checkpoint else []
    identity = {"schedule": firing.schedule, "flow_run_id": firing.flow_run_id, "outcome": firing.outcome}
    aid = artifact_id(FIRINGS, "schedule", FIRINGS_VERSION, identity, parents, firing.run_id)
    if not store.exists(aid):
        row = {**asdict(firing), "recorded_at": utc_now()}
        table = pa.Table.from_pylist([row], schema=SCHEMAS[FIRINGS])
        store.write_artifact(
            FIRINGS,
            aid,
            table,
            run_id=firing.run_id,
            stage="schedule",
            parents=parents,
            code_version=FIRINGS_VERSION,
            config=identity,
        )
    return aid


def firings(store: Store, name: str | None = None) -> list[dict[str, Any]]:
    """Every recorded firing (of one schedule, or all), in firing order: the `firings` view."""
    where = f"WHERE schedule = {sql_string(name)}" if name is not None else ""
    return query(store, f"SELECT * FROM firings {where} ORDER BY scheduled_at, recorded_at").to_pylist()


# ----- the flow each firing runs ----------------------------------------------------------------------


def _scheduled_at() -> datetime:
    context = FlowRunContext.get()
    if context is None or context.flow_run is None or context.flow_run.expected_start_time is None:
        return datetime.now(UTC)
    return context.flow_run.expected_start_time


def _firing_name() -> str:
    context = FlowRunContext.get()
    name = str(context.parameters["name"]) if context is not None and context.parameters else "rlvr"
    return firing_run_id(name, _scheduled_at())


@flow(name=FLOW_NAME, flow_run_name=_firing_name, persist_result=False, validate_parameters=False)
def pipeline_firing(store: str, name: str, config_json: str) -> dict[str, Any] | State:
    """One firing of schedule `name`: a run NAME-<timestamp> continuing from the pipeline's newest checkpoint."""
    from rlvr.flows.config import config_from_json
    from rlvr.flows.runs import execute

    _freeze_a_firing_process()
    found = open_store(store)
    when = _scheduled_at()
    run_id = firing_run_id(name, when)
    context = FlowRunContext.get()
    flow_run_id = str(context.flow_run.id) if context is not None and context.flow_run is not None else ""
    at = dict(schedule=name, run_id=run_id, scheduled_at=when.astimezone(UTC).isoformat(), flow_run_id=flow_run_id)
    busy = running_run(found, name, other_than=run_id)
    if busy is not None:  # a run outside this deployment (another server, a manual `rlvr run`)
        reason = f"run {busy} of the pipeline is still running"
        record_firing(found, Firing(outcome="skipped", reason=reason, blocked_by=busy, **at))
        return Cancelled(message=f"skipped: {reason}")
    existing = found.read_run(run_id)
    if existing is not None:  # the same firing again (a Prefect retry): continue that run
        cfg = config_from_json(existing["config_json"])
    else:
        cfg = firing_config(found, name, config_json, run_id)
    start = cfg.policy.checkpoint
    reason = f"continues from {start}" if start else "first run of the pipeline"
    record_firing(found, Firing(outcome="started", reason=reason, start_checkpoint=start, **at))
    summary = execute(store, cfg)
    keys = ("run_id", "final_checkpoint", "accuracy_init", "accuracy_final", "seconds")
    return {"start_checkpoint": start, **{k: summary.get(k) for k in keys}}


def _freeze_a_firing_process() -> None:
    """In a process started for this firing alone, keep what a run imports out of every later garbage collection, as
    `rlvr run` does (rlvr/startup_objects.py): about 1.8 of a small firing's 12 CPU-seconds, most of them at its exit.
    Prefect's runner starts each firing as `python -m prefect.engine` (or spawns a process for it); a firing called
    in a program's own process leaves it as it is."""
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    if getattr(main, "name", None) != "prefect.engine" and multiprocessing.parent_process() is None:
        return
    freeze_after_run_imports()


# ----- serving, and what the serving process records --------------------------------------------------


def schedule_deployment(
    store_root: str, name: str, config_json: str, *, interval: float | None, cron: str | None
) -> Any:
    """The Prefect deployment of schedule `name` (not yet applied): its trigger, parameters and the
    concurrency limit that makes an overlapping firing a cancelled (skipped) one."""
    trigger = describe_trigger(interval, cron)
    try:
        return pipeline_firing.to_deployment(
            name=name,
            interval=timedelta(seconds=interval) if interval else None,
            cron=cron,
            parameters={"store": store_root, "name": name, "config_json": config_json},
            concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW),
            tags=["rlvr"],
            entrypoint_type=EntrypointType.MODULE_PATH,
            description=f"rlvr pipeline {name} over store {store_root}, {trigger}",
        )
    except ValidationError as exc:  # a bad cron expression
        detail = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
        raise UserError(f"bad --cron {cron!r}: {detail}; e.g. '0 3 * * *' is 03:00 UTC every day") from None


def read_deployment(name: str, client: SyncPrefectClient | None = None) -> Any | None:
    """The deployment of schedule `name`, or None; through `client` when given (else a client of its own)."""
    if client is None:
        with get_client(sync_client=True) as own:
            return read_deployment(name, own)
    try:
        return client.read_deployment_by_name(f"{FLOW_NAME}/{name}")
    except ObjectNotFound:
        return None


def check_owner(deployment: Any, store_root: str) -> None:
    """A schedule name belongs to one store on a Prefect server."""
    other = deployment.parameters.get("store")
    if other != store_root:
        raise UserError(
            f"schedule {deployment.name!r} on this Prefect server belongs to store {other}; "
            "choose another name, or pass that store with --store"
        )


def poll_seconds(interval: float | None) -> float:
    """How often the runner asks for due firings: a fifth of the interval, between 1 and 5 seconds."""
    return 5.0 if not interval else min(5.0, max(1.0, interval / 5))


def serve_schedule(
    store_root: str, name: str, config_json: str, *, interval: float | None, cron: str | None, say: Say
) -> None:
    """Create (or update, and unpause) the deployment and serve it until SIGINT or SIGTERM, or until the schedule
    is deleted (`rlvr schedule NAME --delete`); on the way out Prefect's runner cancels a firing in flight and
    pauses the schedule, so no firing waits for a process that is gone. The last line names the firing it
    cancelled, if any, and how to finish that run."""
    deployment = schedule_deployment(store_root, name, config_json, interval=interval, cron=cron)
    existing = read_deployment(name)
    if existing is not None:
        check_owner(existing, store_root)
    poll = poll_seconds(interval)
    recorder = SkipRecorder(store_root, name, every=poll)
    recorder.start()

    def serving() -> None:
        trigger = describe_trigger(interval, cron)
        say(f"serving schedule {name}: {trigger}, runs named {name}-<UTC timestamp>; Ctrl-C stops it (and pauses it)")

    cancelled: list[str] = []
    try:
        with sigterm_as_interrupt():  # until the event loop's own handlers take over
            cancelled = asyncio.run(_serve_until_stopped(deployment, poll, serving, recorder))
    except KeyboardInterrupt:  # before the runner started: no firing ran
        pass
    finally:
        recorder.stop()
        if not recorder.is_alive():  # a sweep still running on its thread would race this one on the same client
            with contextlib.suppress(Exception):  # skips since the last poll; the server may be gone already
                recorder.sweep()
            recorder.close()
    done = f"stopped serving {name}: " + ("the schedule was deleted" if recorder.deleted else "the schedule is paused")
    for run_id in unfinished(recorder.store, cancelled):
        done += f"; firing {run_id} in flight was cancelled: `rlvr resume {run_id} --store {store_root}` finishes it"
    say(done)


async def _serve_until_stopped(
    deployment: Any, poll: float, serving: Callable[[], None], recorder: SkipRecorder
) -> list[str]:
    """Prefect's Runner for the deployment until SIGINT or SIGTERM (or the recorder finds the deployment
    deleted), then the runner's own shutdown; returns the run ids of the firings that shutdown cancelled.

    Prefect's SIGTERM handler exits from inside the event loop, which skips that shutdown, so the loop's
    handlers replace it as soon as the runner has installed it (before its first await).
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def stop_from_the_recorder() -> None:
        loop.call_soon_threadsafe(stop.set)

    recorder.on_deleted = stop_from_the_recorder
    runner = Runner(
        name=f"rlvr-schedule-{deployment.name}",
        query_seconds=poll,
        prefetch_seconds=0,  # propose a firing only when it is due: the concurrency check happens then
        limit=None,  # every due firing reaches the server, which cancels the overlapping ones
        pause_on_shutdown=True,
    )
    deployment_id = await runner.aadd_deployment(deployment)
    # It exists now: a deletion before the recorder's first sweep (5 s on a cron schedule) must still count as one.
    # It did not: the sweep never saw it, and the process served on until Prefect's runner gave up minutes later.
    recorder.seen = True
    if stop.is_set():  # stopped while the deployment was being created: leave it paused, as a stop would
        async with get_client() as client:
            await client.pause_deployment(deployment_id)
        return []
    running = asyncio.create_task(runner.start())
    await asyncio.sleep(0)  # runner.start() has installed its SIGTERM handler: replace it
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    serving()
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    in_flight = await _firings_in_flight(deployment_id)
    if recorder.deleted:  # nothing left to pause on the way out
        runner.pause_on_shutdown = False
    if not running.done():
        if runner.started:
            await runner.astop()
        else:
            running.cancel()
    try:
        await running
    except asyncio.CancelledError:
        pass
    except ObjectNotFound:  # deleted after the recorder's last look: the runner's pause on the way out found nothing
        recorder.deleted = True
    return await _cancelled_firings(recorder.schedule, in_flight)


IN_FLIGHT = [StateType.PENDING, StateType.RUNNING]


async def _firings_in_flight(deployment_id: UUID) -> list[UUID]:
    """The deployment's flow runs that have started and not ended (on any runner serving it)."""
    async with get_client() as client:
        runs = await client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=IN_FLIGHT))),
            sort=FlowRunSort.EXPECTED_START_TIME_ASC,
            limit=200,
        )
    return [r.id for r in runs]


async def _cancelled_firings(name: str, flow_run_ids: list[UUID]) -> list[str]:
    """The run ids of those flow runs that are now cancelled: what this process's runner stopped on its way out."""
    cancelled = []
    async with get_client() as client:
        for flow_run_id in flow_run_ids:
            flow_run = await client.read_flow_run(flow_run_id)
            if flow_run.state_type in (StateType.CANCELLED, StateType.CANCELLING):
                cancelled.append(firing_run_id(name, expected_start(flow_run)))
    return cancelled


def unfinished(store: Store, run_ids: list[str]) -> list[str]:
    """Those of the cancelled firings whose runs have not completed. A firing whose run record says completed had
    done its work: the stop caught only its process's last moments (its flow run not yet marked completed), and
    `rlvr resume` would have nothing to finish."""
    return [r for r in run_ids if (record := store.read_run(r)) is None or run_status(record) != "completed"]


def describe_trigger(interval: float | None, cron: str | None) -> str:
    return f"every {interval:g} s" if interval else f"cron '{cron}' (UTC)"


class SkipRecorder(threading.Thread):
    """Polls Prefect for firings of the schedule that it cancelled before they started (the concurrency
    limit) and records each as a skipped firing in the store; also names them NAME-<timestamp> in Prefect.

    Every sweep goes through one Prefect client: a new client builds an SSL context (about 30 ms of CPU), and
    two new ones a sweep were most of the serving process's CPU while it polled every second."""

    def __init__(self, store_root: str, name: str, every: float) -> None:
        super().__init__(name=f"rlvr-skips-{name}", daemon=True)
        self.store, self.schedule, self.every = open_store(store_root), name, every  # one thread at a time uses it
        self._stop_event = threading.Event()
        self._done: set[UUID] = set()
        self.seen = False  # the deployment existed at a sweep
        self.deleted = False  # ... and at a later sweep it did not: `rlvr schedule NAME --delete`
        self.on_deleted: Callable[[], None] = lambda: None
        self._clients = contextlib.ExitStack()
        self._client: SyncPrefectClient | None = None

    def run(self) -> None:
        while not self._stop_event.wait(self.every):
            try:
                self.sweep()
            except Exception:  # the server restarting, the deployment not created yet: try again next time
                continue

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)

    def client(self) -> SyncPrefectClient:
        """The Prefect client of every sweep, opened at the first."""
        if self._client is None:
            self._client = self._clients.enter_context(get_client(sync_client=True))
        return self._client

    def close(self) -> None:
        """Close the client (after the last sweep)."""
        self._clients.close()
        self._client = None

    def sweep(self) -> int:
        """Record the skips not yet recorded; returns how many were new. A deployment gone after it was seen was
        deleted: the serving process is told (`on_deleted`) and stops."""
        client = self.client()
        deployment = read_deployment(self.schedule, client)
        if deployment is None:
            if self.seen and not self.deleted:
                self.deleted = True
                self.on_deleted()
            return 0
        self.seen = True
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(not_any_=[StateType.SCHEDULED]))
            ),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            limit=200,
        )
        new = 0
        for index, flow_run in enumerate(runs):
            if flow_run.id in self._done or not skipped(flow_run):
                continue
            firing = self.skip_of(flow_run, runs[index + 1 :])
            record_firing(self.store, firing)
            if flow_run.name != firing.run_id:
                client.update_flow_run(flow_run.id, name=firing.run_id)
            self._done.add(flow_run.id)
            new += 1
        return new

    def skip_of(self, flow_run: FlowRun, earlier: list[FlowRun]) -> Firing:
        """The skipped firing; when the concurrency limit cancelled it, blocked by the newest earlier firing
        that did run (a firing cancelled by hand before it started is skipped too, blocked by nobody)."""
        message = flow_run.state.message if flow_run.state and flow_run.state.message else "cancelled"
        holder = next((r for r in earlier if not skipped(r)), None)
        blocked_by = None
        if holder is not None and "concurrency limit" in message:
            blocked_by = firing_run_id(self.schedule, expected_start(holder))
        reason = f"previous run {blocked_by} still running" if blocked_by else "cancelled before it started"
        return Firing(
            schedule=self.schedule,
            run_id=firing_run_id(self.schedule, expected_start(flow_run)),
            scheduled_at=expected_start(flow_run).astimezone(UTC).isoformat(),
            outcome="skipped",
            reason=f"{reason} (Prefect: {message})",
            flow_run_id=str(flow_run.id),
            blocked_by=blocked_by,
        )


def expected_start(flow_run: FlowRun) -> datetime:
    """When the firing was due (a scheduled run always has it; its creation time otherwise)."""
    return flow_run.expected_start_time or flow_run.created or datetime.now(UTC)


def skipped(flow_run: FlowRun) -> bool:
    """Cancelled before it ever ran: what Prefect's CANCEL_NEW concurrency strategy does to a firing."""
    return flow_run.state_type == StateType.CANCELLED and flow_run.run_count == 0


# ----- listing and pausing ------------------------------------------------------------------------------


def schedule_rows(store_root: str) -> list[dict[str, Any]]:
    """The store's schedules on the Prefect server, with what the store holds of each."""
    store = open_store(store_root)
    with get_client(sync_client=True) as client:
        deployments = client.read_deployments(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[FLOW_NAME])), sort=DeploymentSort.NAME_ASC, limit=200
        )
    rows = []
    for deployment in sorted(deployments, key=lambda d: d.name):
        if deployment.parameters.get("store") != store_root:
            continue
        runs = pipeline_runs(store, deployment.name)
        statuses = [run_status(r) for r in runs]
        fired = firings(store, deployment.name)
        newest = newest_checkpoint(store, deployment.name)
        rows.append(
            {
                "schedule": deployment.name,
                "trigger": trigger_of(deployment),
                "state": "paused" if deployment.paused else "active",
                "served": "yes" if served(deployment) else "no",
                "completed": statuses.count("completed"),
                "failed": statuses.count("failed"),
                "running": statuses.count("running"),
                "skipped": sum(f["outcome"] == "skipped" for f in fired),
                "last_run": runs[-1]["run_id"] if runs else None,
                "newest_checkpoint": newest[1] if newest else None,
            }
        )
    return rows


def trigger_of(deployment: Any) -> str:
    if not deployment.schedules:
        return "none"
    schedule = deployment.schedules[0].schedule
    if getattr(schedule, "interval", None) is not None:
        return f"every {schedule.interval.total_seconds():g} s"
    if getattr(schedule, "cron", None) is not None:
        return f"cron '{schedule.cron}' ({schedule.timezone or 'UTC'})"
    return type(schedule).__name__


def served(deployment: Any, within: float = 30) -> bool:
    """Whether a runner polled for this deployment's firings lately (an `rlvr schedule` process is up)."""
    polled = deployment.last_polled
    return polled is not None and (datetime.now(UTC) - polled).total_seconds() < within


def schedule_of_store(store_root: str, name: str) -> Any:
    """The deployment of schedule `name`, which must exist and belong to this store (else one line)."""
    deployment = read_deployment(name)
    if deployment is None:
        raise UserError(f"no schedule {name!r} on this Prefect server; see `rlvr schedule --list`")
    check_owner(deployment, store_root)
    return deployment


def set_paused(store_root: str, name: str, paused: bool) -> str:
    """Pause (no more firings; scheduled ones are dropped) or resume a schedule of this store; says what it did."""
    deployment = schedule_of_store(store_root, name)
    with get_client(sync_client=True) as client:
        if paused:
            client.pause_deployment(deployment.id)
        else:
            client.resume_deployment(deployment.id)
    done = f"schedule {name} {'paused' if paused else 'resumed'}"
    if not paused and not served(deployment):
        done += f"; no `rlvr schedule {name}` process serves it now, so its firings wait until one does"
    return done


def delete_schedule(store_root: str, name: str) -> str:
    """Delete schedule `name`: its Prefect deployment, with the firings Prefect had scheduled and its concurrency
    limit. The store keeps the pipeline's runs, checkpoints and `firings` rows (history, and the lineage of
    later runs); a new schedule of the same name continues from its newest checkpoint. Refused while an
    `rlvr schedule NAME` process serves it unpaused: stopping that process first pauses it and cancels a
    firing in flight. A paused schedule's serving process, if any, stops when it sees the deletion."""
    deployment = schedule_of_store(store_root, name)
    if served(deployment) and not deployment.paused:
        raise UserError(
            f"schedule {name} is being served by an `rlvr schedule {name}` process; stop that process first "
            f"(Ctrl-C; it pauses the schedule) or pause it (`rlvr schedule {name} --pause`), then delete it"
        )
    with get_client(sync_client=True) as client:
        try:
            client.delete_deployment(deployment.id)
        except ObjectNotFound:  # deleted meanwhile by someone else
            raise UserError(f"no schedule {name!r} on this Prefect server; see `rlvr schedule --list`") from None
    return f"schedule {name} deleted; its runs and firings stay in the store"
