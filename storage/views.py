"""DuckDB views over the committed artifacts of a store: every question about a run is one SQL query.

Views list the files named in manifests and nothing else (no globbing), so uncommitted or half-written
files can never show up in a query. DuckDB scans the Parquet files itself; nothing is loaded into Python.
What the manifests say comes from the catalog index (storage/catalog.py), not from reading each of them.

A store on object storage (s3://...) is read through its fsspec filesystem: DuckDB's own httpfs
extension for 2.0 installs only from extensions.duckdb.org, not from a package index. `StoreFiles`
puts that filesystem in front of DuckDB so each committed part costs one GET (see its docstring).

`connect` and `query` are read-only: the connection reads files only under the store's artifacts folder
and its settings are locked (`_lock_down`, which also moves DuckDB's temporary folder to a private one), and
`query` (like `rlvr query`) runs only one SELECT calling only allowed table functions (`check_read_only`),
because DuckDB's settings alone still let a COPY overwrite a committed part.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Collection, Iterable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

import duckdb
import fsspec
import pyarrow as pa
import pyarrow.compute as pc

import rlvr.storage.catalog as catalog
from rlvr.errors import UserError
from rlvr.storage.files import read_whole
from rlvr.storage.manifest import Manifest
from rlvr.storage.run_records import run_status
from rlvr.storage.schemas import OPEN_KINDS, SCHEMAS
from rlvr.storage.store import Store

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


def sql_string(text: str) -> str:
    """`text` as a SQL string literal (quotes doubled)."""
    return "'" + text.replace("'", "''") + "'"


def _sql_identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class StoreFiles(fsspec.AbstractFileSystem):
    """What DuckDB sees of a store on object storage: its fsspec filesystem, reading each committed
    Parquet part whole, in one request, and keeping the bytes for the connection's life.

    Through the plain filesystem DuckDB asks for each file's existence, size, modification time and
    several byte ranges, one round trip each: four HEADs and two or three GETs per file on S3, and again
    at every query, because a view binds anew. A committed part never changes, so one GET answers all
    of them. The parts of one view (`read_together`) are fetched concurrently the first time DuckDB
    opens any of them: it reads every one to bind the view. Past `max_bytes` held, files are read
    through the filesystem as they are.
    """

    cachable = False  # one per connection: fsspec must not hand the same instance to another

    def __init__(self, fs: fsspec.AbstractFileSystem, max_bytes: int = 512 << 20) -> None:
        super().__init__()
        self.protocol = fs.protocol  # DuckDB routes the URLs of this protocol here
        self.fs = fs
        self.max_bytes = max_bytes
        self._held: dict[str, bytes] = {}
        self._held_bytes = 0
        self._together: dict[str, tuple[str, ...]] = {}
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    def read_together(self, sizes: Mapping[str, int]) -> None:
        """These files (URL -> size in bytes, from their manifests) are read together: one view's parts."""
        group = tuple(self._strip(path) for path in sizes)
        for path, size in zip(group, sizes.values()):
            self._together[path] = group
            self._sizes[path] = size

    def _strip(self, path: str) -> str:
        return str(self.fs._strip_protocol(path))

    def _load(self, path: str) -> bytes | None:
        """The bytes of the file at `path` (stripped), fetched with its group if not held; None when
        it is too large to hold. Raises FileNotFoundError."""
        with self._lock:
            if path in self._held:
                return self._held[path]
            if self._sizes.get(path, 0) > self.max_bytes - self._held_bytes:
                return None
            group = [p for p in self._together.get(path, (path,)) if p not in self._held]
            budget = self.max_bytes - self._held_bytes
            if len(group) > 1 and sum(self._sizes.get(p, budget) for p in group) <= budget:
                fetched = self.fs.cat(group, on_error="omit", start=0)  # start=0: see read_whole
            else:
                fetched = {path: read_whole(self.fs, path)}
            for name, data in fetched.items():
                name = self._strip(name)
                if isinstance(data, bytes) and len(data) <= self.max_bytes - self._held_bytes:
                    self._held[name] = data
                    self._held_bytes += len(data)
            if path not in fetched and path not in self._held:
                raise FileNotFoundError(path)
            return self._held.get(path, fetched.get(path))

    # ----- what DuckDB calls ---------------------------------------------------------------------------

    def _strip_protocol(self, path: str) -> str:
        return self._strip(path)

    def unstrip_protocol(self, name: str) -> str:
        return str(self.fs.unstrip_protocol(name))

    def glob(self, path: str, **kwargs: Any) -> Any:
        stripped = self._strip(path)
        if any(char in stripped for char in "*?["):  # a pattern, not one of our files
            return self.fs.glob(path, **kwargs)
        return [stripped] if self.exists(stripped) else []

    def exists(self, path: str, **kwargs: Any) -> bool:
        try:
            self._load(self._strip(path))
        except (FileNotFoundError, IsADirectoryError):
            return bool(self.fs.exists(path))  # a directory, or a file written since
        return True

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        stripped = self._strip(path)
        data = self._load(stripped)
        if data is None:
            return dict(self.fs.info(path, **kwargs))
        return {"name": stripped, "size": len(data), "type": "file"}

    def size(self, path: str) -> int:
        return int(self.info(path)["size"])

    def modified(self, path: str) -> datetime:
        if self._load(self._strip(path)) is None:
            return self.fs.modified(path)
        return datetime.fromtimestamp(0, UTC)  # immutable: the same bytes whenever it is asked

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self.fs.ls(path, detail=detail, **kwargs)

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if mode == "rb":
            data = self._load(self._strip(path))
            if data is not None:
                return io.BytesIO(data)
        return self.fs.open(path, mode, **kwargs)


def duckdb_connection(store: Store) -> duckdb.DuckDBPyConnection:
    """A fresh in-memory connection that can read the store's files.

    For a non-local store DuckDB reads through the store's own fsspec filesystem, behind `StoreFiles`
    (`register_filesystem`; tested with fsspec's memory filesystem and with s3fs on a local S3 server).
    """
    return _connection(store)[0]


def _connection(store: Store) -> tuple[duckdb.DuckDBPyConnection, StoreFiles | None]:
    con = duckdb.connect(":memory:")
    if store.is_local:
        return con, None
    files = StoreFiles(store.fs)
    con.register_filesystem(files)
    return con, files


def data_paths(store: Store, manifest: Manifest) -> list[str]:
    """The Parquet parts of a committed artifact, as paths DuckDB can open on `duckdb_connection`."""
    directory = store.artifact_dir(manifest.kind, manifest.artifact_id)
    paths = [f"{directory}/{entry['path']}" for entry in manifest.table_files]
    if store.is_local:
        return paths
    return [store.fs.unstrip_protocol(path) for path in paths]


def _parts(store: Store, rows: pa.Table) -> dict[str, int]:
    """The Parquet parts of these catalog rows (one kind's artifacts), path -> size in bytes, as `data_paths`
    names them."""
    parts: dict[str, int] = {}
    kinds, ids = rows.column("kind").to_pylist(), rows.column("artifact_id").to_pylist()
    for kind, artifact_id, entries in zip(kinds, ids, catalog.files_of(rows)):
        directory = store.artifact_dir(kind, artifact_id)
        for entry in entries:
            if entry["rows"] is not None:
                path = f"{directory}/{entry['path']}"
                parts[path if store.is_local else store.fs.unstrip_protocol(path)] = entry["bytes"]
    return parts


def _declared_schema(kind: str, rows: pa.Table) -> bool:
    """Whether every part of these artifacts of `kind` has exactly its declared schema: their manifests say so,
    and the store conforms every table of a declared kind that is not open (extra columns) to it."""
    if kind not in SCHEMAS or kind in OPEN_KINDS:
        return False
    return bool(pc.all(pc.equal(rows.column("schema"), str(SCHEMAS[kind]))).as_py())


def _with_stage_run(rows: pa.Table) -> pa.Table:
    """The rows whose manifest records the stage run that made it (the only ones `stage_runs` counts)."""
    return rows.filter(pc.match_substring(rows.column("extra"), '"stage_run":'))


def parquet_scan(paths: Iterable[str], extra_options: str = "", by_name: bool = True) -> str:
    """SQL for a scan of exactly these files, columns matched by name across files (`by_name`: DuckDB then
    reads every file's footer to bind the scan; without it, for files of one schema, only the first's)."""
    listed = ", ".join(sql_string(path) for path in paths)
    return f"read_parquet([{listed}], union_by_name = {str(by_name).lower()}{extra_options})"


def _create_kind_view(
    con: duckdb.DuckDBPyConnection, kind: str, paths: list[str], store: Store, declared: bool = False
) -> None:
    """A view over these files. During a live run a transient artifact (the newest train_state, a
    strategy's state) can be replaced between the manifest listing and this call: its files are gone
    and so is its manifest, so the view leaves them out (a file gone after this call fails the query, and
    `query` asks it again over a fresh snapshot). `declared`: every file has the kind's declared schema."""
    try:
        con.execute(f"CREATE VIEW {_sql_identifier(kind)} AS {_scan_with_declared(con, kind, paths, declared)}")
    except duckdb.IOException:
        present = [path for path in paths if store.fs.exists(path)]
        if not present and kind in SCHEMAS:
            _create_empty_view(con, kind, SCHEMAS[kind])
        elif present:
            scan = _scan_with_declared(con, kind, present, declared)
            con.execute(f"CREATE VIEW {_sql_identifier(kind)} AS {scan}")


def _scan_with_declared(con: duckdb.DuckDBPyConnection, kind: str, paths: list[str], declared: bool) -> str:
    """The files' rows, plus every declared column they lack as nulls: a store whose artifacts all predate a
    column (e.g. `train_steps.device`) still answers queries that name it. Costs no file read. When every
    file has the declared schema (`declared`), the scan binds on the first file's footer alone: matching
    columns by name would read every footer twice, once to bind and once to scan (2,500 files: 0.3 s)."""
    scan = f"SELECT * FROM {parquet_scan(paths, by_name=not declared)}"
    if kind not in SCHEMAS:
        return scan
    return f"{scan} UNION ALL BY NAME ({_declared_nulls(con, SCHEMAS[kind])} LIMIT 0)"


def _declared_nulls(con: duckdb.DuckDBPyConnection, schema: pa.Schema) -> str:
    types = con.from_arrow(schema.empty_table()).types
    columns = ", ".join(
        f"CAST(NULL AS {duck_type}) AS {_sql_identifier(name)}" for name, duck_type in zip(schema.names, types)
    )
    return f"SELECT {columns}"


def _create_empty_view(con: duckdb.DuckDBPyConnection, kind: str, schema: pa.Schema) -> None:
    """A kind no stage has written yet is an empty view with its declared columns, not a missing table."""
    con.execute(f"CREATE VIEW {_sql_identifier(kind)} AS {_declared_nulls(con, schema)} LIMIT 0")


def _create_table(con: duckdb.DuckDBPyConnection, name: str, table: pa.Table) -> None:
    con.from_arrow(table).create(name)


def _artifacts_table(rows: pa.Table) -> pa.Table:
    """The `artifacts` table: the catalog's rows (storage/catalog.py), as its columns."""
    columns = {name: rows.column(name) for name in _ARTIFACTS_SCHEMA.names if name != "parents_count"}
    columns["parents_count"] = pc.list_value_length(rows.column("parents")).cast(pa.int64())
    return pa.table([columns[name] for name in _ARTIFACTS_SCHEMA.names], schema=_ARTIFACTS_SCHEMA)


def _lineage_table(rows: pa.Table) -> pa.Table:
    parents = rows.column("parents").combine_chunks()
    children = rows.column("artifact_id").take(pc.list_parent_indices(parents))
    return pa.table([children, pc.list_flatten(parents)], schema=_LINEAGE_SCHEMA)


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
        ("device", pa.string()),
        ("peak_memory_bytes", pa.int64()),
    ]
)


def _stage_runs_table(manifests: list[Manifest]) -> pa.Table:
    """One row per stage run that committed something: the manifests of its outputs grouped together.

    read/build seconds come from the runner's record; commit seconds run from the end of the build to
    the last output's manifest (each manifest records the commit time of the outputs before it, which
    also counts an output deleted since, like a replaced train_state). `device` and `peak_memory_bytes` are
    what a stage with a model reported (trainer/devices.py: the device its model ran on, the accelerator's peak
    allocated bytes, null on the CPU); both are null for stages without a model.
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
                "device": record.get("device"),
                "peak_memory_bytes": record.get("peak_memory_bytes"),
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


def _parsed_select(con: duckdb.DuckDBPyConnection, sql: str) -> dict[str, Any] | None:
    """DuckDB's syntax tree of `sql` (nothing is bound), or None when it is not only SELECT statements:
    `json_serialize_sql` serializes nothing else."""
    try:
        tree = json.loads(con.execute("SELECT json_serialize_sql($1)", [sql]).fetchall()[0][0])
    except duckdb.Error:
        return None
    return None if tree.get("error") else tree


def _nodes(tree: Any) -> Iterator[dict[str, Any]]:
    """Every object in a serialized syntax tree, depth first."""
    pending: list[Any] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
        elif isinstance(node, dict):
            yield node
            pending.extend(node.values())


def _function_name(node: dict[str, Any]) -> str:
    """The name of a TABLE_FUNCTION node's function, lower case, without its schema or catalog."""
    function = node.get("function")
    return str(function.get("function_name", "")).lower() if isinstance(function, dict) else ""


def _tables_named(con: duckdb.DuckDBPyConnection, sql: str) -> set[str] | None:
    """The tables and views a SELECT statement names, from DuckDB's parser (nothing is bound), or None
    when the statement may read any of them: it does not parse as SELECT statements, or it uses a
    table function that lists them (`duckdb_views()`, ...), SHOW TABLES or another schema
    (information_schema, ...). File readers and `range`-like functions read no view."""
    tree = _parsed_select(con, sql)
    if tree is None:
        return None
    names: set[str] = set()
    for node in _nodes(tree):
        kind = node.get("type")
        if kind == "TABLE_FUNCTION" and _function_name(node) not in _VIEWLESS_FUNCTIONS:
            return None  # e.g. duckdb_views(): it lists them all
        if kind == "SHOW_REF" and node.get("table_name"):
            return None
        if kind == "BASE_TABLE":
            if node.get("schema_name") not in ("", "main") or node.get("catalog_name") not in ("", None):
                return None
            names.add(str(node["table_name"]).lower())  # a CTE's name too: it just matches no view
    return names


# ----- read-only queries ---------------------------------------------------------------------------

READ_ONLY = "rlvr query is read-only: one SELECT over the store's views (save results with --format csv > FILE)"
# Query nodes that only read; a WITH clause may also hold INSERT, UPDATE or DELETE nodes.
_READ_NODES = frozenset({"SELECT_NODE", "SET_OPERATION_NODE", "CTE_NODE", "RECURSIVE_CTE_NODE"})
# Table functions that run SQL the statement check never sees.
_UNCHECKED_SQL_FUNCTIONS = frozenset({"json_execute_serialized_sql", "query", "query_table"})
# The only table functions a statement may call (an allow-list: a DuckDB release can add table functions
# with effects, as `checkpoint()` and `enable_logging()` are today). The readers open files only under the
# store's artifacts folder (`_lock_down`); the rest make values or describe the connection's own catalog.
_READER_FUNCTIONS = (
    "read_parquet parquet_scan parquet_metadata parquet_schema parquet_file_metadata parquet_kv_metadata "
    "read_csv read_csv_auto read_json read_json_auto read_ndjson read_ndjson_auto read_json_objects "
    "read_json_objects_auto read_ndjson_objects read_text read_blob glob"
)
_VALUE_FUNCTIONS = "range generate_series unnest repeat repeat_row json_each json_tree"
_CATALOG_FUNCTIONS = (
    "duckdb_columns duckdb_tables duckdb_views duckdb_schemas duckdb_types duckdb_functions duckdb_keywords "
    "pragma_table_info"
)
_ALLOWED_TABLE_FUNCTIONS = frozenset(f"{_READER_FUNCTIONS} {_VALUE_FUNCTIONS} {_CATALOG_FUNCTIONS}".split())
_VIEWLESS_FUNCTIONS = frozenset(f"{_READER_FUNCTIONS} {_VALUE_FUNCTIONS}".split())  # they read no view
# What the user typed, by DuckDB's statement type, where its name does not say.
_STATEMENT_WORDS = {
    "LOAD": "INSTALL or LOAD statement",
    "SET": "SET, RESET or USE statement",
    "VARIABLE_SET": "SET VARIABLE statement",
    "CALL": "CALL or CHECKPOINT statement",
    "DELETE": "DELETE or TRUNCATE statement",
    "DROP": "DROP or DEALLOCATE statement",
    "ALTER": "ALTER or COMMENT ON statement",
    "TRANSACTION": "BEGIN, COMMIT or ROLLBACK statement",
    "MULTI": "PIVOT without an IN list (several statements)",
    "COPY_DATABASE": "COPY FROM DATABASE statement",
}


class QueryRefused(UserError):
    """A statement the read-only query path does not run: it would write, reach outside the store's
    artifacts, or change DuckDB's settings."""


def _refused(what: str) -> QueryRefused:
    return QueryRefused(f"query refused: {what}; {READ_ONLY}")


def check_read_only(sql: str, con: duckdb.DuckDBPyConnection | None = None) -> None:
    """Raise QueryRefused unless `sql` is exactly one SELECT (WITH, VALUES, `FROM view`, set operations,
    DESCRIBE, SHOW, SUMMARIZE) that modifies nothing; SQL that does not parse raises DuckDB's ParserException.

    DuckDB's parser decides, not keywords: the statement's type, then its syntax tree, since a WITH clause
    may hold an INSERT, UPDATE or DELETE. This is what stops writes: the connection's settings let a COPY
    write under the store's artifacts folder, the one place it may read. The SQL is only parsed, on `con`
    when given (a new connection costs ~15 ms), else on a fresh in-memory one.
    """
    if con is None:
        with duckdb.connect(":memory:") as parser:
            check_read_only(sql, parser)
        return
    _check_one_select(con.extract_statements(sql))
    tree = _parsed_select(con, sql)
    if tree is None:
        raise _refused("a SELECT that DuckDB cannot serialize for checking")
    _check_tree_reads_only(tree)


def _check_one_select(statements: list[Any]) -> None:
    """Refuse anything but one statement of DuckDB's SELECT type."""
    if len(statements) != 1:
        raise _refused(f"{len(statements)} statements" if statements else "no statement")
    try:
        kind = statements[0].type.name
    except ValueError:  # a type the Python API has no name for (UPDATE EXTENSIONS, ...)
        raise _refused("not a SELECT statement") from None
    if kind != "SELECT":
        raise _refused(_STATEMENT_WORDS.get(kind, f"{kind.replace('_', ' ')} statement"))


def _check_tree_reads_only(tree: dict[str, Any]) -> None:
    """Refuse a SELECT's syntax tree holding a query node that writes (WITH x AS (DELETE ...)), a table
    function that runs SQL of its own (`query()`, ...), or any table function outside the allow-list."""
    for node in _nodes(tree):
        kind = str(node.get("type", ""))
        if kind.endswith("_NODE") and kind not in _READ_NODES:
            raise _refused(f"{kind.removesuffix('_NODE').removesuffix('_QUERY').replace('_', ' ')} inside a SELECT")
        if kind == "TABLE_FUNCTION":
            name = _function_name(node)
            if name in _UNCHECKED_SQL_FUNCTIONS:
                raise _refused(f"{name}(), which runs SQL unchecked")
            if name not in _ALLOWED_TABLE_FUNCTIONS:
                raise _refused(f"table function {name}(); allowed: {', '.join(sorted(_ALLOWED_TABLE_FUNCTIONS))}")


def refusal(exc: duckdb.PermissionException) -> QueryRefused:
    """The one line for what the connection's settings stopped: a file or URL outside the store's artifacts."""
    detail = str(exc).splitlines()[0].removeprefix("Permission Error: ")
    detail = detail.split(" - file system operations are disabled")[0]
    if detail.startswith("Cannot access"):
        return _refused(f"it reads a file outside the store's artifacts ({detail})")
    return _refused(detail)


def _lock_down(con: duckdb.DuckDBPyConnection, store: Store) -> None:
    """Once the views exist: DuckDB opens files only under the store's artifacts folder (on object storage
    that folder's URL, which DuckDB checks before `StoreFiles` sees the path), installs and loads no
    extension, and no later statement can change these settings.

    Turning external access off also allows DuckDB's temporary directory, by default `.tmp` under the
    working directory, whatever it holds. So the connection spills to a folder of its own first: a fresh
    empty one (mode 0700), which DuckDB creates inside only when a query spills and empties on close, and
    which goes when the connection does. `allowed_directories` then holds the artifacts and that folder.
    """
    artifacts = store.path("artifacts")
    if not store.is_local:
        artifacts = store.fs.unstrip_protocol(artifacts)
    private = tempfile.mkdtemp(prefix="rlvr-query-")
    weakref.finalize(con, shutil.rmtree, private, ignore_errors=True)
    con.execute(f"SET temp_directory = {sql_string(os.path.join(private, 'spill'))}")
    con.execute(f"SET allowed_directories = [{sql_string(artifacts)}]")
    con.execute("SET enable_external_access = false")
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute("SET enable_progress_bar = false")  # it prints to stdout, into `rlvr query ... --format csv > FILE`
    con.execute("SET lock_configuration = true")


def connect(store: Store, sql: str | None = None, run_ids: Collection[str] | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with one view per artifact kind plus `artifacts`, `lineage`, `stage_runs` and `runs`.

    It is a snapshot: artifacts committed after this call appear on the next `connect`. What the manifests
    say comes from the catalog index (storage/catalog.py: one listing of the manifests, the newest snapshot and
    the log entries after it). A view binds by reading the footers of all its files, so given the `sql` it
    will run, only the views and catalog tables that statement reads are made (a view over the others would
    cost a read of every file in the store, a request each on object storage).

    `run_ids`: only these runs' artifacts are in the views (a reader of one run of a store of many then reads the
    footers of that run's files alone).

    The connection is locked down (`_lock_down`): it reads only the store's artifacts and its settings
    cannot change. It does not check statements: run untrusted SQL through `query` or `check_read_only`.
    """
    con, files = _connection(store)
    wanted = _tables_named(con, sql) if sql is not None else None
    named = lambda name: wanted is None or name in wanted  # noqa: E731
    rows = catalog.committed(store)
    if run_ids is not None:
        rows = rows.filter(pc.is_in(rows.column("run_id"), value_set=pa.array(sorted(run_ids), pa.string())))
    kind_column = rows.column("kind")
    for kind in sorted(set(SCHEMAS) | set(pc.unique(kind_column).to_pylist())):
        if not named(kind):
            continue
        of_kind = rows.filter(pc.equal(kind_column, kind))
        parts = _parts(store, of_kind)
        if parts:
            if files is not None:
                files.read_together(parts)
            _create_kind_view(con, kind, list(parts), store, _declared_schema(kind, of_kind))
        elif kind in SCHEMAS:
            _create_empty_view(con, kind, SCHEMAS[kind])
    if named("artifacts"):
        _create_table(con, "artifacts", _artifacts_table(rows))
    if named("lineage"):
        _create_table(con, "lineage", _lineage_table(rows))
    if named("stage_runs"):
        _create_table(con, "stage_runs", _stage_runs_table(catalog.manifests_of(_with_stage_run(rows))))
    if named("runs"):
        _create_table(con, "runs", _runs_table(store.list_runs()))
    _lock_down(con, store)
    return con


def query(store: Store, sql: str) -> pa.Table:
    """Run one SELECT over the store's views and return the result as an Arrow table; anything else, or a
    read outside the store's artifacts, raises QueryRefused (see `check_read_only`).

    Over a live run, a file the snapshot listed can be deleted before the query reads it (a transient
    artifact replaced by the next step's); the query is then asked once more over a fresh snapshot.
    """
    for attempt in (1, 2):
        con = connect(store, sql)  # only parses `sql`: nothing runs before the check
        try:
            check_read_only(sql, con)
            relation = con.sql(sql)
            return relation.to_arrow_table() if relation is not None else pa.table({})
        except duckdb.PermissionException as exc:
            raise refusal(exc) from None
        except duckdb.IOException:
            if attempt == 2:
                raise
        finally:
            con.close()
    raise AssertionError("unreachable")
