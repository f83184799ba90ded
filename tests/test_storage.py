"""The artifact store on a local directory and on fsspec's memory filesystem: ids, commit protocol,
cleanup, DuckDB views, runs and lineage, with exact expected values."""

from __future__ import annotations

import hashlib
import io
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlvr.storage import (
    Manifest,
    Store,
    ancestors,
    artifact_id,
    connect,
    derive_seed,
    descendants,
    query,
    resolve_id,
    row_id,
    run_status,
)
from rlvr.storage.errors import ArtifactNotFound, DamagedArtifact, StoreNotFound
from rlvr.storage.ids import canonical_json
from rlvr.storage.processes import host_tag, temp_writer_gone
from rlvr.storage.schemas import SCHEMAS

# ----- helpers ---------------------------------------------------------------------------------------


def make_table(kind: str, n: int, **columns: list[Any]) -> pa.Table:
    """A table of `kind` with n rows: given columns as passed, the others filled with simple values."""
    data: dict[str, list[Any]] = {}
    for schema_field in SCHEMAS[kind]:
        if schema_field.name in columns:
            data[schema_field.name] = columns[schema_field.name]
        elif pa.types.is_string(schema_field.type):
            data[schema_field.name] = [f"{schema_field.name}-{i}" for i in range(n)]
        elif pa.types.is_integer(schema_field.type):
            data[schema_field.name] = list(range(n))
        elif pa.types.is_floating(schema_field.type):
            data[schema_field.name] = [float(i) for i in range(n)]
        elif pa.types.is_list(schema_field.type):
            data[schema_field.name] = [[] for _ in range(n)]
        else:
            data[schema_field.name] = [None] * n
    return pa.table(data, schema=SCHEMAS[kind])


def write(
    store: Store, kind: str, table: pa.Table, *, parents: Sequence[str] = (), stage: str = "", **kw: Any
) -> Manifest:
    """Commit `table` under its content-addressed id."""
    stage = stage or kind
    config = kw.pop("config", {"n": table.num_rows})
    aid = artifact_id(kind, stage, "v1", config, list(parents), "run-1")
    return store.write_artifact(
        kind, aid, table, run_id="run-1", stage=stage, parents=list(parents), code_version="v1", config=config, **kw
    )


def put(store: Store, path: str, data: bytes) -> None:
    """Write a file by hand, as a crashed writer would have left it."""
    store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    store.fs.pipe_file(path, data)


def scalar(store: Store, sql: str) -> Any:
    con = connect(store)
    try:
        return con.execute(sql).fetchone()[0]
    finally:
        con.close()


def new_root(backend: str, base: str) -> str:
    if backend == "local":
        return os.path.join(base, f"store-{uuid.uuid4().hex[:8]}")
    return f"memory://rlvr-test-{uuid.uuid4().hex}"


def drop_root(root: str) -> None:
    fs, path = fsspec.core.url_to_fs(root)
    if root.startswith("memory://") and fs.exists(path):
        fs.rm(path, recursive=True)


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Store]:
    root = new_root(request.param, str(tmp_path))
    yield Store.open(root, create=True)
    drop_root(root)


# ----- ids -------------------------------------------------------------------------------------------


def test_canonical_json_is_sorted_compact_and_unicode() -> None:
    assert canonical_json({"b": 1, "a": ["é", 2.5]}) == '{"a":["é",2.5],"b":1}'


def test_artifact_id_matches_hand_computed_hash() -> None:
    text = '{"code_version":"v1","config":{"a":1},"kind":"problems","parents":[],"run_id":"r1","stage":"synthesize"}'
    expected = "problems-" + hashlib.sha256(text.encode()).hexdigest()[:20]
    assert artifact_id("problems", "synthesize", "v1", {"a": 1}, [], "r1") == expected


def test_artifact_id_is_deterministic_and_sensitive_to_every_input() -> None:
    base = dict(kind="rollouts", stage="rollout", code_version="v1", config={"k": 4}, parents=["a", "b"], run_id="r1")
    first = artifact_id(**base)
    assert first == artifact_id(**dict(base, config={"k": 4}))
    changes = [
        {"kind": "rewards"},
        {"stage": "label"},
        {"code_version": "v2"},
        {"config": {"k": 5}},
        {"parents": ["b", "a"]},
        {"parents": ["a"]},
        {"run_id": "r2"},
    ]
    ids = {first} | {artifact_id(**dict(base, **change)) for change in changes}
    assert len(ids) == 1 + len(changes)
    assert first.startswith("rollouts-") and len(first) == len("rollouts-") + 20


def test_row_id_and_derive_seed() -> None:
    assert row_id("p", 7, "x") == "p-" + hashlib.sha256(b'[7,"x"]').hexdigest()[:16]
    assert row_id("p", 7, "x") != row_id("p", 8, "x")
    expected_seed = int.from_bytes(hashlib.sha256(b'[1,5,"select"]').digest()[:8], "big") >> 1
    assert derive_seed(1, 5, "select") == expected_seed
    assert derive_seed(1, 5, "select") != derive_seed(1, 6, "select")
    assert 0 <= derive_seed(1, 5, "select") < 2**63


# ----- store basics ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_open_requires_a_store_unless_create(backend: str, tmp_path: Any) -> None:
    root = new_root(backend, str(tmp_path))
    with pytest.raises(StoreNotFound, match=r"no store at .*create one with `rlvr run --store "):
        Store.open(root)
    created = Store.open(root, create=True)
    assert created.fs.cat_file(created.path("STORE")) == b'{"format":1}'
    assert Store.open(root).root == root
    assert created.is_local == (backend == "local")
    assert (created.local_root is not None) == (backend == "local")
    drop_root(root)


def test_write_read_round_trip_and_manifest(store: Store) -> None:
    table = make_table("problems", 3, split=["train", "test", "train"], seed=[11, 12, 13])
    manifest = write(store, "problems", table, step=4, extra={"note": "x"})
    assert store.exists(manifest.artifact_id)
    assert store.read_table(manifest.artifact_id).to_pylist() == table.to_pylist()
    assert store.read_table(manifest.artifact_id, columns=["seed"]).column("seed").to_pylist() == [11, 12, 13]
    assert (manifest.kind, manifest.rows, manifest.step, manifest.stage) == ("problems", 3, 4, "problems")
    assert manifest.schema == str(SCHEMAS["problems"])
    assert manifest.extra == {"note": "x"}
    part = store.fs.cat_file(store.path("artifacts", "problems", manifest.artifact_id, "part-00000.parquet"))
    assert manifest.files == [
        {"path": "part-00000.parquet", "rows": 3, "bytes": len(part), "sha256": hashlib.sha256(part).hexdigest()}
    ]
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert Store(store.root).manifest(manifest.artifact_id) == manifest  # read back from disk, not the cache
    with pytest.raises(ArtifactNotFound, match=r"^no artifact problems-missing in store "):
        store.manifest("problems-missing")


def test_binary_files_are_listed_with_checksums(store: Store) -> None:
    weights = b"\x00\x01weights" * 10
    manifest = write(store, "checkpoints", make_table("checkpoints", 1), files={"model.safetensors": weights})
    assert manifest.files[1] == {
        "path": "files/model.safetensors",
        "rows": None,
        "bytes": 90,
        "sha256": hashlib.sha256(weights).hexdigest(),
    }
    assert store.read_file(manifest.artifact_id, "model.safetensors") == weights
    local = store.local_file_path(manifest.artifact_id, "model.safetensors")
    if store.is_local:
        with open(local, "rb") as handle:
            assert handle.read() == weights
    else:
        assert local is None
    with pytest.raises(ArtifactNotFound, match="has no file 'other.bin'"):
        store.read_file(manifest.artifact_id, "other.bin")
    assert scalar(store, "SELECT count(*) FROM checkpoints") == 1


def test_schema_check_names_missing_and_extra_columns(store: Store) -> None:
    table = make_table("problems", 2).drop_columns(["answer"])
    with pytest.raises(ValueError, match=r"missing columns \['answer'\], extra columns \[\]"):
        write(store, "problems", table)
    extra = make_table("problems", 2).append_column("bogus", pa.array([1, 2]))
    with pytest.raises(ValueError, match=r"missing columns \[\], extra columns \['bogus'\]"):
        write(store, "problems", extra)
    assert store.manifests() == []


def test_schema_check_casts_and_reorders_columns(store: Store) -> None:
    table = make_table("quarantine", 2)
    shuffled = pa.table(
        {
            "reason": table["reason"],
            "source_index": pa.array([5, 6], pa.int32()),
            "run_id": table["run_id"],
            "stage": table["stage"],
            "failed_check": table["failed_check"],
            "source": table["source"],
            "row_json": pa.array([None, None], pa.null()),
        }
    )
    manifest = write(store, "quarantine", shuffled)
    read = store.read_table(manifest.artifact_id)
    assert read.schema == SCHEMAS["quarantine"]
    assert read.column("source_index").to_pylist() == [5, 6]


def test_rewrite_is_idempotent(store: Store) -> None:
    first = write(store, "problems", make_table("problems", 2), config={"c": 1})
    second = write(store, "problems", make_table("problems", 5), config={"c": 1})
    assert second == first
    assert store.read_table(first.artifact_id).num_rows == 2
    assert [m.artifact_id for m in store.manifests()] == [first.artifact_id]


# ----- commit protocol and cleanup -------------------------------------------------------------------


def _parquet(table: pa.Table) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def _sharded_writer(store: Store, kind: str = "rollouts", config: dict | None = None) -> Any:
    config = config or {"shards": 3}
    aid = artifact_id(kind, "rollout", "v1", config, [], "run-1")
    return store.writer(
        kind, aid, run_id="run-1", stage="rollout", parents=[], code_version="v1", config=config, step=0
    )


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_uncommitted_files_are_invisible_and_cleanup_keeps_committed_shards(store: Store) -> None:
    orphan_dir = store.path("artifacts", "problems", "problems-orphan")  # names no run: not the run's to remove
    put(store, f"{orphan_dir}/part-00000.parquet", _parquet(make_table("problems", 4)))
    other = store.writer(
        "rollouts", "rollouts-other", run_id="run-2", stage="rollout", parents=[], code_version="v1", config={}, step=0
    )  # another run's work in flight
    other.write_shard(0, make_table("rollouts", 1))
    writer = _sharded_writer(store)
    writer.write_shard(0, make_table("rollouts", 2))
    writer.write_shard(1, make_table("rollouts", 3))
    shard2 = f"{writer.directory}/part-00002.parquet"
    put(store, shard2, _parquet(make_table("rollouts", 7)))  # crashed before its marker
    host = host_tag()
    dead_temp = store.path("manifests", f"problems-x.json.tmp-{host}-{dead_pid()}-abcd1234")
    live_temp = store.path("manifests", f"problems-y.json.tmp-{host}-{os.getpid()}-abcd1234")  # being written
    old_style = store.path("manifests", "problems-z.json.tmp-123-abcd")  # no host tag: removed only when old
    for temp in (dead_temp, live_temp, old_style):
        put(store, temp, b"{")

    assert writer.committed_shards() == {0, 1}
    assert not store.exists("problems-orphan") and not store.exists(writer.artifact_id)
    assert store.manifests() == []
    assert scalar(store, "SELECT count(*) FROM problems") == 0
    assert scalar(store, "SELECT count(*) FROM rollouts") == 0
    assert scalar(store, "SELECT count(*) FROM artifacts") == 0

    removed = store.cleanup_run("run-1")
    expected = ["part-00002.parquet"] + ([os.path.basename(dead_temp)] if store.is_local else [])
    assert sorted(os.path.basename(p.rstrip("/")) for p in removed) == sorted(expected)
    assert not store.fs.exists(shard2)
    assert store.fs.exists(f"{orphan_dir}/part-00000.parquet")  # not run-1's
    assert other.committed_shards() == {0}  # run-2's work in flight is untouched
    if store.is_local:
        assert not store.fs.exists(dead_temp) and store.fs.exists(live_temp) and store.fs.exists(old_style)
    for index in (0, 1):
        assert store.fs.exists(f"{writer.directory}/part-0000{index}.parquet")
        assert store.fs.exists(f"{writer.directory}/_shards/part-0000{index}.json")

    resumed = _sharded_writer(store)  # a new process resuming the stage
    assert resumed.committed_shards() == {0, 1}
    resumed.write_shard(2, make_table("rollouts", 4))
    manifest = resumed.commit(expected_shards=3)
    assert manifest.rows == 9
    assert [entry["path"] for entry in manifest.files] == [f"part-0000{i}.parquet" for i in range(3)]
    assert [entry["rows"] for entry in manifest.files] == [2, 3, 4]
    assert scalar(store, "SELECT count(*) FROM rollouts") == 9
    assert store.cleanup_run("run-1") == []


def test_temp_files_of_gone_writers_are_told_from_live_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    host, now = host_tag(), time.time()
    assert temp_writer_gone(f"x.json.tmp-{host}-{dead_pid()}-abcd1234", now)
    assert not temp_writer_gone(f"x.json.tmp-{host}-{os.getpid()}-abcd1234", now)
    assert not temp_writer_gone("x.json.tmp-123-abcd", now)  # another host, or an old name: by age only
    monkeypatch.setenv("RLVR_HEARTBEAT_TIMEOUT_S", "60")
    assert temp_writer_gone("x.json.tmp-123-abcd", now - 61)
    assert temp_writer_gone(f"x.json.tmp-0000beef-{os.getpid()}-abcd1234", now - 61)
    assert not temp_writer_gone("part-00000.parquet", now - 10_000)  # not a temp file


def test_a_commit_missing_an_expected_shard_fails_loudly(store: Store) -> None:
    writer = _sharded_writer(store)
    for index in range(3):
        writer.write_shard(index, make_table("rollouts", 2))
    store.fs.rm(f"{writer.directory}/part-00001.parquet")  # removed behind the writer's back
    with pytest.raises(DamagedArtifact, match=r"shards \[1\] of rollouts .* are missing or damaged"):
        writer.commit(expected_shards=3)
    assert not store.exists(writer.artifact_id)


def test_shard_with_wrong_checksum_is_not_committed(store: Store) -> None:
    writer = _sharded_writer(store)
    writer.write_shard(0, make_table("rollouts", 2))
    writer.write_shard(1, make_table("rollouts", 2))
    writer.write_shard(2, make_table("rollouts", 2))
    put(store, f"{writer.directory}/part-00001.parquet", _parquet(make_table("rollouts", 5)))  # other size
    shard2 = bytearray(store.fs.cat_file(f"{writer.directory}/part-00002.parquet"))
    shard2[len(shard2) // 2] ^= 0xFF  # same size, one flipped byte
    put(store, f"{writer.directory}/part-00002.parquet", bytes(shard2))
    assert writer.committed_shards() == {0}
    assert writer.commit().rows == 2


def test_sharded_artifact_view_rows_and_order(store: Store) -> None:
    writer = _sharded_writer(store)
    writer.write_shard(2, make_table("rollouts", 1, rollout_id=["c0"]))
    writer.write_shard(0, make_table("rollouts", 2, rollout_id=["a0", "a1"]))
    writer.write_shard(1, make_table("rollouts", 3, rollout_id=["b0", "b1", "b2"]))
    writer.add_file("notes.txt", b"hello")
    manifest = writer.commit()
    assert manifest.rows == 6
    assert [e["path"] for e in manifest.files] == [
        "part-00000.parquet",
        "part-00001.parquet",
        "part-00002.parquet",
        "files/notes.txt",
    ]
    read = store.read_table(manifest.artifact_id)
    assert read.column("rollout_id").to_pylist() == ["a0", "a1", "b0", "b1", "b2", "c0"]
    assert scalar(store, "SELECT count(*) FROM rollouts") == 6
    assert scalar(store, "SELECT string_agg(rollout_id, ',' ORDER BY rollout_id) FROM rollouts") == "a0,a1,b0,b1,b2,c0"
    assert store.read_file(manifest.artifact_id, "notes.txt") == b"hello"
    # committed artifacts are immutable: later writes change nothing
    writer.write_shard(3, make_table("rollouts", 10))
    assert writer.commit() == manifest
    assert scalar(store, "SELECT count(*) FROM rollouts") == 6


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shard_rows=st.lists(st.integers(min_value=0, max_value=6), min_size=1, max_size=5),
    backend=st.sampled_from(["local", "memory"]),
)
def test_rows_written_in_shards_equal_rows_in_view(shard_rows: list[int], backend: str) -> None:
    with tempfile.TemporaryDirectory() as base:
        store = Store.open(new_root(backend, base), create=True)
        writer = _sharded_writer(store, config={"rows": shard_rows})
        for index, n in enumerate(shard_rows):
            writer.write_shard(index, make_table("rollouts", n))
        manifest = writer.commit()
        assert manifest.rows == sum(shard_rows)
        assert store.read_table(manifest.artifact_id).num_rows == sum(shard_rows)
        assert scalar(store, "SELECT count(*) FROM rollouts") == sum(shard_rows)
        drop_root(store.root)


def test_delete_artifact_makes_it_invisible(store: Store) -> None:
    keep = write(store, "problems", make_table("problems", 2), config={"a": 1})
    gone = write(store, "problems", make_table("problems", 3), config={"a": 2})
    assert scalar(store, "SELECT count(*) FROM problems") == 5
    store.delete_artifact(gone.artifact_id)
    assert not store.exists(gone.artifact_id)
    assert [m.artifact_id for m in store.manifests()] == [keep.artifact_id]
    assert scalar(store, "SELECT count(*) FROM problems") == 2
    assert not store.fs.exists(store.artifact_dir("problems", gone.artifact_id))
    with pytest.raises(ArtifactNotFound):
        store.manifest(gone.artifact_id)
    with pytest.raises(ArtifactNotFound):
        store.delete_artifact(gone.artifact_id)


# ----- views -----------------------------------------------------------------------------------------


def _populate(store: Store) -> dict[str, Manifest]:
    """10 problems (6 train, 4 test); 2 rollouts each over 2 steps; reward 1.0 for sample 0, else 0.0."""
    problem_ids = [f"p{i}" for i in range(10)]
    splits = ["train"] * 6 + ["test"] * 4
    problems = write(store, "problems", make_table("problems", 10, problem_id=problem_ids, split=splits))
    out = {"problems": problems}
    for step in (0, 1):
        rollout_ids = [f"r{step}-{p}-{s}" for p in problem_ids for s in range(2)]
        pids = [p for p in problem_ids for _ in range(2)]
        samples = [s for _ in problem_ids for s in range(2)]
        n_tokens = [10 + s for _ in problem_ids for s in range(2)]
        rollouts = write(
            store,
            "rollouts",
            make_table(
                "rollouts",
                20,
                rollout_id=rollout_ids,
                step=[step] * 20,
                problem_id=pids,
                sample_index=samples,
                n_tokens=n_tokens,
            ),
            parents=[problems.artifact_id],
            config={"step": step},
            step=step,
        )
        rewards = write(
            store,
            "rewards",
            make_table(
                "rewards",
                20,
                rollout_id=rollout_ids,
                step=[step] * 20,
                problem_id=pids,
                score=[1.0 if s == 0 else 0.0 for s in samples],
            ),
            parents=[rollouts.artifact_id],
            config={"step": step},
            step=step,
        )
        out[f"rollouts{step}"] = rollouts
        out[f"rewards{step}"] = rewards
    return out


def test_views_count_and_join_across_kinds(store: Store) -> None:
    _populate(store)
    assert scalar(store, "SELECT count(*) FROM problems") == 10
    assert scalar(store, "SELECT count(*) FROM rollouts") == 40
    assert scalar(store, "SELECT count(*) FROM rewards") == 40
    assert scalar(store, "SELECT sum(n_tokens) FROM rollouts") == 40 * 10 + 20
    joined = query(
        store,
        """
        SELECT p.split, count(*) AS n, sum(w.score) AS correct, sum(r.n_tokens) AS tokens
        FROM rewards w
        JOIN rollouts r ON r.rollout_id = w.rollout_id
        JOIN problems p ON p.problem_id = r.problem_id
        GROUP BY p.split ORDER BY p.split
        """,
    )
    assert joined.to_pylist() == [
        {"split": "test", "n": 16, "correct": 8.0, "tokens": 16 * 10 + 8},
        {"split": "train", "n": 24, "correct": 12.0, "tokens": 24 * 10 + 12},
    ]
    per_step = query(store, "SELECT step, avg(score) AS mean FROM rewards GROUP BY step ORDER BY step")
    assert per_step.to_pylist() == [{"step": 0, "mean": 0.5}, {"step": 1, "mean": 0.5}]


def test_empty_store_has_every_declared_view_with_its_columns(store: Store) -> None:
    con = connect(store)
    try:
        for kind, schema in SCHEMAS.items():
            assert [row[0] for row in con.execute(f"DESCRIBE {kind}").fetchall()] == schema.names
            assert con.execute(f"SELECT count(*) FROM {kind}").fetchone()[0] == 0
        assert con.execute("SELECT count(*) FROM artifacts").fetchone()[0] == 0
    finally:
        con.close()


def test_undeclared_kind_gets_a_view(store: Store) -> None:
    config = {"x": 1}
    aid = artifact_id("notes", "annotate", "v1", config, [], "run-1")
    store.write_artifact(
        "notes",
        aid,
        pa.table({"text": ["a", "b", "c"]}),
        run_id="run-1",
        stage="annotate",
        parents=[],
        code_version="v1",
        config=config,
    )
    assert scalar(store, "SELECT string_agg(text, '' ORDER BY text) FROM notes") == "abc"
    with pytest.raises(ValueError, match="bad artifact kind 'runs'"):
        store.write_artifact(
            "runs", "runs-x", pa.table({"a": [1]}), run_id="r", stage="s", parents=[], code_version="v1", config={}
        )


def test_artifacts_and_lineage_views(store: Store) -> None:
    made = _populate(store)
    con = connect(store)
    try:
        columns = [row[0] for row in con.execute("DESCRIBE artifacts").fetchall()]
        assert columns[:10] == [
            "artifact_id",
            "kind",
            "run_id",
            "stage",
            "step",
            "rows",
            "created_at",
            "code_version",
            "parents_count",
            "seconds",
        ]
        rewards1 = made["rewards1"]
        row = con.execute(
            "SELECT kind, run_id, stage, step, rows, created_at, code_version, parents_count, config "
            "FROM artifacts WHERE artifact_id = ?",
            [rewards1.artifact_id],
        ).fetchone()
        assert row == ("rewards", "run-1", "rewards", 1, 20, rewards1.created_at, "v1", 1, '{"step": 1}')
        kinds = con.execute("SELECT kind, count(*), sum(rows) FROM artifacts GROUP BY kind ORDER BY kind").fetchall()
        assert kinds == [("problems", 1, 10), ("rewards", 2, 40), ("rollouts", 2, 40)]
        edges = set(con.execute("SELECT child_id, parent_id FROM lineage").fetchall())
        assert [row[0] for row in con.execute("DESCRIBE lineage").fetchall()] == ["child_id", "parent_id"]
    finally:
        con.close()
    problems = made["problems"].artifact_id
    assert edges == {
        (made["rollouts0"].artifact_id, problems),
        (made["rollouts1"].artifact_id, problems),
        (made["rewards0"].artifact_id, made["rollouts0"].artifact_id),
        (made["rewards1"].artifact_id, made["rollouts1"].artifact_id),
    }


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_runs_records_and_derived_status(store: Store) -> None:
    host = socket.gethostname()
    dead = store.write_run({"run_id": "run-dead", "status": "running", "pid": _dead_pid(), "host": host})
    alive = store.write_run({"run_id": "run-alive", "status": "running", "pid": os.getpid(), "host": host})
    store.write_run({"run_id": "run-far", "status": "running", "pid": _dead_pid(), "host": "another-host"})
    store.write_run({"run_id": "run-done", "status": "completed"})
    assert store.read_run("run-dead") == dead
    assert store.read_run("run-nope") is None
    assert alive["updated_at"] >= alive["created_at"]
    assert run_status(dead) == "failed"
    assert run_status(alive) == "running"
    assert run_status(store.read_run("run-far")) == "running"
    assert run_status(store.read_run("run-done")) == "completed"
    assert [r["run_id"] for r in store.list_runs()] == ["run-dead", "run-alive", "run-far", "run-done"]
    rows = query(store, "SELECT run_id, status, recorded_status, pid, host FROM runs ORDER BY run_id").to_pylist()
    assert rows == [
        {"run_id": "run-alive", "status": "running", "recorded_status": "running", "pid": os.getpid(), "host": host},
        {"run_id": "run-dead", "status": "failed", "recorded_status": "running", "pid": dead["pid"], "host": host},
        {"run_id": "run-done", "status": "completed", "recorded_status": "completed", "pid": os.getpid(), "host": host},
        {
            "run_id": "run-far",
            "status": "running",
            "recorded_status": "running",
            "pid": rows[3]["pid"],
            "host": "another-host",
        },
    ]
    updated = store.write_run({**store.read_run("run-dead"), "status": "completed"})
    assert store.read_run("run-dead") == updated
    assert updated["created_at"] == dead["created_at"]
    with pytest.raises(ValueError, match="run status must be one of"):
        store.write_run({"run_id": "run-x", "status": "done"})


# ----- lineage ---------------------------------------------------------------------------------------


def test_ancestors_and_descendants_on_a_dag(store: Store) -> None:
    p = write(store, "problems", make_table("problems", 2))
    d = write(store, "difficulty", make_table("difficulty", 2), parents=[p.artifact_id])
    s = write(store, "selections", make_table("selections", 2), parents=[p.artifact_id, d.artifact_id])
    r = write(store, "rollouts", make_table("rollouts", 2), parents=[s.artifact_id])
    w = write(store, "rewards", make_table("rewards", 2), parents=[r.artifact_id])
    other = write(store, "problems", make_table("problems", 1), config={"other": True})
    ids = lambda manifests: [m.artifact_id for m in manifests]  # noqa: E731
    assert ids(ancestors(store, w.artifact_id)) == [r.artifact_id, s.artifact_id, p.artifact_id, d.artifact_id]
    assert ids(ancestors(store, p.artifact_id)) == []
    assert ids(descendants(store, p.artifact_id)) == [d.artifact_id, s.artifact_id, r.artifact_id, w.artifact_id]
    assert ids(descendants(store, d.artifact_id)) == [s.artifact_id, r.artifact_id, w.artifact_id]
    assert ids(descendants(store, w.artifact_id)) == []
    assert ids(descendants(store, other.artifact_id)) == []
    with pytest.raises(ArtifactNotFound):
        ancestors(store, "rewards-unknown")


def test_resolve_id_of_artifacts_and_rows(store: Store) -> None:
    made = _populate(store)
    assert resolve_id(store, made["problems"].artifact_id) == made["problems"].artifact_id
    assert resolve_id(store, "p7") == made["problems"].artifact_id
    assert resolve_id(store, "r1-p3-1") == made["rollouts1"].artifact_id
    assert resolve_id(store, "r0-p0-0") == made["rollouts0"].artifact_id
    with pytest.raises(ArtifactNotFound) as caught:
        resolve_id(store, "zzz")
    assert str(caught.value) == f"no artifact or row with id zzz in store {store.root}"


def test_a_view_leaves_out_an_artifact_deleted_after_the_listing(tmp_path, monkeypatch):
    """Querying a live run: the newest transient artifact can replace the one the listing saw."""
    store = Store.open(str(tmp_path / "s"), create=True)
    kept = write(store, "test_rows", pa.table({"x": [1, 2]}), config={"v": 1})
    gone = write(store, "test_rows", pa.table({"x": [7]}), config={"v": 2})
    listed = store.manifests()
    store.delete_artifact(gone.artifact_id)
    monkeypatch.setattr(store, "manifests", lambda *a, **k: listed)
    assert query(store, "SELECT sum(x) AS s FROM test_rows").column("s").to_pylist() == [3]
    assert store.exists(kept.artifact_id)
