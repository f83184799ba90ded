"""A migrated, empty Prefect database that a store's new one starts from.

Prefect's server migrates a new SQLite database before it answers: about 5.5 CPU-seconds of Alembic
migrations, paid by every store's first run, every `rlvr ui` on a new store and every test server. `make venv`
migrates one database once, into the venv (`python -m rlvr.flows.prefect_template`), and a Prefect home with no
database yet gets a copy of it (`seed_database`); the server then finds its migrations done. Without a template
for the installed Prefect (an install not made by `make`, another Prefect version) nothing changes: Prefect
migrates as it always did.

Nothing here imports Prefect except `make_template`, which runs in a process of its own (this module's main).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import shutil
import sqlite3
import sys
import tempfile
import threading
from pathlib import Path

DATABASE_NAME = "prefect.db"  # the file Prefect's default connection URL names in PREFECT_HOME


def template_path() -> Path:
    """Where `make venv` puts the template for the installed Prefect: inside the environment, beside its packages."""
    version = importlib.metadata.version("prefect")
    return Path(sys.prefix) / "share" / "rlvr" / f"prefect-{version}.db"


DATABASE_SETTINGS = ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")


def seed_database(path: Path, template: Path | None = None) -> bool:
    """Copy the template to `path` when no database is there yet; True when copied. Nothing is copied when the
    environment names a database of its own (Postgres, say): Prefect would not use the file.

    The copy lands whole or not at all, and never over a database another process made first (a hard link of a
    finished copy: two runs starting on one new store both see one database)."""
    template = template or template_path()
    if path.exists() or not template.is_file() or any(os.environ.get(name) for name in DATABASE_SETTINGS):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.partial")
    try:
        shutil.copyfile(template, partial)
        os.link(partial, path)
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links, or a read-only one: Prefect migrates its own
        return False
    finally:
        partial.unlink(missing_ok=True)
    return True


def make_template(path: Path) -> Path:
    """Migrate a new database with Prefect's own migrations and write it to `path` (replaced whole).

    Prefect reads its settings when imported, so this must run in a process that has not imported it yet."""
    if "prefect" in sys.modules:
        raise RuntimeError("make_template must run before Prefect is imported (python -m rlvr.flows.prefect_template)")
    with tempfile.TemporaryDirectory(prefix="rlvr-prefect-template-") as scratch:
        fresh = Path(scratch) / DATABASE_NAME
        os.environ["PREFECT_HOME"] = scratch
        os.environ["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{fresh}"
        from prefect.server.database import provide_database_interface

        asyncio.run(provide_database_interface().create_db())
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        source, copy = sqlite3.connect(fresh), sqlite3.connect(partial)
        try:
            source.backup(copy)  # one consistent file, whatever Prefect's journal mode left beside it
        finally:
            source.close()
            copy.close()
        os.replace(partial, path)
    return path


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else template_path()
    print(f"Prefect's database, migrated: {make_template(target)}")
