"""Queries at store scale (issue 37): the catalog index (storage/catalog.py) that `connect` reads instead of
every manifest, kept right against the manifests (a lost log entry, a delete, a set-aside and rewritten
artifact, a damaged manifest or snapshot, two writers at once), on disk and on fsspec's memory filesystem;
`connect` builds only the catalog tables a statement names; `rlvr query` streams its result in chunks.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from rlvr.flows.cli import commands
from rlvr.storage import catalog
from rlvr.storage.manifest import Manifest
from rlvr.storage.schemas import SCHEMAS
from rlvr.storage.store import Store
from rlvr.storage.views import connect, query
from tests.cli_helpers import cli_env, rlvr_command


def table_of(kind: str, rows: list[dict[str, Any]]) -> pa.Table:
    schema = SCHEMAS[kind]
    return pa.Table.from_pylist([{name: row.get(name) for name in schema.names} for row in rows], schema=schema)


def commit(store: Store, artifact_id: str, run_id: str = "run-a", step: int = 0, parents: tuple[str, ...] = ()) -> None:
    rows = [{"run_id": run_id, "step": step, "loss": 0.5, "mean_reward": float(step)}]
    store.write_artifact(
        "train_steps",
        artifact_id,
        table_of("train_steps", rows),
        run_id=run_id,
        stage="train",
        parents=list(parents),
        code_version="v1",
        config={"step": step},
        step=step,
        extra={"stage_run": {"outputs": {"train_steps": artifact_id}, "started_at": f"t{step}"}},
    )


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "store")
        return
    url = f"memory://rlvr-catalog-{uuid.uuid4().hex[:8]}"
    yield url
    Store(url).fs.rm(Store(url).path(), recursive=True)


def fresh(root: str) -> Store:
    """A handle with nothing cached, as a new process has."""
    return Store.open(root)


def ids(store: Store) -> list[str]:
    return catalog.committed(store).column("artifact_id").to_pylist()


def log_entries(store: Store) -> list[dict[str, Any]]:
    directory = store.path("catalog", "log")
    names = sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(directory, detail=False))
    assert names == [f"{i:010d}.json" for i in range(len(names))], "numbered without gaps"
    return [json.loads(store.fs.cat_file(f"{directory}/{name}")) for name in names]


@pytest.fixture
def snapshot_often(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(catalog, "SNAPSHOT_AFTER", 3)


def record_reads(monkeypatch: pytest.MonkeyPatch, store: Store) -> list[str]:
    """The catalog's reads from now on, as 'folder/name' (on object storage log entries are asked for several at
    once, the first free numbers too)."""
    read: list[str] = []
    real_read, real_cat = catalog.read_whole, type(store.fs).cat

    def read_whole(fs: Any, path: str) -> bytes:
        read.append(path)
        return real_read(fs, path)

    def cat(fs: Any, paths: Any, *args: Any, **kwargs: Any) -> Any:
        read.extend([paths] if isinstance(paths, str) else paths)
        return real_cat(fs, paths, *args, **kwargs)

    monkeypatch.setattr(catalog, "read_whole", read_whole)
    monkeypatch.setattr(type(store.fs), "cat", cat)
    return read


def names(paths: list[str]) -> list[str]:
    return ["/".join(path.rsplit("/", 2)[-2:]) for path in paths]


def test_the_catalog_says_what_the_manifests_say(root: str) -> None:
    store = Store.open(root, create=True)
    commit(store, "ts-1", step=1)
    with store.batch():
        commit(store, "ts-2", step=2, parents=("ts-1",))
        commit(store, "ts-3", step=3, parents=("ts-1", "ts-2"))
    commit(store, "ts-4", run_id="run-b", step=1)
    entries = log_entries(store)
    assert [len(e["added"]) for e in entries] == [1, 2, 1]  # one entry per commit: the batch is one
    reader = fresh(root)
    rows = catalog.committed(reader)
    assert catalog.manifests_of(rows) == fresh(root).manifests()
    assert rows.column("manifest_bytes").to_pylist() == [
        len(store.fs.cat_file(store.manifest_path(aid))) for aid in ("ts-1", "ts-2", "ts-3", "ts-4")
    ]
    lineage = query(reader, "SELECT child_id, parent_id FROM lineage ORDER BY child_id, parent_id").to_pylist()
    assert [(r["child_id"], r["parent_id"]) for r in lineage] == [("ts-2", "ts-1"), ("ts-3", "ts-1"), ("ts-3", "ts-2")]


def test_a_reader_writes_a_snapshot_and_the_next_reads_no_manifest(
    root: str, snapshot_often: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store.open(root, create=True)
    for step in range(4):
        commit(store, f"ts-{step}", step=step)
    assert len(ids(fresh(root))) == 4  # read 4 entries: writes the snapshot of entries 0..3
    assert store.fs.ls(store.path("catalog", "snapshots"), detail=False)[-1].endswith("0000000004.parquet")
    commit(store, "ts-4", step=4)
    reader = fresh(root)
    read = record_reads(monkeypatch, reader)
    monkeypatch.setattr(Store, "_fetch_manifest", lambda self, aid: pytest.fail(f"read the manifest of {aid}"))
    assert ids(reader) == [f"ts-{step}" for step in range(5)]
    # the snapshot, the one entry after it, and the first free number (on S3 a few more, asked for at once)
    assert names(read)[:3] == ["snapshots/0000000004.parquet", "log/0000000004.json", "log/0000000005.json"]
    assert all(name.startswith("log/") for name in names(read)[1:])


def test_a_store_written_for_long_and_never_queried_has_snapshots(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer of every COMPACT_EVERY-th entry reads the catalog, so writing the snapshot that is due."""
    monkeypatch.setattr(catalog, "COMPACT_EVERY", 4)
    monkeypatch.setattr(catalog, "SNAPSHOT_AFTER", 3)
    store = Store.open(root, create=True)
    for step in range(9):
        commit(store, f"ts-{step}", step=step)
    snapshots = sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(store.path("catalog", "snapshots"), detail=False))
    assert snapshots == ["0000000004.parquet", "0000000008.parquet"]
    reader = fresh(root)
    read = record_reads(monkeypatch, reader)
    assert ids(reader) == [f"ts-{step}" for step in range(9)]
    assert names(read)[:2] == ["snapshots/0000000008.parquet", "log/0000000008.json"]


def test_a_commit_whose_log_entry_was_lost_is_still_found(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer killed between its manifest and its log entry: the listing finds the manifest, read directly."""
    store = Store.open(root, create=True)
    commit(store, "ts-1", step=1)
    with monkeypatch.context() as killed:
        killed.setattr(catalog, "append", lambda *args, **kwargs: None)
        commit(store, "ts-2", step=2)
    commit(store, "ts-3", step=3)
    assert sum(len(e["added"]) for e in log_entries(store)) == 2
    assert ids(fresh(root)) == ["ts-1", "ts-2", "ts-3"]
    assert query(fresh(root), "SELECT count(*) AS n FROM train_steps").to_pylist() == [{"n": 3}]


def test_deleted_artifacts_disappear(root: str, snapshot_often: None) -> None:
    """Whether the delete was logged or not (a manifest removed by an older version, or by hand): the snapshot
    and the log still hold them, the listing does not."""
    store = Store.open(root, create=True)
    for step in range(4):
        commit(store, f"ts-{step}", step=step)
    assert len(ids(fresh(root))) == 4  # snapshot written
    store.delete_artifact("ts-1")
    assert log_entries(store)[-1] == {"added": [], "removed": ["ts-1"]}
    store.fs.rm(store.manifest_path("ts-2"))  # no log entry
    reader = fresh(root)
    assert ids(reader) == ["ts-0", "ts-3"]
    assert query(reader, "SELECT step FROM train_steps ORDER BY step").column("step").to_pylist() == [0, 3]


def test_a_set_aside_artifact_made_again_shows_its_new_manifest(
    root: str, snapshot_often: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Set aside (damaged), then made again under the same id with other contents, by a writer killed before its
    log entry: the logged removal keeps a reader from the old row."""
    store = Store.open(root, create=True)
    for step in range(4):
        commit(store, f"ts-{step}", step=step)
    assert len(ids(fresh(root))) == 4
    store.set_aside("ts-3")
    assert ids(fresh(root)) == ["ts-0", "ts-1", "ts-2"]
    with monkeypatch.context() as killed:
        killed.setattr(catalog, "append", lambda *args, **kwargs: None)
        commit(store, "ts-3", step=7)  # the same id, another step: another manifest
    [row] = [r for r in catalog.committed(fresh(root)).to_pylist() if r["artifact_id"] == "ts-3"]
    assert row["step"] == 7
    assert query(fresh(root), "SELECT max(step) AS s FROM train_steps").to_pylist() == [{"s": 7}]


def test_a_manifest_damaged_in_place_is_skipped_and_named(root: str, snapshot_often: None) -> None:
    store = Store.open(root, create=True)
    for step in range(4):
        commit(store, f"ts-{step}", step=step)
    assert len(ids(fresh(root))) == 4
    store.fs.pipe_file(store.manifest_path("ts-2"), b"\x00\xff half a manifest")
    reader = fresh(root)
    assert ids(reader) == ["ts-0", "ts-1", "ts-3"]
    [(path, why)] = reader.unreadable.items()
    assert path == store.manifest_path("ts-2") and "is unreadable" in why


def test_torn_snapshots_and_log_entries_cost_time_not_rows(root: str, snapshot_often: None) -> None:
    store = Store.open(root, create=True)
    for step in range(4):
        commit(store, f"ts-{step}", step=step)
    assert len(ids(fresh(root))) == 4
    commit(store, "ts-4", step=4)
    store.fs.pipe_file(store.path("catalog", "snapshots", "0000000004.parquet"), b"PAR1 torn")
    store.fs.pipe_file(store.path("catalog", "log", "0000000001.json"), b'{"added": ["{tor')
    assert ids(fresh(root)) == [f"ts-{step}" for step in range(5)]


def test_two_writers_append_every_commit_once_without_gaps(root: str) -> None:
    """Two handles on one store (two processes, each with its own idea of where the log ends)."""
    first = Store.open(root, create=True)
    second = Store.open(root)
    for step in range(3):
        commit(first, f"a-{step}", step=step)
        commit(second, f"b-{step}", run_id="run-b", step=step)
    with first.batch():
        commit(first, "a-3", step=3)
        commit(first, "a-4", step=4)
    second.delete_artifact("b-0")
    logged = [json.loads(text)["artifact_id"] for e in log_entries(first) for text in e["added"]]
    assert sorted(logged) == sorted([*(f"a-{s}" for s in range(5)), *(f"b-{s}" for s in range(3))])
    assert sorted(ids(fresh(root))) == sorted([*(f"a-{s}" for s in range(5)), "b-1", "b-2"])


def test_a_process_reads_only_what_was_logged_since_its_last_read(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store.open(root, create=True)
    reader = fresh(root)
    for step in range(3):
        commit(store, f"ts-{step}", step=step)
    assert len(ids(reader)) == 3
    commit(store, "ts-3", step=3)
    read = record_reads(monkeypatch, reader)
    assert len(ids(reader)) == 4
    assert names(read)[:2] == ["log/0000000003.json", "log/0000000004.json"]
    assert all(name.startswith("log/") for name in names(read))


def test_only_the_catalog_tables_a_statement_names_are_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store.open(str(tmp_path / "store"), create=True)
    commit(store, "ts-1", step=1)
    store.write_run({"run_id": "run-a", "status": "completed"})
    monkeypatch.setattr(Store, "list_runs", lambda self: pytest.fail("read the run records"))
    con = connect(store, "SELECT step FROM train_steps")
    try:
        tables = {name for (name,) in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
        views = {name for (name,) in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
        assert tables == set() and views == {"train_steps"}
        assert con.execute("SELECT step FROM train_steps").fetchall() == [(1,)]
    finally:
        con.close()
    part = f"{store.root}/artifacts/*/*/*.parquet"
    for sql, count in (("SELECT count(*) FROM range(3)", 3), (f"SELECT count(*) FROM read_parquet('{part}')", 1)):
        con = connect(store, sql)  # a file reader or `range` reads no view
        try:
            assert con.execute("SELECT count(*) FROM duckdb_views() WHERE NOT internal").fetchall() == [(0,)]
            assert con.execute(sql).fetchall() == [(count,)]
        finally:
            con.close()
    monkeypatch.undo()
    everything = connect(store)  # no statement (rlvr lineage, the report): every view and table
    try:
        tables = {name for (name,) in everything.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
        assert tables == {"artifacts", "lineage", "stage_runs", "runs"}
        assert everything.execute("SELECT run_id, status FROM runs").fetchall() == [("run-a", "completed")]
        assert everything.execute("SELECT stage, outputs FROM stage_runs").fetchall() == [("train", ["ts-1"])]
    finally:
        everything.close()


def test_the_catalog_on_s3(monkeypatch: pytest.MonkeyPatch, snapshot_often: None) -> None:
    """The log's conditional PUTs and a snapshot on a real S3 API (moto's server on localhost)."""
    moto_server = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION"):
            monkeypatch.delenv(name, raising=False)
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir("rlvr-catalog")
        root = "s3://rlvr-catalog/store"
        first, second = Store.open(root, create=True), Store.open(root)
        for step in range(3):
            commit(first, f"a-{step}", step=step)
            commit(second, f"b-{step}", run_id="run-b", step=step)
        assert len(ids(fresh(root))) == 6  # and a snapshot
        second.delete_artifact("b-1")
        commit(first, "a-3", step=3)
        assert len(log_entries(first)) == 8
        reader = fresh(root)
        assert sorted(ids(reader)) == ["a-0", "a-1", "a-2", "a-3", "b-0", "b-2"]
        steps = query(reader, "SELECT run_id, count(*) AS n FROM train_steps GROUP BY run_id ORDER BY run_id")
        assert steps.to_pylist() == [{"run_id": "run-a", "n": 4}, {"run_id": "run-b", "n": 2}]
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


# ----- rlvr query streams -----------------------------------------------------------------------------------


@pytest.mark.parametrize("format", ["csv", "json", "table"])
def test_the_printer_prints_each_chunk_before_it_asks_for_the_next(format: str) -> None:
    """Whatever the format, a chunk is on stdout before the next is fetched: memory holds one chunk."""
    printed = io.StringIO()
    pulled: list[int] = []

    def chunks() -> Iterator[list[tuple[Any, ...]]]:
        for index in range(3):
            if index:  # everything fetched so far is printed already
                assert printed.getvalue().count(f"row-{index - 1}-") == 2
            pulled.append(index)
            yield [(f"row-{index}-a", index), (f"row-{index}-b", None)]

    with redirect_stdout(printed):  # rich's console too prints to sys.stdout as it is at the time
        commands._print_chunks(chunks(), ["name", "n"], format)
    assert pulled == [0, 1, 2]
    assert printed.getvalue().count("row-2-") == 2


def test_small_results_print_as_they_always_did(capsys: pytest.CaptureFixture[str]) -> None:
    commands._print_chunks(iter([[(1, "x", None)], []]), ["a", "b", "c"], "csv")
    commands._print_chunks(iter([[(1, "x", None)]]), ["a", "b", "c"], "json")
    commands._print_chunks(iter([[]]), ["a"], "csv")
    assert capsys.readouterr().out == 'a,b,c\r\n1,x,\r\n{"a": 1, "b": "x", "c": null}\na\r\n'


def peak_rss_mb(args: list[str], cwd: Path, out: Path) -> tuple[float, int]:
    """The peak resident memory of `rlvr ARGS` (its stdout to `out`), and its exit status."""
    with out.open("w") as stdout:
        process = subprocess.Popen(rlvr_command(*args), stdout=stdout, stderr=subprocess.PIPE, cwd=cwd, env=cli_env())
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    assert process.stderr is not None
    assert process.returncode == 0, process.stderr.read()
    return usage.ru_maxrss / 1024, process.returncode


def test_a_million_rows_print_in_bounded_memory(tmp_path: Path) -> None:
    """1M rows of 200 characters (some 200 MB of text): held whole in Python they would take several times
    that; streamed, the command's peak memory stays near a one-row query's."""
    root = str(tmp_path / "store")
    Store.open(root, create=True)
    one, _ = peak_rss_mb(
        ["query", "SELECT 1 AS i, repeat('x', 200) AS s", "--store", root, "--format", "csv"],
        tmp_path,
        tmp_path / "one.csv",
    )
    sql = "SELECT i, repeat('x', 200) AS s FROM range(1000000) t(i)"
    many, _ = peak_rss_mb(["query", sql, "--store", root, "--format", "csv"], tmp_path, tmp_path / "many.csv")
    with (tmp_path / "many.csv").open() as printed:
        assert sum(1 for _ in printed) == 1_000_001
    assert many - one < 120, f"peak {many:.0f} MB for 1M rows against {one:.0f} MB for one"


def test_query_closes_its_connection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path / "store")
    store = Store.open(root, create=True)
    commit(store, "ts-1", step=1)
    closed: list[bool] = []
    real_connect = connect

    def tracked(*args: Any, **kwargs: Any) -> Any:
        con = real_connect(*args, **kwargs)
        real_close = con.close

        class Tracked:
            def __getattr__(self, name: str) -> Any:
                return getattr(con, name)

            def close(self) -> None:
                closed.append(True)
                real_close()

        return Tracked()

    monkeypatch.setattr("rlvr.storage.views.connect", tracked)
    printed = io.StringIO()
    with redirect_stdout(printed):
        commands.query("SELECT step FROM train_steps", store=root, format="csv")
    assert printed.getvalue() == "step\r\n1\r\n" and closed == [True]


def test_manifest_round_trip_keeps_fields_added_later(tmp_path: Path) -> None:
    """A manifest field without a column of its own (e.g. one a later version adds) comes back whole."""
    manifest = Manifest(
        artifact_id="x-1",
        kind="train_steps",
        run_id="r",
        stage="train",
        step=1,
        rows=1,
        schema="s",
        files=[{"path": "part-00000.parquet", "rows": 1, "bytes": 10, "sha256": "0" * 64}],
        parents=["p"],
        code_version="v",
        config={"a": [1, 2]},
        created_at="2026-01-01T00:00:00.000000+00:00",
        seconds=0.5,
        extra={"stage_run": {"outputs": {"o": "x-1"}}},
    )
    [back] = catalog.manifests_of(catalog.rows_table([catalog._row(manifest, 123)]))
    assert back == manifest
