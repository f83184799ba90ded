"""`rlvr query` is read-only (issue 18): one SELECT over the store's views. Writes, files outside the store's
artifacts, ATTACH, INSTALL/LOAD, SET, PRAGMA, DDL and several statements are refused with one line, and the
committed parts stay as they were. The key cases go through the real command line in a subprocess.
"""

from __future__ import annotations

import gc
import hashlib
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pytest

from rlvr.storage.schemas import SCHEMAS
from rlvr.storage.store import Store
from rlvr.storage.views import QueryRefused, _lock_down, connect, data_paths, query
from tests.cli_helpers import cli_env, rlvr, rlvr_command

READ_ONLY = "rlvr query is read-only: one SELECT over the store's views (save results with --format csv > FILE)"


def table_of(kind: str, rows: list[dict[str, Any]]) -> pa.Table:
    schema = SCHEMAS[kind]
    return pa.Table.from_pylist([{name: row.get(name) for name in schema.names} for row in rows], schema=schema)


def fill(store: Store) -> None:
    """Three problems in two categories; four rewards over two steps."""
    problems = [
        {"problem_id": "p1", "category": "add", "split": "train"},
        {"problem_id": "p2", "category": "add", "split": "train"},
        {"problem_id": "p3", "category": "mul", "split": "test"},
    ]
    rewards = [
        {"rollout_id": "r1", "problem_id": "p1", "step": 0, "score": 1.0},
        {"rollout_id": "r2", "problem_id": "p2", "step": 0, "score": 0.0},
        {"rollout_id": "r3", "problem_id": "p3", "step": 1, "score": 1.0},
        {"rollout_id": "r4", "problem_id": "p3", "step": 1, "score": 0.5},
    ]
    common: dict[str, Any] = dict(run_id="run-1", parents=[], code_version="v1", config={})
    store.write_artifact("problems", "problems-1", table_of("problems", problems), stage="problems", **common)
    store.write_artifact("rewards", "rewards-1", table_of("rewards", rewards), stage="label", **common)


def fingerprint(root: Path) -> dict[str, str]:
    """Every file under the store, by path, with the sha256 of its bytes."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    root = tmp_path_factory.mktemp("readonly") / "store"
    made = Store.open(str(root), create=True)
    fill(made)
    yield Store.open(str(root))


@pytest.fixture
def unchanged(store: Store) -> Iterator[None]:
    """The test must leave every file of the store as it was, and add none."""
    root = Path(store.root)
    before = fingerprint(root)
    yield
    assert fingerprint(root) == before


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("outside") / "secret.txt"
    path.write_text("not the store's\n")
    return str(path)


def rewards_part(store: Store) -> str:
    return data_paths(store, store.manifest("rewards-1"))[0]


def refused_line(store: Store, sql: str) -> str:
    """The one stderr line of `rlvr query SQL` on the store, which must exit 2 with nothing on stdout."""
    result = rlvr("query", sql, "--store", store.root)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# ----- through the command line ----------------------------------------------------------------------


def test_copy_onto_a_committed_part_is_refused_and_the_part_is_unchanged(store: Store, unchanged: None) -> None:
    part = rewards_part(store)
    assert os.path.isfile(part)
    sql = f"COPY (SELECT * FROM rewards WHERE score = 0) TO '{part}' (FORMAT parquet)"
    assert refused_line(store, sql) == f"error: query refused: COPY statement; {READ_ONLY}"


def test_reading_a_file_outside_the_store_is_refused(store: Store, outside: str, unchanged: None) -> None:
    line = refused_line(store, f"SELECT * FROM read_text('{outside}')")
    assert line == (
        f'error: query refused: it reads a file outside the store\'s artifacts (Cannot access file "{outside}"); '
        f"{READ_ONLY}"
    )


@pytest.mark.parametrize(
    ("sql", "what"),
    [
        ("INSTALL httpfs", "INSTALL or LOAD statement"),
        ("SET threads = 1", "SET, RESET or USE statement"),
        ("SELECT 1; SELECT 2", "2 statements"),
    ],
)
def test_other_statements_are_refused_in_one_line(store: Store, sql: str, what: str, unchanged: None) -> None:
    assert refused_line(store, sql) == f"error: query refused: {what}; {READ_ONLY}"


def test_a_select_still_answers_on_the_command_line(store: Store, unchanged: None) -> None:
    sql = (
        "SELECT p.category, count(*) AS n, avg(w.score) AS reward FROM rewards w "
        "JOIN problems p USING (problem_id) GROUP BY p.category ORDER BY p.category"
    )
    result = rlvr("query", sql, "--store", store.root, "--format", "csv")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["category,n,reward", "add,2,0.5", "mul,2,0.75"]


@pytest.fixture
def working_dir_with_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory holds DuckDB's default temporary folder `.tmp` with a secret in it, and a file
    of its own; DuckDB allows its temporary folder once external access is off, unless it is moved."""
    (tmp_path / ".tmp").mkdir()
    (tmp_path / ".tmp" / "secret").write_text("token=abc123\n")
    (tmp_path / "notes.txt").write_text("not the store's\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_duckdb_s_temporary_folder_in_the_working_directory_is_not_readable(
    store: Store, working_dir_with_secrets: Path, unchanged: None
) -> None:
    """Issue 37: `.tmp/secret` beside the store, read by absolute path and listed by glob, from the command line
    run in that folder."""
    secret = working_dir_with_secrets / ".tmp" / "secret"
    for sql, shown in (
        (f"SELECT content FROM read_text('{secret}')", str(secret)),
        ("SELECT * FROM glob('.tmp/*')", ".tmp/*"),
    ):
        result = subprocess.run(
            [*rlvr_command("query", sql, "--store", store.root)],
            capture_output=True,
            text=True,
            cwd=working_dir_with_secrets,
            env=cli_env(),
            timeout=300,
        )
        assert result.returncode == 2, (result.stdout, result.stderr)
        assert "abc123" not in result.stdout + result.stderr and "secret" not in result.stdout
        assert result.stderr.splitlines() == [
            f'error: query refused: it reads a file outside the store\'s artifacts (Cannot access file "{shown}"); '
            f"{READ_ONLY}"
        ]


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT content FROM read_text('.tmp/secret')",
        "SELECT content FROM read_text('{cwd}/.tmp/secret')",
        "SELECT content FROM read_blob('.tmp/secret')",
        "SELECT * FROM glob('.tmp/*')",
        "SELECT * FROM glob('{cwd}/.tmp/*')",
        "SELECT content FROM read_text('notes.txt')",
        "SELECT content FROM read_blob('{cwd}/notes.txt')",
        "SELECT * FROM glob('*')",
        "SELECT * FROM read_csv('notes.txt')",
    ],
)
def test_nothing_in_the_working_directory_is_readable(
    store: Store, working_dir_with_secrets: Path, sql: str, unchanged: None
) -> None:
    with pytest.raises(QueryRefused, match=r"^query refused: it reads a file outside the store's artifacts \("):
        query(store, sql.format(cwd=working_dir_with_secrets))


def test_connect_allows_only_the_artifacts_and_a_private_spill_folder(
    store: Store, working_dir_with_secrets: Path
) -> None:
    """`allowed_directories` holds the artifacts folder and the connection's own spill folder (fresh, empty,
    mode 0700, removed with the connection), never the working directory's `.tmp`."""
    con = connect(store)
    try:
        [(allowed,)] = con.execute("SELECT value FROM duckdb_settings() WHERE name = 'allowed_directories'").fetchall()
        [(spill,)] = con.execute("SELECT value FROM duckdb_settings() WHERE name = 'temp_directory'").fetchall()
        private = Path(spill).parent
        assert allowed == f"[{store.root}/artifacts/, {spill}/]"
        assert private.name.startswith("rlvr-query-") and not private.is_relative_to(working_dir_with_secrets)
        assert list(private.iterdir()) == [] and private.stat().st_mode & 0o777 == 0o700
        with pytest.raises(duckdb.PermissionException, match="Cannot access file"):
            con.execute("SELECT content FROM read_text('.tmp/secret')")
    finally:
        con.close()
    del con
    gc.collect()
    assert not private.exists()


def test_a_query_larger_than_memory_spills_into_the_private_folder(
    store: Store, working_dir_with_secrets: Path
) -> None:
    """Spilling still works, into the connection's own folder (not `.tmp` in the working directory)."""
    con = duckdb.connect(":memory:")
    try:
        con.execute("SET memory_limit = '50MB'")  # `connect` keeps DuckDB's default; the lock forbids changing it
        _lock_down(con, store)
        [(spill,)] = con.execute("SELECT value FROM duckdb_settings() WHERE name = 'temp_directory'").fetchall()
        sql = "SELECT count(*) FROM (SELECT i, repeat('x', 50) AS s FROM range(3000000) t(i) ORDER BY s, i DESC)"
        assert con.execute(sql).fetchall() == [(3_000_000,)]
        assert Path(spill).is_dir()  # DuckDB made it to spill, inside the private folder
        assert sorted(p.name for p in (working_dir_with_secrets / ".tmp").iterdir()) == ["secret"]
    finally:
        con.close()


@pytest.mark.parametrize(
    ("sql", "what"),
    [
        (
            "SELECT * FROM query('SELECT count(*) FROM json_execute_serialized_sql(json_serialize_sql(''SELECT 42''))')",
            "query(), which runs SQL unchecked",
        ),
        ("SELECT * FROM query('SELECT 42')", "query(), which runs SQL unchecked"),
        ("SELECT count(*) FROM query_table('rewards')", "query_table(), which runs SQL unchecked"),
        ("SELECT * FROM query_table(['rewards', 'problems'], true)", "query_table(), which runs SQL unchecked"),
        ("SELECT * FROM system.main.query('SELECT 1')", "query(), which runs SQL unchecked"),
        (
            "SELECT * FROM rewards WHERE score IN (SELECT * FROM query('SELECT 1.0'))",
            "query(), which runs SQL unchecked",
        ),
        ("SELECT * FROM checkpoint()", "table function checkpoint(); allowed: "),
        ("SELECT * FROM duckdb_settings()", "table function duckdb_settings(); allowed: "),
    ],
)
def test_table_functions_that_run_sql_or_are_not_allowed_are_refused(store: Store, sql: str, what: str) -> None:
    with pytest.raises(QueryRefused) as refused:
        query(store, sql)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"query refused: {what}") and line.endswith(READ_ONLY)


def test_query_refusal_is_one_line_on_the_command_line(store: Store, unchanged: None) -> None:
    sql = "SELECT * FROM query('SELECT count(*) FROM json_execute_serialized_sql(json_serialize_sql(''SELECT 42''))')"
    assert refused_line(store, sql) == f"error: query refused: query(), which runs SQL unchecked; {READ_ONLY}"


def test_allowed_table_functions_still_answer(store: Store) -> None:
    assert query(store, "SELECT count(*) AS n FROM range(5)").to_pylist() == [{"n": 5}]
    assert query(store, "SELECT * FROM unnest([1, 2]) AS t(x)").num_rows == 2
    assert "rewards" in query(store, "SELECT view_name FROM duckdb_views()").column("view_name").to_pylist()


def test_a_typo_is_still_a_query_failure(store: Store) -> None:
    assert refused_line(store, "SELEC 1") == 'error: query failed: Parser Error: syntax error at or near "SELEC"'


# ----- through query() and connect() -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("sql", "what"),
    [
        ("ATTACH '{tmp}/other.db' AS other", "ATTACH statement"),
        ("DETACH memory", "DETACH statement"),
        ("LOAD httpfs", "INSTALL or LOAD statement"),
        ("RESET threads", "SET, RESET or USE statement"),
        ("PRAGMA version", "PRAGMA statement"),
        ("CREATE TABLE t AS SELECT 1 AS a", "CREATE statement"),
        ("INSERT INTO artifacts (kind) VALUES ('x')", "INSERT statement"),
        ("UPDATE artifacts SET rows = 0", "UPDATE statement"),
        ("DELETE FROM artifacts", "DELETE or TRUNCATE statement"),
        ("DROP VIEW rewards", "DROP or DEALLOCATE statement"),
        ("ALTER VIEW rewards RENAME TO gone", "ALTER or COMMENT ON statement"),
        ("CALL pragma_version()", "CALL or CHECKPOINT statement"),
        ("CHECKPOINT", "CALL or CHECKPOINT statement"),
        ("VACUUM", "VACUUM statement"),
        ("EXPORT DATABASE '{tmp}/export'", "EXPORT statement"),
        ("EXPLAIN ANALYZE COPY (SELECT 1) TO '{tmp}/x.csv'", "EXPLAIN statement"),
        ("UPDATE EXTENSIONS", "not a SELECT statement"),
        ("WITH gone AS (DELETE FROM artifacts RETURNING *) SELECT count(*) FROM gone", "DELETE inside a SELECT"),
        ("WITH new AS (INSERT INTO artifacts (kind) VALUES ('x') RETURNING *) FROM new", "INSERT inside a SELECT"),
        (
            "SELECT * FROM json_execute_serialized_sql('{{}}')",
            "json_execute_serialized_sql(), which runs SQL unchecked",
        ),
        ("SELECT 1; COPY (SELECT 1) TO '{tmp}/x.csv'", "2 statements"),
        ("  ; -- nothing", "no statement"),
    ],
)
def test_query_refuses_all_but_one_select(store: Store, tmp_path: Path, sql: str, what: str, unchanged: None) -> None:
    with pytest.raises(QueryRefused) as refused:
        query(store, sql.format(tmp=tmp_path))
    assert str(refused.value) == f"query refused: {what}; {READ_ONLY}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT * FROM read_text('/etc/passwd')",
        "SELECT * FROM read_csv('{outside}')",
        "SELECT * FROM read_blob('{outside}')",
        "SELECT * FROM read_json('{outside}')",
        "SELECT * FROM glob('{store}/manifests/*')",
        "SELECT * FROM read_text('{store}/artifacts/../STORE')",
        "SELECT * FROM parquet_metadata('{store}/artifacts-elsewhere/x.parquet')",
        "SELECT * FROM read_csv('https://example.com/x.csv')",
    ],
)
def test_table_functions_read_nothing_outside_the_artifacts(store: Store, outside: str, sql: str) -> None:
    with pytest.raises(QueryRefused, match=r"^query refused: it reads a file outside the store's artifacts \("):
        query(store, sql.format(outside=outside, store=store.root))


def test_the_store_s_own_parts_stay_readable_through_table_functions(store: Store) -> None:
    part = rewards_part(store)
    assert query(store, f"SELECT sum(score) AS s FROM read_parquet('{part}')").to_pylist() == [{"s": 2.5}]
    [row] = query(store, f"SELECT count(*) AS n FROM glob('{store.root}/artifacts/*/*/*.parquet')").to_pylist()
    assert row == {"n": 2}


def test_ordinary_queries_answer(store: Store) -> None:
    joined = query(
        store,
        "SELECT w.rollout_id, p.category FROM rewards w JOIN problems p USING (problem_id) ORDER BY w.rollout_id",
    ).to_pylist()
    assert [(r["rollout_id"], r["category"]) for r in joined] == [
        ("r1", "add"),
        ("r2", "add"),
        ("r3", "mul"),
        ("r4", "mul"),
    ]
    per_step = query(store, "SELECT step, sum(score) AS total FROM rewards GROUP BY step ORDER BY step")
    assert per_step.to_pylist() == [{"step": 0, "total": 1.0}, {"step": 1, "total": 1.5}]
    cte = query(store, "WITH good AS (SELECT * FROM rewards WHERE score > 0) SELECT count(*) AS n FROM good")
    assert cte.to_pylist() == [{"n": 3}]
    shorthand = query(store, "FROM artifacts SELECT kind, rows ORDER BY kind").to_pylist()
    assert shorthand == [{"kind": "problems", "rows": 3}, {"kind": "rewards", "rows": 4}]
    assert query(store, "VALUES (1), (2) UNION ALL SELECT 3").num_rows == 3
    assert [r["column_name"] for r in query(store, "DESCRIBE problems").to_pylist()][:2] == ["problem_id", "run_id"]
    summary = query(store, "SUMMARIZE SELECT score FROM rewards").to_pylist()
    assert (summary[0]["min"], summary[0]["max"]) == ("0.0", "1.0")


def test_connect_is_locked_down_but_does_not_check_statements(store: Store, outside: str) -> None:
    con = connect(store)
    try:
        with pytest.raises(duckdb.PermissionException, match="Cannot access file"):
            con.execute(f"SELECT * FROM read_text('{outside}')")
        with pytest.raises(duckdb.InvalidInputException, match="the configuration has been locked"):
            con.execute("SET enable_external_access = true")
        with pytest.raises(duckdb.PermissionException):
            con.execute("INSTALL httpfs")
        assert con.execute("SELECT count(*) FROM rewards").fetchone() == (4,)
    finally:
        con.close()


# ----- a store that is not on the local disk ---------------------------------------------------------


def test_a_store_on_fsspec_reads_its_artifacts_and_nothing_else(outside: str) -> None:
    """DuckDB reads a memory:// (or s3://) store through a registered fsspec filesystem; the allowed
    folder is the artifacts folder's URL, checked before the filesystem sees a path."""
    store = Store.open(f"memory://rlvr-readonly-{uuid.uuid4().hex[:8]}", create=True)
    try:
        fill(store)
        total = query(store, "SELECT sum(score) AS s FROM rewards JOIN problems USING (problem_id)").to_pylist()
        assert total == [{"s": 2.5}]
        part = rewards_part(store)
        assert part.startswith("memory://") and part.endswith("part-00000.parquet")
        assert query(store, f"SELECT count(*) AS n FROM read_parquet('{part}')").to_pylist() == [{"n": 4}]
        elsewhere = store.fs.unstrip_protocol(store.path("STORE"))
        for path in (elsewhere, outside):
            with pytest.raises(QueryRefused, match=f'outside the store\'s artifacts \\(Cannot access file "{path}"\\)'):
                query(store, f"SELECT * FROM read_text('{path}')")
        before = store.fs.cat_file(store.fs._strip_protocol(part))
        with pytest.raises(QueryRefused, match="COPY statement"):
            query(store, f"COPY (SELECT 1 AS x) TO '{part}'")
        assert store.fs.cat_file(store.fs._strip_protocol(part)) == before
    finally:
        store.fs.rm(store.path(), recursive=True)


def test_a_store_on_s3_reads_its_artifacts_and_nothing_else(outside: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on S3 (moto's server on localhost), through the command line as a user runs it."""
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
        s3fs.S3FileSystem().mkdir("rlvr-readonly")
        store = Store.open("s3://rlvr-readonly/store", create=True)
        fill(store)
        part = rewards_part(store)
        assert part.startswith("s3://rlvr-readonly/store/artifacts/rewards/")
        result = rlvr(
            "query", f"SELECT count(*) AS n FROM read_parquet('{part}')", "--store", store.root, "--format", "csv"
        )
        assert result.stdout.splitlines() == ["n", "4"], result.stderr
        with pytest.raises(QueryRefused, match=f'Cannot access file "{outside}"'):
            query(store, f"SELECT * FROM read_text('{outside}')")
        manifest = store.fs.unstrip_protocol(store.manifest_path("rewards-1"))
        with pytest.raises(QueryRefused, match=f'Cannot access file "{manifest}"'):
            query(store, f"SELECT * FROM read_text('{manifest}')")
        with pytest.raises(QueryRefused, match=r'Cannot access file "s3://rlvr-readonly/elsewhere\.csv"'):
            query(store, "SELECT * FROM read_csv('s3://rlvr-readonly/elsewhere.csv')")
        assert query(store, "SELECT count(*) AS n FROM problems").to_pylist() == [{"n": 3}]
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def test_a_store_written_before_a_column_existed_answers_queries_that_name_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`train_steps.device` and `peak_memory_bytes` came later, and the mismatch columns after them; artifacts
    written before them read as nulls, and the columns they have keep their values."""
    declared = SCHEMAS["train_steps"]
    later = ("device", "peak_memory_bytes", "mismatch_mean", "mismatch_max", "mismatch_kl", "corrected_share")
    before = pa.schema([f for f in declared if f.name not in later])
    values = {"run_id": ["r", "r"], "step": [1, 2], "loss": [0.5, 0.25]}
    old = pa.table({f.name: values.get(f.name, [None, None]) for f in before}, schema=before)
    store = Store.open(str(tmp_path / "store"), create=True)
    with monkeypatch.context() as patched:
        patched.setitem(SCHEMAS, "train_steps", before)  # what the store's writer declared then
        store.write_artifact(
            "train_steps", "train_steps-old", old, run_id="r", stage="train", parents=[], code_version="v", config={}
        )
    rows = query(store, "SELECT step, loss, device, peak_memory_bytes FROM train_steps ORDER BY step").to_pylist()
    assert rows == [
        {"step": 1, "loss": 0.5, "device": None, "peak_memory_bytes": None},
        {"step": 2, "loss": 0.25, "device": None, "peak_memory_bytes": None},
    ]
    assert query(store, "DESCRIBE train_steps").column("column_name").to_pylist() == declared.names
