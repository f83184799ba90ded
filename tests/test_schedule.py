"""Recurring pipelines: firings named NAME-<timestamp>, each continuing from the newest checkpoint, and
overlapping firings skipped and recorded; the acceptance test serves a real schedule on a real local
Prefect server (`prefect server start`) started here."""

from __future__ import annotations

import importlib.metadata
import json
import re
import signal
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
from packaging.version import Version

from rlvr.errors import UserError
from rlvr.flows.cli.commands import check_schedule_name
from rlvr.flows.runs import final_checkpoint
from rlvr.flows.schedule import (
    Firing,
    SkipRecorder,
    firing_config,
    firing_run_id,
    firings,
    pipeline_runs,
    record_firing,
    schedule_deployment,
    unfinished,
)
from rlvr.flows.ui import free_port, start_server
from rlvr.storage.lineage import ancestors
from rlvr.storage.run_records import run_status
from rlvr.storage.stage import run_stage
from rlvr.storage.store import Store
from rlvr.storage.views import query
from rlvr.tasks.initialize import INITIALIZE
from rlvr.trainer.policy import PolicyConfig
from tests.cli_helpers import cli_env, rlvr, wait_for
from tests.fork_server import Forked, ForkServer, fork_server
from tests.test_cli import assert_one_line_error

WEIGHTS = "model.safetensors"


def initial_checkpoint(store: Store, run_id: str, seed: int, checkpoint: str | None = None) -> str:
    cfg = PolicyConfig(checkpoint=checkpoint)
    inputs = {"checkpoint": checkpoint} if checkpoint else {}
    return run_stage(store, INITIALIZE, cfg, run_id=run_id, seed=seed, step=0, inputs=inputs, params={"seed": seed}).id


def test_firing_run_ids_are_the_name_and_the_utc_firing_time():
    assert firing_run_id("nightly", datetime(2026, 11, 24, 3, 0, 5, tzinfo=UTC)) == "nightly-20261124-030005"
    plus_two = timezone(timedelta(hours=2))
    assert firing_run_id("nightly", datetime(2026, 11, 24, 5, 0, 5, tzinfo=plus_two)) == "nightly-20261124-030005"
    assert check_schedule_name("a.b_c-1") == "a.b_c-1"
    for bad in ("a/b", "-x", "x" * 49, ""):
        with pytest.raises(UserError, match="bad schedule name"):
            check_schedule_name(bad)


def test_a_run_can_start_from_another_runs_checkpoint(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    earlier = initial_checkpoint(store, "earlier", seed=3)
    continued = initial_checkpoint(store, "later", seed=7, checkpoint=earlier)
    fresh = initial_checkpoint(store, "fresh", seed=7)
    assert store.read_file(continued, WEIGHTS) == store.read_file(earlier, WEIGHTS)
    assert store.read_file(fresh, WEIGHTS) != store.read_file(earlier, WEIGHTS)  # seed 7 alone gives other weights
    assert store.manifest(continued).parents == [earlier]
    assert earlier in {m.artifact_id for m in ancestors(store, continued)}
    row = query(store, f"SELECT run_id, policy_id FROM checkpoints WHERE artifact_id = '{continued}'").to_pylist()
    assert row == [{"run_id": "later", "policy_id": earlier}]


def test_a_lora_run_from_a_full_checkpoint_gets_fresh_adapters_and_keeps_them_when_continued(tmp_path):
    from rlvr.trainer.checkpoints import load_policy
    from rlvr.trainer.devices import CPU
    from rlvr.trainer.lora import ADAPTER_FILE, LoraSettings, has_lora

    store = Store.open(str(tmp_path / "s"), create=True)
    full = initial_checkpoint(store, "full", seed=3)
    lora = PolicyConfig(checkpoint=full, lora=LoraSettings(r=4))
    adapted = run_stage(
        store, INITIALIZE, lora, run_id="lora", seed=5, step=0, inputs={"checkpoint": full}, params={"seed": 5}
    ).id
    assert has_lora(load_policy(store, adapted, device=CPU).model)
    adapter = store.read_file(adapted, ADAPTER_FILE)
    again = run_stage(
        store,
        INITIALIZE,
        lora.model_copy(update={"checkpoint": adapted}),
        run_id="lora-2",
        seed=9,  # another seed would draw other fresh adapters: the checkpoint's are kept instead
        step=0,
        inputs={"checkpoint": adapted},
        params={"seed": 9},
    ).id
    assert store.read_file(again, ADAPTER_FILE) == adapter


def test_a_bad_starting_checkpoint_is_a_one_line_error(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    with pytest.raises(UserError, match="'checkpoints-0000' is no artifact in store"):
        initial_checkpoint(store, "r", seed=0, checkpoint="checkpoints-0000")
    firing = Firing(
        schedule="p", run_id="p-20261124-030000", scheduled_at="t", outcome="skipped", reason="x", flow_run_id="f"
    )
    other = record_firing(store, firing)
    with pytest.raises(UserError, match=f"{other!r} is a firings artifact"):
        initial_checkpoint(store, "r", seed=0, checkpoint=other)
    with pytest.raises(UserError, match="does not start from checkpoints"):  # a flow that does not pass the input
        run_stage(store, INITIALIZE, PolicyConfig(checkpoint=other), run_id="r", step=0, params={"seed": 0})


def test_each_firing_continues_from_the_newest_completed_run_of_its_pipeline(tmp_path):
    from rlvr.flows.config import load_config

    store = Store.open(str(tmp_path / "s"), create=True)
    checkpoints = {}
    for run_id, status in [
        ("pipe-20261124-030000", "completed"),
        ("pipe-20261124-040000", "failed"),  # newer, but failed: not a starting point
        ("pipeline-20261124-045000", "completed"),  # another pipeline
        ("pipe-manual", "completed"),  # not a firing of pipe
    ]:
        checkpoints[run_id] = initial_checkpoint(store, run_id, seed=len(checkpoints))
        store.write_run({"run_id": run_id, "status": status, "config_json": "{}"})
    assert [r["run_id"] for r in pipeline_runs(store, "pipe")] == ["pipe-20261124-030000", "pipe-20261124-040000"]
    assert final_checkpoint(store, "pipe-20261124-030000") == checkpoints["pipe-20261124-030000"]

    config_json = load_config(None, ["warmstart.steps=5", "train.steps=3"]).model_dump_json()
    cfg = firing_config(store, "pipe", config_json, "pipe-20261124-050000")
    assert (cfg.run_id, cfg.policy.checkpoint, cfg.warmstart.steps, cfg.train.steps) == (
        "pipe-20261124-050000",
        checkpoints["pipe-20261124-030000"],
        0,  # the warm start begins a pipeline; a continuing firing skips it
        3,
    )
    first = firing_config(store, "pipe", config_json, "pipe-20261124-020000")  # older than every run
    assert (first.policy.checkpoint, first.warmstart.steps) == (None, 5)


def test_firings_are_recorded_once_per_flow_run_and_outcome(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    start = initial_checkpoint(store, "p-20261124-030000", seed=0)
    at = dict(schedule="p", reason="r", flow_run_id="f2")
    started = Firing(
        run_id="p-20261124-030005", scheduled_at="2026-11-24T03:00:05", outcome="started", start_checkpoint=start, **at
    )
    skipped = Firing(
        run_id="p-20261124-030010",
        scheduled_at="2026-11-24T03:00:10",
        outcome="skipped",
        blocked_by="p-20261124-030005",
        schedule="p",
        reason="previous run p-20261124-030005 still running",
        flow_run_id="f3",
    )
    ids = {record_firing(store, f) for f in (skipped, started, started, skipped)}
    assert len(ids) == 2 == len(store.manifests(kind="firings"))
    rows = firings(store, "p")
    assert [(r["run_id"], r["outcome"], r["blocked_by"]) for r in rows] == [
        ("p-20261124-030005", "started", None),
        ("p-20261124-030010", "skipped", "p-20261124-030005"),
    ]
    assert store.manifest(record_firing(store, started)).parents == [start]
    assert firings(store, "other") == []


def test_a_stop_names_as_cancelled_only_the_firings_whose_runs_had_not_completed(tmp_path):
    """A stop can catch a firing whose run has completed and whose process is still ending (its flow run not yet
    marked completed): that one had nothing left for `rlvr resume` to finish (a fresh clone's test_schedule once
    reported it so); a running one, or one that never wrote its record, is named."""
    store = Store.open(str(tmp_path / "store"), create=True)
    store.write_run({"run_id": "p-20261203-005313", "status": "completed"})
    store.write_run({"run_id": "p-20261203-005317", "status": "running"})  # this process's pid: alive
    fired = ["p-20261203-005313", "p-20261203-005317", "p-20261203-005321"]
    assert unfinished(store, fired) == ["p-20261203-005317", "p-20261203-005321"]


def test_schedule_arguments_are_checked_before_anything_starts(tmp_path, schedule_forks):
    store = str(tmp_path / "s")
    assert_one_line_error(
        rlvr("schedule", "p", "--store", store, forks=schedule_forks), "give one of --interval SECONDS or --cron EXPR"
    )
    both = rlvr("schedule", "p", "--interval", "5", "--cron", "0 3 * * *", "--store", store, forks=schedule_forks)
    assert_one_line_error(both, "give one of --interval SECONDS or --cron EXPR")
    assert_one_line_error(
        rlvr("schedule", "--list", "--pause", "--store", store, forks=schedule_forks), "choose one of --list, --pause"
    )
    assert_one_line_error(rlvr("schedule", "--pause", "--store", store, forks=schedule_forks), "name the schedule")
    assert_one_line_error(
        rlvr("schedule", "p", "--pause", "--interval", "5", "--store", store, forks=schedule_forks), "--pause takes no"
    )
    too_often = rlvr("schedule", "p", "--interval", "0.5", "--store", store, forks=schedule_forks)
    assert too_often.returncode == 2 and "greater than or equal to 1" in too_often.stderr
    assert_one_line_error(rlvr("schedule", "--delete", "--store", store, forks=schedule_forks), "name the schedule")
    assert_one_line_error(
        rlvr("schedule", "p", "--delete", "--pause", "--store", store, forks=schedule_forks),
        "choose one of --pause, --delete",
    )
    assert_one_line_error(
        rlvr("schedule", "p", "--delete", "--cron", "0 3 * * *", "--store", store, forks=schedule_forks),
        "--delete takes no",
    )


# ----- the acceptance test: a real Prefect server, a served interval schedule -------------------------

PIPELINE = """\
train: {steps: 2}
warmstart: {steps: 0}
select: {batch_size: 4}
allocate: {n: 2}
difficulty: {k: 2, shard_size: 16}
evaluate: {every: 2}
checkpoint: {every: 2}
flow: {steps_per_subflow: 2}
synthesize: {source: {type: skills, per_category: 6}}
"""


def require_a_scheduler_that_can_insert_runs() -> None:
    """Prefect 3.8.8's scheduler fails every pass with SQLAlchemy 2.1 ("Can't evaluate bulk DML statement"),
    so no firing would ever be created; say so at once instead of timing out."""
    version = importlib.metadata.version("sqlalchemy")
    if Version(version) >= Version("2.1"):
        pytest.fail(f"SQLAlchemy {version} breaks Prefect 3.8.8's scheduler service; install 'sqlalchemy<2.1'")


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """`prefect server start` on localhost (its own home and database), as `rlvr ui` starts it."""
    require_a_scheduler_that_can_insert_runs()
    server = start_server(tmp_path_factory.mktemp("prefect-server"), port=free_port(), started_by="the tests")
    yield server.api_url
    server.stop()


@pytest.fixture(scope="module")
def schedule_forks(prefect_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """The module's `rlvr` processes, forked by one interpreter on its Prefect server (tests/fork_server.py): about
    7 CPU-s of imports paid once, not by each `rlvr schedule`."""
    yield from fork_server(cli_env(PREFECT_API_URL=prefect_server), tmp_path_factory.mktemp("schedule-forks"))


def assert_continues(store: Store, first: str, second: str, first_final: str) -> None:
    """The second run's initial checkpoint is the first run's final one: same weights, linked by lineage; and
    the second run re-synthesized its data and re-estimated difficulty with that checkpoint."""
    start = query(store, f"SELECT artifact_id FROM checkpoints WHERE run_id = '{second}' AND stage = 'initialize'")
    second_start = start.to_pylist()[0]["artifact_id"]
    assert store.manifest(second_start).parents[-1] == first_final
    assert store.read_file(second_start, WEIGHTS) == store.read_file(first_final, WEIGHTS)
    came_from = {(m.run_id, m.stage) for m in ancestors(store, second_start)}
    assert {(first, "checkpoint"), (first, "synthesize"), (second, "config")} <= came_from
    difficulty = [m for m in store.manifests(kind="difficulty", run_id=second)]
    assert difficulty and second_start in difficulty[0].parents
    assert store.manifests(kind="problems", run_id=second)


def blocked_skips(skips: list[dict], last_started: str) -> list[dict]:
    """The skipped firings blocked by an earlier firing that ran, each checked. A firing due when the server
    stopped is cancelled by the stop, blocked by nobody: it must be due after every firing that ran."""
    skipped_ids = {f["run_id"] for f in skips}
    at_stop = [f for f in skips if f["blocked_by"] is None]
    assert all(f["run_id"] > last_started and f["reason"].startswith("cancelled before it started") for f in at_stop)
    blocked = [f for f in skips if f["blocked_by"] is not None]
    for skip in blocked:
        assert skip["blocked_by"] < skip["run_id"] and skip["blocked_by"] not in skipped_ids, skip
        assert f"previous run {skip['blocked_by']} still running" in skip["reason"]
    return blocked


@pytest.mark.slow
def test_an_interval_schedule_continues_from_checkpoints_and_skips_overlapping_firings(
    prefect_server, schedule_forks, tmp_path
):
    root = str(tmp_path / "store")
    config = tmp_path / "pipeline.yaml"
    config.write_text(PIPELINE)
    log = tmp_path / "schedule.log"
    args = ["schedule", "pipe", "--interval", "4", "--config", str(config), "--store", root]
    serving = schedule_forks.start(args, stdout=log, stderr=log)
    api = httpx.Client(base_url=prefect_server, timeout=30)  # one connection for the polls, not one a poll
    try:

        def statuses() -> list[str]:
            if not (Path(root) / "STORE").exists():
                return []
            return [str(r["status"]) for r in pipeline_runs(Store.open(root), "pipe")]

        def slot_taken() -> int:
            """How many firings got the schedule's one concurrency slot (the first, then the second, ...)."""
            body = {
                "deployments": {"name": {"any_": ["pipe"]}},
                "flow_runs": {"state": {"type": {"any_": ["PENDING", "RUNNING", "COMPLETED"]}}},
            }
            return len(api.post("/flow_runs/filter", json=body).json())

        wait_for(slot_taken, 300, "the first firing", log=log, every=1)
        listed = rlvr("schedule", "--list", "--store", root, forks=schedule_forks)
        assert listed.returncode == 0, listed.stderr
        row = next(line for line in listed.stdout.splitlines() if "pipe" in line)
        assert re.search(r"every 4 s.*active.*yes", row), listed.stdout
        # Paused once the second firing holds the slot (it has still to start Python and run): that run goes on to
        # the end, and no third firing starts only to be cancelled by the stop
        wait_for(lambda: slot_taken() >= 2, 300, "the second firing", log=log, every=1)
        paused = rlvr("schedule", "pipe", "--pause", "--store", root, forks=schedule_forks)
        assert paused.returncode == 0 and "schedule pipe paused" in paused.stdout, paused.stderr
        deployment = httpx.get(f"{prefect_server}/deployments/name/rlvr-pipeline/pipe").json()
        assert deployment["paused"] is True
        wait_for(lambda: statuses()[:2] == ["completed", "completed"], 300, "two runs", log=log, every=2)
    finally:
        api.close()
        serving.send_signal(signal.SIGTERM)
        assert serving.wait(timeout=60) == 0, log.read_text()[-3000:]
    assert last_line(log) == "stopped serving pipe: the schedule is paused"  # nothing in flight: none cancelled

    store = Store.open(root)
    runs = [r for r in pipeline_runs(store, "pipe") if r["status"] == "completed"]
    assert all(re.fullmatch(r"pipe-\d{8}-\d{6}", r["run_id"]) for r in runs)
    first, second = runs[0]["run_id"], runs[1]["run_id"]
    first_final = final_checkpoint(store, first)
    assert json.loads(runs[0]["config_json"])["policy"]["checkpoint"] is None
    assert json.loads(runs[1]["config_json"])["policy"]["checkpoint"] == first_final

    assert_continues(store, first, second, first_final)

    recorded = firings(store, "pipe")
    started = {f["run_id"]: f for f in recorded if f["outcome"] == "started"}
    assert started[first]["start_checkpoint"] is None and started[second]["start_checkpoint"] == first_final
    skips = blocked_skips([f for f in recorded if f["outcome"] == "skipped"], last_started=max(started))
    while_first_ran = [f for f in skips if first < f["run_id"] < second]
    assert while_first_ran and {f["blocked_by"] for f in while_first_ran} == {first}
    assert all(store.read_run(f["run_id"]) is None for f in skips)  # a skipped firing never became a run
    named = httpx.post(
        f"{prefect_server}/flow_runs/filter", json={"flow_runs": {"name": {"any_": [skips[0]["run_id"]]}}}
    ).json()
    assert [(r["state_type"], r["run_count"]) for r in named] == [("CANCELLED", 0)]


def serve(name: str, args: list[str], root: str, forks: ForkServer, log: Path) -> Forked:
    """`rlvr schedule NAME ARGS` in the background (forked by `forks`), once it says it serves (its output in
    `log`)."""
    serving = forks.start(["schedule", name, *args, "--store", root], stdout=log, stderr=log)

    def up() -> bool:
        if serving.poll() is not None:
            raise AssertionError(f"rlvr schedule {name} ended: {log.read_text()[-3000:]}")
        return f"serving schedule {name}:" in log.read_text()

    wait_for(up, 120, f"schedule {name} to be served", log=log)
    return serving


def last_line(log: Path) -> str:
    return log.read_text().strip().splitlines()[-1]


NEVER_NOW = "0 0 1 1 *"  # 00:00 UTC on January 1st: no firing while the test runs


@pytest.mark.slow
def test_a_schedule_stopped_with_nothing_in_flight_says_so_and_can_be_deleted(prefect_server, schedule_forks, tmp_path):
    """Refused while served unpaused; paused, deleted: the serving process sees it gone and stops by itself. (The
    stop by a signal with nothing in flight ends the interval test; the pause on that stop, the busy one.)"""
    root = str(tmp_path / "store")
    log = tmp_path / "idle.log"
    serving = serve("idle", ["--cron", NEVER_NOW], root, schedule_forks, log)
    try:
        refused = rlvr("schedule", "idle", "--delete", "--store", root, forks=schedule_forks)
        assert_one_line_error(refused, "schedule idle is being served by an `rlvr schedule idle` process; stop that")
        assert rlvr("schedule", "idle", "--pause", "--store", root, forks=schedule_forks).returncode == 0
        deleted = rlvr(
            "schedule", "idle", "--delete", "--store", root, forks=schedule_forks
        )  # paused: no firing can start
        assert (deleted.returncode, deleted.stdout) == (
            0,
            "schedule idle deleted; its runs and firings stay in the store\n",
        )
        # it sees the deletion at its next poll (5 s), then Prefect's runner shuts down; deleted before that first
        # poll, it once never saw the deletion and served on for minutes
        assert serving.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        serving.kill()
    assert last_line(log) == "stopped serving idle: the schedule was deleted"  # no firing ran: none was cancelled

    assert httpx.get(f"{prefect_server}/deployments/name/rlvr-pipeline/idle").status_code == 404
    assert "no schedules for store" in rlvr("schedule", "--list", "--store", root, forks=schedule_forks).stdout
    again = rlvr("schedule", "idle", "--delete", "--store", root, forks=schedule_forks)
    assert_one_line_error(again, "no schedule 'idle' on this Prefect server; see `rlvr schedule --list`")


@pytest.mark.slow
def test_the_skip_recorder_sweeps_through_one_prefect_client(prefect_server, tmp_path, monkeypatch):
    """A new Prefect client costs about 30 ms of CPU (its SSL context); two a sweep, every second, were most of
    what a serving process spent. One client serves every sweep, and still sees the schedule deleted."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    import rlvr.flows.schedule as schedules

    opened: list[Any] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        opened.append(get_client(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(schedules, "get_client", counted)
    root = str(tmp_path / "store")
    Store.open(root, create=True)
    with temporary_settings(updates={PREFECT_API_URL: prefect_server}):
        deployment_id = schedule_deployment(root, "swept", "{}", interval=None, cron=NEVER_NOW).apply()
        recorder = SkipRecorder(root, "swept", every=1)
        deleted: list[bool] = []
        recorder.on_deleted = lambda: deleted.append(True)
        assert [recorder.sweep() for _ in range(3)] == [0, 0, 0] and recorder.seen and not deleted
        with get_client(sync_client=True) as client:
            client.delete_deployment(deployment_id)
        assert (recorder.sweep(), recorder.deleted, deleted) == (0, True, [True])
        assert len(opened) == 1  # it was 7: one to read the deployment and one to read its flow runs, each sweep
        recorder.close()


BUSY = PIPELINE.replace("train: {steps: 2}", "train: {steps: 400}")  # a firing that is still running when stopped


@pytest.mark.slow
def test_stopping_a_schedule_names_the_firing_it_cancelled(prefect_server, schedule_forks, tmp_path):
    root = str(tmp_path / "store")
    config = tmp_path / "busy.yaml"
    config.write_text(BUSY)
    log = tmp_path / "busy.log"
    serving = serve("busy", ["--interval", "2", "--config", str(config)], root, schedule_forks, log)
    try:

        def running() -> str | None:
            if not (Path(root) / "runs").is_dir():
                return None
            runs = [r for r in pipeline_runs(Store.open(root), "busy") if r["status"] == "running"]
            return str(runs[0]["run_id"]) if runs else None

        run_id = wait_for(running, 180, "a firing to run", log=log, every=1)
    finally:
        serving.send_signal(signal.SIGTERM)
        assert serving.wait(timeout=60) == 0, log.read_text()[-3000:]
    assert last_line(log) == (
        f"stopped serving busy: the schedule is paused; firing {run_id} in flight was cancelled: "
        f"`rlvr resume {run_id} --store {root}` finishes it"
    )
    assert run_status(Store.open(root).read_run(run_id)) == "failed"
    assert httpx.get(f"{prefect_server}/deployments/name/rlvr-pipeline/busy").json()["paused"] is True
