"""`rlvr runs`: status, progress, last held-out accuracy and heartbeat age of each run; for a failed run
the failing stage, the reason and the command that resumes it. A run whose process was SIGKILLed, or
whose heartbeat stopped on another host, shows as failed, not running forever."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from datetime import UTC, datetime, timedelta

import pytest

from rlvr import progress
from rlvr.errors import UserError
from rlvr.flows.runs import RunTracker, describe_run, resumable_run
from rlvr.storage.run_records import run_status
from rlvr.storage.store import Store
from tests.cli_helpers import cli_env, rlvr, wait_for
from tests.conftest import TINY_OVERRIDES

SHORT = [*TINY_OVERRIDES, "train.steps=2", "warmstart.steps=0", "evaluate.every=2", "checkpoint.every=2"]
SHORT += ["synthesize.source.per_category=4"]


def ago(seconds: float) -> str:
    return (datetime.now(UTC) - timedelta(seconds=seconds)).isoformat(timespec="seconds")


@pytest.mark.slow
def test_completed_and_failed_runs(tmp_path, prefect_api):
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute

    root = str(tmp_path / "store")
    summary = execute(root, load_config(None, ["run_id=good", *SHORT]))
    # a config value that passes validation and fails in a stage: a model directory that does not exist
    with pytest.raises(UserError):
        execute(root, load_config(None, ["run_id=bad", *SHORT, f"policy.model={tmp_path / 'no-model'}"]))
    store = Store.open(root)

    good = describe_run(store.read_run("good"), root)
    assert (good["status"], good["progress"], good["step"], good["steps"]) == ("completed", "2/2", 2, 2)
    assert good["accuracy"] == summary["accuracy_final"]
    assert 0 <= good["heartbeat_age_s"] < 120 and good["heartbeat"].endswith(" ago")
    assert good["failed_stage"] is good["reason"] is good["resume"] is None

    bad = describe_run(store.read_run("bad"), root)
    assert (bad["status"], bad["progress"]) == ("failed", "0/2")
    assert bad["failed_stage"] == "initialize (step 0)"
    assert bad["reason"].startswith("UserError: ") and "no-model" in bad["reason"]
    assert bad["resume"] == f"rlvr resume bad --store {root}"

    shown = rlvr("runs", "--store", root)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert any("good" in line and "completed" in line and "2/2" in line for line in lines)
    assert f"bad failed in initialize (step 0): {bad['reason']}" in shown.stdout
    assert f"  resume: rlvr resume bad --store {root}" in lines
    as_json = [json.loads(line) for line in rlvr("runs", "--store", root, "--format", "json").stdout.splitlines()]
    assert [r["run_id"] for r in as_json] == ["good", "bad"]
    assert as_json[1]["failed_stage"] == "initialize (step 0)"


@pytest.mark.slow
def test_sigkilled_run_shows_failed_with_its_resume_command(tmp_path, rlvr_forks):
    root = str(tmp_path / "store")
    args = ["run", "--store", root, "--run-id", "killed"]
    for override in [*TINY_OVERRIDES, "train.steps=400", "warmstart.steps=0", "synthesize.source.per_category=4"]:
        args += ["--set", override]
    proc = rlvr_forks.start(args, env={**rlvr_forks.env, "RLVR_HEARTBEAT_S": "0.1"})
    record_path = tmp_path / "store" / "runs" / "killed.json"

    def stepping() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended first: {proc.stderr_text()[-2000:]}")
        try:
            stepped = (json.loads(record_path.read_text()).get("step") or 0) >= 1
        except (FileNotFoundError, json.JSONDecodeError):
            return False
        # ... and a step's commit has landed (commits finish in the background, beside the next step)
        return stepped and any((tmp_path / "store" / "manifests").glob("train_steps-*.json"))

    try:
        wait_for(stepping, 240, "the run's first RL step", every=0.02)
    except AssertionError:
        proc.kill()
        raise
    running = describe_run(Store.open(root).read_run("killed"), root)
    assert running["status"] == "running" and running["resume"] is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    record = Store.open(root).read_run("killed")
    assert record["status"] == "running"  # what the dead process left behind
    shown = describe_run(record, root)
    assert shown["status"] == "failed"
    host = socket.gethostname()
    assert shown["reason"] == f"process {proc.pid} on {host} ended without finishing the run (killed or crashed)"
    step = record["step"]
    assert step >= 1 and shown["progress"] == f"{step}/400"
    assert shown["failed_stage"] == f"rl (step {step + 1})"
    assert shown["resume"] == f"rlvr resume killed --store {root}"
    assert resumable_run(Store.open(root), "killed")["run_id"] == "killed"  # resume accepts it
    # The record's progress is up to a heartbeat old; given the store, where it failed comes from its commits.
    committed = max(m.step for m in Store.open(root).manifests(kind="train_steps", run_id="killed"))
    exact = describe_run(record, root, Store.open(root))
    assert exact["failed_stage"] == f"rl (step {committed + 1})" and exact["step"] == committed
    listed = rlvr("runs", "--store", root)
    assert f"killed failed in rl (step {committed + 1}): process {proc.pid}" in listed.stdout


def test_stale_heartbeat_from_another_host_is_failed(tmp_path, monkeypatch):
    store = Store.open(str(tmp_path / "store"), create=True)
    base = {"status": "running", "pid": 4242, "host": "gpu-node-7", "kind": "rl", "steps": 100, "step": 40}
    store.write_run({**base, "run_id": "stale", "heartbeat_at": ago(20 * 60), "phase": "rl", "accuracy": 0.5})
    store.write_run({**base, "run_id": "fresh", "heartbeat_at": ago(60)})
    store.write_run({**base, "run_id": "old-format"})  # a record without heartbeats: only the pid check applies

    stale = describe_run(store.read_run("stale"), "s3://bucket/store")
    assert stale["status"] == "failed"
    assert stale["reason"].startswith("no heartbeat from process 4242 on gpu-node-7 for 12")
    assert stale["reason"].endswith("s (limit 600 s, RLVR_HEARTBEAT_TIMEOUT_S)")
    assert (stale["failed_stage"], stale["progress"], stale["accuracy"]) == ("rl (step 41)", "40/100", 0.5)
    assert stale["heartbeat"] == "20 min ago"
    assert stale["resume"] == "rlvr resume stale --store s3://bucket/store"
    assert run_status(store.read_run("fresh")) == "running"
    assert run_status(store.read_run("old-format")) == "running"

    monkeypatch.setenv("RLVR_HEARTBEAT_TIMEOUT_S", "30")
    assert run_status(store.read_run("fresh")) == "failed"
    monkeypatch.setenv("RLVR_HEARTBEAT_TIMEOUT_S", "soon")
    with pytest.raises(UserError, match=r"RLVR_HEARTBEAT_TIMEOUT_S='soon': give a number of seconds"):
        run_status(store.read_run("fresh"))


def test_tracker_writes_progress_and_heartbeats(tmp_path):
    store = Store.open(str(tmp_path / "store"), create=True)
    store.write_run({"run_id": "r", "status": "running", "heartbeat_at": ago(3600)})
    with RunTracker(Store(store.root), "r", interval_s=0.05):
        progress.report("stage", name="difficulty")
        progress.report("eval", step=0, phase="init", accuracy=0.25)
        progress.report("step", step=3, reward=0.5)
        time.sleep(0.4)
        beating = store.read_run("r")
    assert (beating["status"], beating["phase"], beating["step"]) == ("running", "rl", 3)
    assert (beating["accuracy"], beating["accuracy_step"]) == (0.25, 0)
    assert beating["pid"] == os.getpid()
    assert describe_run(beating)["heartbeat_age_s"] < 5  # the hour-old heartbeat was replaced
    after = store.read_run("r")["updated_at"]  # the beats stop with the tracker
    time.sleep(0.2)
    assert store.read_run("r")["updated_at"] == after


def test_run_ids_are_never_cut_in_a_narrow_table(tmp_path):
    """An id is what a user copies from `rlvr runs`: at 80 columns a run id of the longest length the config allows
    (64) is printed whole on one line; the other columns shrink (here the start time wraps at its space)."""
    store = Store.open(str(tmp_path / "store"), create=True)
    longest = "nightly-" + "x" * 40 + "-20261202-101112"
    assert len(longest) == 64
    started = {"status": "completed", "kind": "rl", "steps": 200, "created_at": "2026-12-02T10:11:12+00:00"}
    store.write_run({**started, "run_id": longest, "step": 200, "accuracy": 0.5})
    store.write_run({**started, "run_id": "short", "step": 20})

    shown = rlvr("runs", "--store", store.root, env=cli_env(COLUMNS="80"))
    assert shown.returncode == 0, shown.stderr
    row = next(line for line in shown.stdout.splitlines() if "nightly-" in line)
    cells = [cell.strip() for cell in row.strip("│ ").split("│")]
    assert [*cells[:4], cells[-1]] == [longest, "completed", "200/200", "0.50", "12-02"]  # cells[4]: the heartbeat
    assert "12-02 10:11" not in shown.stdout and "│ 10:11" in shown.stdout  # the time wrapped, not the id
