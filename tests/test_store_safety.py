"""Store safety without a run: run leases (one owner per run, exact under races), checksums checked on every
read, damage found and judged rebuildable or not, and the one line each kind of damage gets."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from rlvr.data.validate import validate
from rlvr.errors import environment_failure
from rlvr.storage.errors import DamagedArtifact, DamagedFile
from rlvr.storage.ids import canonical_json
from rlvr.storage.integrity import find_damage, find_leftovers, repair_run
from rlvr.storage.leases import (
    RunClaimed,
    RunExists,
    claim_run,
    current_owner,
    lease_path,
    live_runs,
    newest_lease_number,
    owner_gone,
    owning,
)
from rlvr.storage.processes import pid_start_time
from rlvr.storage.stage import rows_to_table
from rlvr.storage.store import Store


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store.open(str(tmp_path / "store"), create=True)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def write_lease(store: Store, run_id: str, number: int, **fields: Any) -> None:
    record = {"pid": os.getpid(), "host": socket.gethostname(), "claimed_at": datetime.now(UTC).isoformat()}
    record.update(fields)
    store.fs.makedirs(store.path("leases", run_id), exist_ok=True)
    store.fs.pipe_file(lease_path(store, run_id, number), canonical_json(record).encode())


# ----- leases --------------------------------------------------------------------------------------------


def test_a_run_has_one_owner_and_a_second_claim_names_it(store: Store) -> None:
    lease = claim_run(store, "r1", new=True)
    assert lease.number == 0 and current_owner(store, "r1")["pid"] == os.getpid()
    with pytest.raises(RunClaimed) as caught:
        claim_run(store, "r1", new=False)
    assert str(caught.value).startswith(f"run 'r1' is already running: process {os.getpid()} on {socket.gethostname()}")
    assert live_runs(store).keys() == {"r1"}
    lease.release()
    assert current_owner(store, "r1") is None and live_runs(store) == {}
    with pytest.raises(RunExists, match="run 'r1' already exists in .*; continue it with `rlvr resume r1`"):
        claim_run(store, "r1", new=True)
    resumed = claim_run(store, "r1", new=False)
    assert resumed.number == 1 and newest_lease_number(store, "r1") == 1


def test_a_run_recorded_before_leases_is_not_claimed_as_new(store: Store) -> None:
    store.write_run({"run_id": "old", "status": "completed"})
    with pytest.raises(RunExists):
        claim_run(store, "old", new=True)
    with owning(store, "old") as lease:
        assert lease.number == 0
    assert json.loads(store.fs.cat_file(lease_path(store, "old", 0)))["released_at"] is not None


def test_an_owner_is_gone_when_its_process_is(monkeypatch: pytest.MonkeyPatch) -> None:
    here = socket.gethostname()
    now = datetime.now(UTC)
    mine = {"pid": os.getpid(), "host": here, "pid_started": pid_start_time(os.getpid())}
    assert owner_gone(mine) is None
    assert owner_gone({**mine, "released_at": now.isoformat()}) == "released"
    assert "has ended" in str(owner_gone({**mine, "pid": dead_pid()}))
    reused = owner_gone({**mine, "pid_started": (mine["pid_started"] or 0) + 1})  # same pid, another process
    assert reused is not None and "belongs to another process" in reused
    elsewhere = {"pid": 1, "host": "another-host", "heartbeat_at": (now - timedelta(seconds=30)).isoformat()}
    assert owner_gone(elsewhere, now) is None
    monkeypatch.setenv("RLVR_HEARTBEAT_TIMEOUT_S", "20")
    assert owner_gone(elsewhere, now) == "no heartbeat from process 1 on another-host for 30 s"


def test_a_dead_owner_is_taken_over_with_the_next_number(store: Store) -> None:
    write_lease(store, "r2", 0, pid=dead_pid())
    assert current_owner(store, "r2") is None
    lease = claim_run(store, "r2", new=False)
    assert lease.number == 1
    write_lease(store, "r3", 0)  # this process, alive: the run is taken
    with pytest.raises(RunClaimed):
        claim_run(store, "r3", new=False)


def test_a_lost_lease_stops_beating(store: Store) -> None:
    lease = claim_run(store, "r4", new=False)
    assert lease.beat()
    write_lease(store, "r4", 1)  # taken over by someone else meanwhile
    assert not lease.beat()


def _race(root: str, run_id: str, barrier: Any, results: Any) -> None:
    store = Store.open(root)
    barrier.wait()
    try:
        lease = claim_run(store, run_id, new=True)
        results.put(("won", lease.number))
    except (RunClaimed, RunExists) as exc:
        results.put(("lost", type(exc).__name__))


@pytest.mark.parametrize("repeat", range(5))
def test_exactly_one_of_many_racing_processes_claims_a_new_run(tmp_path: Path, repeat: int) -> None:
    root = str(tmp_path / f"race-{repeat}")
    Store.open(root, create=True)
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(6), context.Queue()
    racers = [context.Process(target=_race, args=(root, "same", barrier, results)) for _ in range(6)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(30)
    outcomes = sorted(results.get(timeout=5) for _ in racers)
    assert [o for o in outcomes if o[0] == "won"] == [("won", 0)]
    assert all(o[0] == "lost" for o in outcomes if o[0] != "won")


# ----- checksums on read ---------------------------------------------------------------------------------


def write_rows(store: Store, aid: str, run_id: str = "r", parents: list[str] | None = None, **extra: Any) -> str:
    table = pa.table({"x": list(range(50)), "y": [f"row {i}" for i in range(50)]})
    store.write_artifact(
        "test_rows", aid, table, run_id=run_id, stage="s", parents=parents or [], code_version="1", config={},
        files={"weights.bin": b"w" * 100}, extra=extra,
    )  # fmt: skip
    return aid


def flip_byte(path: str, offset: int = 40) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x01]))


def test_a_flipped_byte_is_caught_on_read_with_the_file_named(store: Store) -> None:
    write_rows(store, "rows-1")
    part = f"{store.artifact_dir('test_rows', 'rows-1')}/part-00000.parquet"
    flip_byte(part)
    fresh = Store.open(store.root)
    with pytest.raises(DamagedArtifact) as caught:
        fresh.read_table("rows-1")
    message = str(caught.value)
    assert f"{part}: sha256 " in message and "where the manifest recorded" in message
    assert "`rlvr resume r`" in message and caught.value.path == part
    assert fresh.verify_artifact("rows-1")[0][0] == part


def test_a_cut_part_and_a_damaged_file_are_caught(store: Store) -> None:
    write_rows(store, "rows-1")
    directory = store.artifact_dir("test_rows", "rows-1")
    with open(f"{directory}/part-00000.parquet", "r+b") as handle:
        handle.truncate(100)
    flip_byte(f"{directory}/files/weights.bin", 3)
    fresh = Store.open(store.root)
    with pytest.raises(DamagedArtifact, match=r"part-00000.parquet: 100 bytes where the manifest recorded \d+"):
        fresh.read_table("rows-1")
    with pytest.raises(DamagedArtifact, match=r"files/weights.bin: sha256"):
        fresh.read_file("rows-1", "weights.bin")
    problems = dict(fresh.verify_artifact("rows-1"))
    assert set(problems) == {f"{directory}/part-00000.parquet", f"{directory}/files/weights.bin"}


def test_damage_is_rebuildable_only_while_its_inputs_are_stored(store: Store) -> None:
    write_rows(store, "rows-a")
    write_rows(store, "rows-b", parents=["rows-a"])
    write_rows(store, "rows-c", parents=["rows-gone"])
    write_rows(store, "rows-d", parents=["rows-c"])
    for aid in ("rows-b", "rows-c", "rows-d"):
        flip_byte(f"{store.artifact_dir('test_rows', aid)}/part-00000.parquet")
    found = {d.artifact_id: d for d in find_damage(Store.open(store.root))}
    assert set(found) == {"rows-b", "rows-c", "rows-d"}
    assert found["rows-b"].rebuildable
    assert found["rows-c"].blocker == "its input rows-gone is no longer stored"
    assert found["rows-d"].blocker == "its input rows-c is damaged too and cannot be rebuilt"

    lines = repair_run(Store.open(store.root), "r")
    assert len(lines) == 3
    assert any(line.endswith("set aside, this run rebuilds it") and "rows-b" in line for line in lines)
    assert any("rows-c" in line and "cannot be rebuilt: its input rows-gone" in line for line in lines)
    fresh = Store.open(store.root)
    assert not fresh.exists("rows-b") and fresh.exists("rows-c") and fresh.exists("rows-d")  # b is made again
    assert [p.rsplit("/", 1)[-1].split(".")[0] for p in fresh.fs.ls(fresh.path("damaged"))] == ["rows-b"]


def test_a_policy_input_needs_its_weights(store: Store) -> None:
    """The rollouts of an old step cannot be sampled again: the policy's trainer state is gone."""
    store.write_artifact(
        "train_steps", "train_steps-1", rows_to_table("train_steps", [{"step": 1}]), run_id="r", stage="train",
        parents=[], code_version="1", config={}, step=1,
        extra={"stage_run": {"outputs": {"train_state": "train_state-gone"}}},
    )  # fmt: skip
    write_rows(store, "rows-rollouts", parents=["train_steps-1"])
    flip_byte(f"{store.artifact_dir('test_rows', 'rows-rollouts')}/part-00000.parquet")
    (damage,) = find_damage(Store.open(store.root))
    assert damage.blocker == (
        "it needs the weights of the policy after step 1 (train_steps-1), and only the run's newest trainer "
        "state is kept"
    )


# ----- one line per damaged file ------------------------------------------------------------------------


def test_an_unreadable_manifest_is_skipped_by_listings_and_named(store: Store) -> None:
    write_rows(store, "rows-1")
    write_rows(store, "rows-2")
    path = store.manifest_path("rows-2")
    with open(path, "wb") as handle:
        handle.write(b"\xff\xfe garbage")
    fresh = Store.open(store.root)
    assert [m.artifact_id for m in fresh.manifests()] == ["rows-1"]
    assert list(fresh.unreadable) == [path]
    assert fresh.unreadable[path].startswith(f"manifest {path} is unreadable (JSONDecodeError")
    with pytest.raises(DamagedFile, match="manifest .*rows-2.json is unreadable"):
        fresh.manifest("rows-2")
    (damage,) = find_damage(fresh)
    assert (damage.artifact_id, damage.kind, damage.run_id, damage.rebuildable) == ("rows-2", "test_rows", "r", True)


def test_an_unreadable_run_record_hides_no_other_run(store: Store) -> None:
    store.write_run({"run_id": "good", "status": "completed"})
    bad = store.path("runs", "bad.json")
    with open(bad, "wb") as handle:
        handle.write(b"\x00\x01 not json")
    assert [r["run_id"] for r in store.list_runs()] == ["good"]
    assert store.unreadable[bad].startswith(f"run record {bad} is unreadable")
    with pytest.raises(DamagedFile, match="`rlvr resume` of the run writes it again"):
        store.read_run("bad")


def test_uncommitted_folders_are_grouped_by_the_run_that_writes_them(store: Store) -> None:
    writer = store.writer("test_rows", "rows-live", run_id="live", stage="s", parents=[], code_version="1",
                          config={}, step=None, extra={})  # fmt: skip
    writer.write_shard(0, pa.table({"x": [1]}))
    dead = store.writer("test_rows", "rows-dead", run_id="dead", stage="s", parents=[], code_version="1",
                        config={}, step=None, extra={})  # fmt: skip
    dead.write_shard(0, pa.table({"x": [1]}))
    with owning(store, "live"):
        groups = {g.run_id: g.live for g in find_leftovers(store)}
        assert groups == {"live": True, "dead": False}


def test_machine_failures_are_one_line() -> None:
    assert environment_failure(OSError(28, "No space left on device")) == "no space left on the device"
    full = OSError(28, "No space left on device", "/store/runs/x.json")
    assert environment_failure(RuntimeError("wrapped").with_traceback(None)) is None
    try:
        try:
            raise full
        except OSError as inner:
            raise RuntimeError("a stage failed") from inner
    except RuntimeError as outer:
        assert environment_failure(outer) == "no space left on the device (/store/runs/x.json)"
    assert environment_failure(OSError(30, "Read-only file system", "/ro")) == "the file system is read-only (/ro)"
    assert environment_failure(ValueError("a bug")) is None


def test_control_characters_in_prompts_and_references_are_quarantined() -> None:
    rows = [
        {"source_index": 0, "prompt": "What is 1+1?", "reference": "2"},
        {"source_index": 1, "prompt": "What is\x00 2+2?", "reference": "4"},
        {"source_index": 2, "prompt": "Tab\tand\nnewlines\r are fine", "reference": "5"},
        {"source_index": 3, "prompt": "What is 3+3?", "reference": "6\x1b[2J"},
        {"source_index": 4, "prompt": "DEL \x7f here", "reference": "7"},
    ]
    accepted, rejected, read = validate(rows, "src", "math", 1000)
    assert read == 5 and [c.source_index for c in accepted] == [0, 2]
    assert [(r.source_index, r.check, r.reason) for r in rejected] == [
        (1, "prompt", "prompt contains control character U+0000 at character 7"),
        (3, "reference", "reference contains control character U+001B at character 1"),
        (4, "prompt", "prompt contains control character U+007F at character 4"),
    ]
