"""Embedded Prefect: nothing to start by hand, nothing written to the home directory.

Prefect reads its settings when it is imported, so `configure_prefect` must run before any module
that imports prefect. With no PREFECT_API_URL, Prefect starts a temporary local server on SQLite
in-process; its home (database, results) lives inside the store, or in a temp dir of its own when the
store is not on the local disk (s3://...). A PREFECT_API_URL already set (a real server) is left alone.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import sys
import tempfile
from pathlib import Path

from rlvr.child_guard import guard_prefect_server
from rlvr.errors import UserError
from rlvr.flows.prefect_template import DATABASE_NAME, seed_database
from rlvr.storage.store import Store


def configure_prefect(store: Store) -> Path:
    """Point Prefect's and Hugging Face's homes inside the store (or a temp dir); return Prefect's home.

    Prefect creates its home when it is imported, so a local store's folder is made here.
    """
    guard_prefect_server()  # the temporary server dies with this process, even by SIGKILL
    if store.local_root is not None:
        home = Path(store.local_root) / "_prefect"
    else:
        home = remote_store_home(store.root) / "_prefect"
    home.mkdir(parents=True, exist_ok=True)
    if "prefect" in sys.modules and os.environ.get("PREFECT_HOME") not in (None, str(home)):
        return Path(os.environ["PREFECT_HOME"])  # already configured (tests, a host application)
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(home / "results"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_UI_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    # The temporary server's own errors (its database on a full disk, ...) would flood the terminal; the run
    # meets the same failure itself and reports it once.
    os.environ.setdefault("PREFECT_LOGGING_SERVER_LEVEL", "CRITICAL")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    os.environ.setdefault("HF_HOME", str(home.parent / "_hf"))
    if not os.environ.get("PREFECT_API_URL"):
        if (problem := prefect_database_problem(store)) is not None:
            raise UserError(problem)  # else Prefect's temporary server hangs on it, then times out
        seed_database(home / DATABASE_NAME)  # a new store's database starts migrated (prefect_template.py)
    return home


def remote_store_home(root: str) -> Path:
    """A local folder for what a store on object storage cannot hold (Prefect's SQLite database, HF's
    cache): one per store and user, as `<store>/_prefect` is for a local store, so two runs on two
    buckets never share a database and two users never share a folder."""
    digest = hashlib.sha256(root.rstrip("/").encode("utf-8")).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"rlvr-{os.getuid()}" / digest


SQLITE_HEADER = b"SQLite format 3\x00"
QUICK_CHECK_MAX_BYTES = 256 << 20  # past that, a full quick_check costs seconds: check the header and schema only


def prefect_database_problem(store: Store) -> str | None:
    """One line naming the store's Prefect database when SQLite cannot use it (a damaged file), else None.

    The database holds only Prefect's history of flow and task runs; the store never depends on it, so
    moving it away loses nothing a run needs.
    """
    base = Path(store.local_root) if store.local_root is not None else remote_store_home(store.root)
    path = base / "_prefect" / DATABASE_NAME
    if not path.is_file() or path.stat().st_size == 0:
        return None
    try:
        with path.open("rb") as handle:
            if handle.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
                raise sqlite3.DatabaseError("file is not a database")
        connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            connection.execute("SELECT count(*) FROM sqlite_master").fetchall()
            if path.stat().st_size <= QUICK_CHECK_MAX_BYTES:
                verdict = connection.execute("PRAGMA quick_check").fetchone()[0]
                if verdict != "ok":
                    raise sqlite3.DatabaseError(str(verdict))
        finally:
            connection.close()
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc):
            return None  # a live run writes it right now: it is a database
        return _damaged(path, exc)
    except sqlite3.DatabaseError as exc:
        return _damaged(path, exc)
    return None


def _damaged(path: Path, exc: Exception) -> str:
    return (
        f"Prefect's database {path} is damaged ({exc}); it holds only Prefect's run history, which no run "
        f"needs: move it away (mv {path} {path}.damaged) and run the command again"
    )


class _OnlyWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


def quiet_run_failure_logs() -> None:
    """Keep Prefect's task and flow run loggers to warnings. They log every failure with its traceback, and
    the CLI shows the same failure once more (one line when expected, the traceback when a bug), while the
    run record and Prefect's database keep it. Call after Prefect is imported (its logging set-up)."""
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OnlyWarnings) for f in logger.filters):
            logger.addFilter(_OnlyWarnings())
