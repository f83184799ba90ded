"""SQL verifier: runs the predicted and the gold query on the database the reference names and compares
their result sets (execution accuracy), with the partial-credit components of docs/methods.md#sql-partial-credit.

Reference: `{"db": PATH, "sql": GOLD_SQL}` (a dict or its JSON string), optional `"dialect"`
("sqlite" or "duckdb"; by default from the extension: .duckdb is DuckDB, .db/.sqlite/.sqlite3 SQLite),
`"ordered"` (compare rows in order; default: true iff the gold SQL has a top-level ORDER BY) and
`"timeout_s"` (per statement, default `STATEMENT_TIMEOUT_S`).

The predicted SQL is the last ```sql block of the response, else its last ``` block, else the whole text.
Only one statement, a SELECT or a WITH query, is run; anything else (several statements, DROP, PRAGMA,
SET ...) is refused without running it. Both queries run read-only: SQLite through a `mode=ro` URI plus
an authorizer that allows only reads, DuckDB with `read_only=True` and external (file) access disabled.
A statement is stopped after its timeout: SQLite by a progress handler, DuckDB by `interrupt()` from a
timer thread. At most `MAX_ROWS` rows are read from a result.

Result sets are compared as multisets of rows (as lists when ordered). Values are normalised first:
integral floats become ints (SUM over ints equals SUM over reals), other floats and decimals are
rounded to 7 significant digits (values within about 1e-6 relative compare equal), NULL equals NULL,
NaN equals NaN, lists and structs become tuples. Column names are not compared.

Components, all in [0, 1]:
  execution       1 if the result sets are equivalent
  syntax          1 if the predicted SQL ran without error (within the timeout)
  schema_linking  Jaccard over the table and column names the two queries mention (identifiers found by
                  a simple tokenizer and kept if they name a table or column of the database;
                  1 when neither mentions any)
  ngram           Jaccard over the sets of token 1-, 2- and 3-grams of the two queries
Value: 1.0 when execution is 1; otherwise the partial credit
  0.1 * syntax + 0.1 * schema_linking + 0.1 * ngram        (at most 0.3, always below a correct query)
except that a refused statement and a timed-out one score 0.0.

Statuses: ok iff execution is 1; unparseable when the response holds no SQL text; wrong for a different
result, a failing or refused query; timeout when the predicted query ran out of time; error for a bad
reference (no db file, unknown dialect, a gold query that is refused or fails) and timeout when the gold
query runs out of time.
"""

from __future__ import annotations

import json
import math
import os
import re
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Mapping
from decimal import Decimal
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

from rlvr.verifiers.base import MISSING_REFERENCE, Score, Verifier, is_missing, non_text_error, self_check_error

STATEMENT_TIMEOUT_S = 2.0
MAX_ROWS = 100_000
MAX_SQL_CHARS = 50_000
FETCH_BATCH = 1_000
SIGNIFICANT_DIGITS = 7
WEIGHT_SYNTAX = 0.1
WEIGHT_SCHEMA = 0.1
WEIGHT_NGRAM = 0.1
SQLITE_PROGRESS_STEPS = 1_000  # SQLite VM instructions between two deadline checks
DUCKDB_CONFIG = {
    "enable_external_access": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "threads": 1,
    "memory_limit": "512MB",
}
DUCKDB_SESSION_SETTINGS = ("SET enable_progress_bar = false", "SET lock_configuration = true")  # lock last
DIALECT_BY_SUFFIX = {".duckdb": "duckdb", ".db": "sqlite", ".sqlite": "sqlite", ".sqlite3": "sqlite"}
_SQLITE_ALLOWED_ACTIONS = {
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_FUNCTION,
    sqlite3.SQLITE_RECURSIVE,
}


class StatementTimeout(Exception):
    """The statement ran past its deadline and was interrupted."""


class RefusedStatement(Exception):
    """The SQL is not a single SELECT/WITH statement, so it is not run."""


# ---------------------------------------------------------------------------------------------
# Extraction and tokens

_SQL_FENCE = re.compile(r"```[ \t]*sql[^\n]*\n(.*?)(?:```|\Z)", re.IGNORECASE | re.DOTALL)
_ANY_FENCE = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_sql(response: str) -> str:
    """The last ```sql block, else the last ``` block, else the whole response (stripped)."""
    for fence in (_SQL_FENCE, _ANY_FENCE):
        blocks = fence.findall(response)
        if blocks:
            return blocks[-1].strip()
    return response.strip()


_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
    |(?P<comment>--[^\n]*|/\*.*?(?:\*/|\Z))
    |(?P<string>'(?:[^']|'')*(?:'|\Z))
    |(?P<quoted>"(?:[^"]|"")*(?:"|\Z)|`[^`]*(?:`|\Z))
    |(?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)
    |(?P<word>[^\W\d]\w*)
    |(?P<op><>|!=|<=|>=|==|\|\||::|.)
    """,
    re.VERBOSE | re.DOTALL,
)


def sql_tokens(sql: str) -> list[tuple[str, str]]:
    """(kind, text) tokens without spaces and comments; words and quoted identifiers lowercased and
    unquoted (kind "word" and "quoted"), strings and numbers verbatim."""
    tokens = []
    for match in _TOKEN.finditer(sql):
        kind = match.lastgroup or "op"
        text = match.group()
        if kind in ("space", "comment"):
            continue
        if kind == "word":
            text = text.lower()
        elif kind == "quoted":
            text = text[1:-1] if len(text) >= 2 and text[-1] == text[0] else text[1:]
            text = text.lower()
        tokens.append((kind, text))
    return tokens


def single_statement(sql: str) -> list[tuple[str, str]]:
    """The tokens of `sql` if it is one SELECT or WITH statement (trailing semicolons allowed);
    raises RefusedStatement otherwise."""
    if len(sql) > MAX_SQL_CHARS:
        raise RefusedStatement(f"SQL is longer than {MAX_SQL_CHARS} characters")
    tokens = sql_tokens(sql)
    while tokens and tokens[-1] == ("op", ";"):
        tokens.pop()
    if not tokens:
        raise RefusedStatement("no SQL statement")
    if ("op", ";") in tokens:
        raise RefusedStatement("several statements; only one SELECT or WITH query is run")
    first_word = next((text for kind, text in tokens if kind == "word"), None)
    leading = [text for kind, text in tokens if not (kind == "op" and text == "(")]
    if first_word not in ("select", "with") or leading[0] != first_word:
        keyword = first_word.upper() if first_word else tokens[0][1]
        raise RefusedStatement(f"{keyword} statement refused; only one SELECT or WITH query is run")
    return tokens


def has_top_level_order_by(tokens: list[tuple[str, str]]) -> bool:
    depth = 0
    for (kind, text), (next_kind, next_text) in zip(tokens, tokens[1:] + [("op", "")]):
        if kind == "op" and text == "(":
            depth += 1
        elif kind == "op" and text == ")":
            depth -= 1
        elif depth == 0 and kind == "word" and text == "order" and next_kind == "word" and next_text == "by":
            return True
    return False


def jaccard(a: set, b: set) -> float:
    """|a ∩ b| / |a ∪ b|, and 1.0 when both are empty."""
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def ngrams(tokens: list[tuple[str, str]], max_n: int = 3) -> set[tuple[str, ...]]:
    texts = [text for _, text in tokens]
    return {tuple(texts[i : i + n]) for n in range(1, max_n + 1) for i in range(len(texts) - n + 1)}


def schema_names_used(tokens: list[tuple[str, str]], schema: frozenset[str]) -> set[str]:
    return {text for kind, text in tokens if kind in ("word", "quoted") and text in schema}


# ---------------------------------------------------------------------------------------------
# Values


def normalise_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return value
    if isinstance(value, Decimal):
        value = float(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ("NaN",)
        if math.isinf(value) or not value.is_integer():
            return float(f"{value:.{SIGNIFICANT_DIGITS}g}")
        return int(value)
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (list, tuple)):
        return tuple(normalise_value(item) for item in value)
    if isinstance(value, dict):
        return tuple((key, normalise_value(item)) for key, item in value.items())
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def same_result(predicted: tuple[tuple, ...], gold: tuple[tuple, ...], ordered: bool) -> bool:
    if ordered:
        return predicted == gold
    return Counter(predicted) == Counter(gold)


# ---------------------------------------------------------------------------------------------
# Databases


def _fetch_rows(cursor: Any) -> tuple[tuple, ...]:
    rows: list[tuple] = []
    while True:
        batch = cursor.fetchmany(FETCH_BATCH)
        if not batch:
            return tuple(rows)
        rows.extend(tuple(normalise_value(value) for value in row) for row in batch)
        if len(rows) > MAX_ROWS:
            raise RefusedStatement(f"result has more than {MAX_ROWS} rows")


def _sqlite_authorizer(action: int, *_: Any) -> int:
    return sqlite3.SQLITE_OK if action in _SQLITE_ALLOWED_ACTIONS else sqlite3.SQLITE_DENY


def _sqlite_connect(path: str) -> sqlite3.Connection:
    uri = Path(path).resolve().as_uri() + "?mode=ro"
    return sqlite3.connect(uri, uri=True)


def _run_sqlite(path: str, sql: str, timeout_s: float) -> tuple[tuple, ...]:
    connection = _sqlite_connect(path)
    try:
        deadline = time.monotonic() + timeout_s
        connection.set_progress_handler(lambda: int(time.monotonic() > deadline), SQLITE_PROGRESS_STEPS)
        connection.set_authorizer(_sqlite_authorizer)
        try:
            return _fetch_rows(connection.execute(sql))
        except sqlite3.DatabaseError as exc:
            if str(exc) == "interrupted" and time.monotonic() > deadline:
                raise StatementTimeout(f"stopped after {timeout_s:g} s") from exc
            if str(exc) == "not authorized":
                raise RefusedStatement("the statement needs more than read access") from exc
            raise
    finally:
        connection.close()


def _duckdb_connect(path: str) -> Any:
    import duckdb

    connection = duckdb.connect(path, read_only=True, config=dict(DUCKDB_CONFIG))  # type: ignore[arg-type]
    for setting in DUCKDB_SESSION_SETTINGS:
        connection.execute(setting)
    return connection


def _run_duckdb(path: str, sql: str, timeout_s: float) -> tuple[tuple, ...]:
    import duckdb

    connection = _duckdb_connect(path)

    def interrupt() -> None:
        try:
            connection.interrupt()
        except Exception:
            pass  # the statement finished and the connection is closing: nothing left to stop

    timer = threading.Timer(timeout_s, interrupt)
    try:
        statements = connection.extract_statements(sql)
        if len(statements) != 1 or statements[0].type != duckdb.StatementType.SELECT:
            raise RefusedStatement("DuckDB does not parse it as one SELECT statement")
        timer.start()
        try:
            return _fetch_rows(connection.execute(sql))
        except duckdb.InterruptException as exc:
            raise StatementTimeout(f"stopped after {timeout_s:g} s") from exc
    finally:
        timer.cancel()
        if timer.is_alive():
            timer.join()
        connection.close()


def run_query(dialect: str, path: str, sql: str, timeout_s: float) -> tuple[tuple, ...]:
    """Normalised rows of one read-only query; raises StatementTimeout, RefusedStatement or the
    database's own exception."""
    if dialect == "duckdb":
        return _run_duckdb(path, sql, timeout_s)
    return _run_sqlite(path, sql, timeout_s)


def _file_identity(path: str) -> tuple[str, int, int]:
    stat = os.stat(path)
    return os.path.realpath(path), stat.st_mtime_ns, stat.st_size


@lru_cache(maxsize=64)
def _schema_names_cached(dialect: str, identity: tuple[str, int, int]) -> frozenset[str]:
    path = identity[0]
    if dialect == "duckdb":
        connection = _duckdb_connect(path)
        try:
            pairs = connection.execute("SELECT table_name, column_name FROM information_schema.columns").fetchall()
        finally:
            connection.close()
    else:
        connection = _sqlite_connect(path)
        try:
            tables = [
                row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")
            ]
            pairs = [
                (table, row[1])
                for table in tables
                for row in connection.execute("SELECT * FROM pragma_table_info(?)", (table,))
            ]
        finally:
            connection.close()
    return frozenset(name.lower() for pair in pairs for name in pair)


def schema_names(dialect: str, path: str) -> frozenset[str]:
    """Lowercased table and column names of the database (cached per file version)."""
    return _schema_names_cached(dialect, _file_identity(path))


@lru_cache(maxsize=256)
def _gold_rows_cached(dialect: str, identity: tuple[str, int, int], sql: str, timeout_s: float) -> tuple[tuple, ...]:
    return run_query(dialect, identity[0], sql, timeout_s)


# ---------------------------------------------------------------------------------------------
# The verifier


def _reference_dict(reference: Any) -> dict | None:
    if isinstance(reference, str):
        try:
            reference = json.loads(reference)
        except (ValueError, RecursionError):
            return None
    return reference if isinstance(reference, dict) else None


def _short(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


class SqlVerifier(Verifier):
    name = "sql"
    domain = "sql"
    version = "1"

    rewrite_templates: ClassVar[Mapping[str, str]] = {
        "simplify": (
            "Rewrite this database question so it is easier to turn into SQL: short sentences, every condition "
            "stated explicitly, nothing added. The same tables, columns and result must answer it. Do not write "
            "SQL and do not give the result.\nQuestion: {question}\nReference query: {answer}\nRewritten question:"
        ),
        "diversify": (
            "Reword this database question: other words and sentence order, the same tables, columns, "
            "conditions and result. Do not write SQL.\nQuestion: {question}\nReference query: {answer}\n"
            "Reworded question:"
        ),
    }

    def score(self, response: str, reference: Any) -> Score:
        ref = _reference_dict(reference)
        if ref is None:
            return Score(0.0, "error", reason='sql reference must be {"db": PATH, "sql": GOLD_SQL} or its JSON string')
        db, gold_sql = ref.get("db"), ref.get("sql")
        if not isinstance(db, str) or not db or not isinstance(gold_sql, str) or not gold_sql.strip():
            return Score(0.0, "error", reason='sql reference needs a "db" path and a non-empty "sql" string')
        dialect = ref.get("dialect", DIALECT_BY_SUFFIX.get(Path(db).suffix.lower()))
        if dialect not in ("sqlite", "duckdb"):
            return Score(
                0.0, "error", reason=f'cannot tell the dialect of {db!r}: give "dialect": "sqlite" or "duckdb"'
            )
        timeout_s = ref.get("timeout_s", STATEMENT_TIMEOUT_S)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 600:
            return Score(0.0, "error", reason="timeout_s must be a number of seconds in (0, 600]")
        if (problem := non_text_error(response)) is not None:
            return problem

        predicted_sql = extract_sql(response)
        if not predicted_sql:
            zeros = {"execution": 0.0, "syntax": 0.0, "schema_linking": 0.0, "ngram": 0.0}
            return Score(0.0, "unparseable", zeros, reason="no SQL in the response")
        if not os.path.isfile(db):
            return Score(0.0, "error", extracted=predicted_sql[:2000], reason=f"database file {db!r} not found")

        try:
            gold_tokens = single_statement(gold_sql)
        except RefusedStatement as exc:
            return Score(0.0, "error", extracted=predicted_sql[:2000], reason=f"gold SQL refused: {exc}")
        ordered = ref.get("ordered", has_top_level_order_by(gold_tokens))
        if not isinstance(ordered, bool):
            return Score(0.0, "error", extracted=predicted_sql[:2000], reason='"ordered" must be true or false')
        try:
            identity = _file_identity(db)
            schema = _schema_names_cached(dialect, identity)
            gold_rows = _gold_rows_cached(dialect, identity, gold_sql, float(timeout_s))
        except StatementTimeout as exc:
            return Score(0.0, "timeout", extracted=predicted_sql[:2000], reason=f"gold SQL timed out: {exc}")
        except Exception as exc:
            return Score(0.0, "error", extracted=predicted_sql[:2000], reason=f"gold SQL failed: {_short(exc)}")

        return self._score_prediction(
            predicted_sql, gold_tokens, gold_rows, schema, ordered, dialect, db, float(timeout_s)
        )

    def reference_error(self, reference: Any) -> str | None:
        """The gold query, given as the response, must match its own result: running it on its database
        catches a missing file and a refused, failing or timed-out gold query."""
        if is_missing(reference):
            return MISSING_REFERENCE
        ref = _reference_dict(reference)
        gold_sql = ref.get("sql") if ref is not None else None
        return self_check_error(self, gold_sql if isinstance(gold_sql, str) else "", reference)

    @staticmethod
    def _score_prediction(
        predicted_sql: str,
        gold_tokens: list[tuple[str, str]],
        gold_rows: tuple[tuple, ...],
        schema: frozenset[str],
        ordered: bool,
        dialect: str,
        db: str,
        timeout_s: float,
    ) -> Score:
        extracted = predicted_sql[:2000]
        try:
            predicted_tokens = single_statement(predicted_sql)
        except RefusedStatement as exc:
            predicted_tokens = sql_tokens(predicted_sql[:MAX_SQL_CHARS])
            components = _components(0.0, 0.0, predicted_tokens, gold_tokens, schema)
            return Score(0.0, "wrong", components, extracted, f"not run: {exc}")
        try:
            predicted_rows = run_query(dialect, db, predicted_sql, timeout_s)
        except StatementTimeout as exc:
            components = _components(0.0, 0.0, predicted_tokens, gold_tokens, schema)
            return Score(0.0, "timeout", components, extracted, f"predicted SQL timed out: {exc}")
        except RefusedStatement as exc:
            components = _components(0.0, 0.0, predicted_tokens, gold_tokens, schema)
            return Score(0.0, "wrong", components, extracted, f"not run: {exc}")
        except Exception as exc:
            components = _components(0.0, 0.0, predicted_tokens, gold_tokens, schema)
            return Score(
                _partial_credit(components), "wrong", components, extracted, f"predicted SQL failed: {_short(exc)}"
            )
        if same_result(predicted_rows, gold_rows, ordered):
            components = _components(1.0, 1.0, predicted_tokens, gold_tokens, schema)
            return Score(
                1.0, "ok", components, extracted, "same result set" + (" in the same order" if ordered else "")
            )
        components = _components(0.0, 1.0, predicted_tokens, gold_tokens, schema)
        reason = f"different result: {len(predicted_rows)} rows vs {len(gold_rows)} gold rows" + (
            " (ordered)" if ordered else ""
        )
        return Score(_partial_credit(components), "wrong", components, extracted, reason)


def _components(
    execution: float,
    syntax: float,
    predicted_tokens: list[tuple[str, str]],
    gold_tokens: list[tuple[str, str]],
    schema: frozenset[str],
) -> dict[str, float]:
    return {
        "execution": execution,
        "syntax": syntax,
        "schema_linking": jaccard(schema_names_used(predicted_tokens, schema), schema_names_used(gold_tokens, schema)),
        "ngram": jaccard(ngrams(predicted_tokens), ngrams(gold_tokens)),
    }


def _partial_credit(components: dict[str, float]) -> float:
    return (
        WEIGHT_SYNTAX * components["syntax"]
        + WEIGHT_SCHEMA * components["schema_linking"]
        + WEIGHT_NGRAM * components["ngram"]
    )
