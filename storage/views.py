"""DuckDB views over the committed artifacts of a store: every question about a run is one SQL query.

Views list the files named in manifests and nothing else (no globbing), so uncommitted or half-written
files can never show up in a query. DuckDB scans the Parquet files itself; nothing is loaded into Python.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import duckdb
import pyarrow as pa

from rlvr.storage.schemas import SCHEMAS
from rlvr.storage.store import Manifest, Store, run_status

_ARTIFACTS_SCHEMA = pa.schema(
    [
        ("artifact_id", pa.string()),
        ("kind", pa.string()),
        ("run_id", pa.string()),
        ("stage", pa.string()),
        ("step", pa.int64()),
        ("rows", pa.int64()),
        ("created_at", pa.string()),
        ("code_version", pa.string()),
        ("parents_count", pa.int64()),
        ("seconds", pa.float64()),
        ("bytes", pa.int64()),
        ("config", pa.string()),
        ("extra", pa.string()),
    ]
)
_LINEAGE_SCHEMA = pa.schema([("child_id", pa.string()), ("parent_id", pa.string())])
_RUNS_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("status", pa.string()),
        ("recorded_status", pa.string()),
        ("created_at", pa.string()),
        ("updated_at", pa.string()),
        ("pid", pa.int64()),
        ("host", pa.string()),
        ("record", pa.string()),
    ]
)


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _sql_identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def duckdb_connection(store: Store) -> duckdb.DuckDBPyConnection:
    """A fresh in-memory connection that can read the store's files.

    For a non-local store DuckDB reads through the store's own fsspec filesystem
    (`register_filesystem`, checked to work with fsspec's memory filesystem).
    """
    con = duckdb.connect(":memory:")
    if not store.is_local:
        con.register_filesystem(store.fs)
    return con


def data_paths(store: Store, manifest: Manifest) -> list[str]:
    """The Parquet parts of a committed artifact, as paths DuckDB can open on `duckdb_connection`."""
    directory = store.artifact_dir(manifest.kind, manifest.artifact_id)
    paths = [f"{directory}/{entry['path']}" for entry in manifest.table_files]
    if store.is_local:
        return paths
    return [store.fs.unstrip_protocol(path) for path in paths]


def parquet_scan(paths: Iterable[str], extra_options: str = "") -> str:
    """SQL for a scan of exactly these files, columns matched by name across files."""
    listed = ", ".join(_sql_string(path) for path in paths)
    return f"read_parquet([{listed}], union_by_name = true{extra_options})"


def _create_kind_view(con: duckdb.DuckDBPyConnection, kind: str, paths: list[str], store: Store) -> None:
    """A view over these files. During a live run a transient artifact (the newest train_state, a
    strategy's state) can be replaced between the manifest listing and this call: its files are gone
    and so is its manifest, so the view leaves them out."""
    try:
        con.execute(f"CREATE VIEW {_sql_identifier(kind)} AS SELECT * FROM {parquet_scan(paths)}")
    except duckdb.IOException:
        present = [path for path in paths if store.fs.exists(path)]
        if not present and kind in SCHEMAS:
            _create_empty_view(con, kind, SCHEMAS[kind])
        elif present:
            con.execute(f"CREATE VIEW {_sql_identifier(kind)} AS SELECT * FROM {parquet_scan(present)}")


def _create_empty_view(con: duckdb.DuckDBPyConnection, kind: str, schema: pa.Schema) -> None:
    """A kind no stage has written yet is an empty view with its declared columns, not a missing table."""
    types = con.from_arrow(schema.empty_table()).types
    columns = ", ".join(
        f"CAST(NULL AS {duck_type}) AS {_sql_identifier(name)}" for name, duck_type in zip(schema.names, types)
    )
    con.execute(f"CREATE VIEW {_sql_identifier(kind)} AS SELECT {columns} LIMIT 0")


def _create_table(con: duckdb.DuckDBPyConnection, name: str, table: pa.Table) -> None:
    con.from_arrow(table).create(name)


def _artifacts_table(manifests: list[Manifest]) -> pa.Table:
    rows = [
        {
            "artifact_id": m.artifact_id,
            "kind": m.kind,
            "run_id": m.run_id,
            "stage": m.stage,
            "step": m.step,
            "rows": m.rows,
            "created_at": m.created_at,
            "code_version": m.code_version,
            "parents_count": len(m.parents),
            "seconds": m.seconds,
            "bytes": sum(entry["bytes"] for entry in m.files),
            "config": json.dumps(m.config, sort_keys=True, default=str),
            "extra": json.dumps(m.extra, sort_keys=True, default=str),
        }
        for m in manifests
    ]
    return pa.Table.from_pylist(rows, schema=_ARTIFACTS_SCHEMA)


def _lineage_table(manifests: list[Manifest]) -> pa.Table:
    rows = [{"child_id": m.artifact_id, "parent_id": parent} for m in manifests for parent in m.parents]
    return pa.Table.from_pylist(rows, schema=_LINEAGE_SCHEMA)


_STAGE_RUNS_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("stage", pa.string()),
        ("step", pa.int64()),
        ("started_at", pa.string()),
        ("finished_at", pa.string()),
        ("read_seconds", pa.float64()),
        ("build_seconds", pa.float64()),
        ("commit_seconds", pa.float64()),
        ("outputs", pa.list_(pa.string())),
        ("rows", pa.int64()),
        ("bytes", pa.int64()),
    ]
)


def _stage_runs_table(manifests: list[Manifest]) -> pa.Table:
    """One row per stage run that committed something: the manifests of its outputs grouped together.

    read/build seconds come from the runner's record; commit seconds run from the end of the build to
    the last output's manifest (each manifest records the commit time of the outputs before it, which
    also counts an output deleted since, like a replaced train_state).
    """
    runs: dict[tuple[str, ...], list[Manifest]] = {}
    for m in manifests:
        record = m.extra.get("stage_run")
        if isinstance(record, dict):
            runs.setdefault(tuple(record["outputs"].values()), []).append(m)
    rows = []
    for outputs, members in runs.items():
        record = members[0].extra["stage_run"]
        rows.append(
            {
                "run_id": members[0].run_id,
                "stage": members[0].stage,
                "step": members[0].step,
                "started_at": record.get("started_at"),
                "finished_at": max(m.created_at for m in members),
                "read_seconds": record.get("read_seconds"),
                "build_seconds": record.get("build_seconds"),
                "commit_seconds": max(m.extra["stage_run"].get("commit_seconds", 0.0) + m.seconds for m in members),
                "outputs": list(outputs),
                "rows": sum(m.rows for m in members),
                "bytes": sum(e["bytes"] for m in members for e in m.files),
            }
        )
    rows.sort(key=lambda r: (r["started_at"] or "", r["stage"]))
    return pa.Table.from_pylist(rows, schema=_STAGE_RUNS_SCHEMA)


def _runs_table(records: list[dict]) -> pa.Table:
    rows = [
        {
            "run_id": record.get("run_id"),
            "status": run_status(record),
            "recorded_status": record.get("status"),
            "created_at": record.get("created_at"),
            "updated_at": record.get("updated_at"),
            "pid": record.get("pid"),
            "host": record.get("host"),
            "record": json.dumps(record, sort_keys=True, default=str),
        }
        for record in records
    ]
    return pa.Table.from_pylist(rows, schema=_RUNS_SCHEMA)


def connect(store: Store) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with one view per artifact kind plus `artifacts`, `lineage`, `stage_runs` and `runs`.

    It is a snapshot: artifacts committed after this call appear on the next `connect`.
    """
    con = duckdb_connection(store)
    manifests = store.manifests()
    paths_by_kind: dict[str, list[str]] = {}
    for manifest in manifests:
        paths_by_kind.setdefault(manifest.kind, []).extend(data_paths(store, manifest))
    for kind in sorted(set(SCHEMAS) | set(paths_by_kind)):
        paths = paths_by_kind.get(kind, [])
        if paths:
            _create_kind_view(con, kind, paths, store)
        elif kind in SCHEMAS:
            _create_empty_view(con, kind, SCHEMAS[kind])
    _create_table(con, "artifacts", _artifacts_table(manifests))
    _create_table(con, "lineage", _lineage_table(manifests))
    _create_table(con, "stage_runs", _stage_runs_table(manifests))
    _create_table(con, "runs", _runs_table(store.list_runs()))
    return con


def query(store: Store, sql: str) -> pa.Table:
    """Run one SQL statement over the store's views and return the result as an Arrow table.

    Over a live run, a file the snapshot listed can be deleted before the query reads it (a transient
    artifact replaced by the next step's); the query is then asked once more over a fresh snapshot.
    """
    for attempt in (1, 2):
        con = connect(store)
        try:
            relation = con.sql(sql)
            return relation.to_arrow_table() if relation is not None else pa.table({})
        except duckdb.IOException:
            if attempt == 2:
                raise
        finally:
            con.close()
    raise AssertionError("unreachable")
