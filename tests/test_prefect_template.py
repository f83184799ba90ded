"""The migrated Prefect database new stores start from (flows/prefect_template.py): `make venv` writes it, a new
Prefect home gets a whole copy of it once, and a home that has a database keeps its own."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rlvr.flows.prefect_template import make_template, seed_database, template_path
from tests.cli_helpers import cli_env


@pytest.fixture
def template(tmp_path: Path) -> Path:
    """A small SQLite file standing in for the template (its bytes are what must arrive)."""
    path = tmp_path / "template.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE alembic_version (version_num TEXT)")
        db.execute("INSERT INTO alembic_version VALUES ('head')")
    return path


def test_a_new_home_gets_a_whole_copy_and_an_existing_database_is_kept(tmp_path, template):
    target = tmp_path / "home" / "prefect.db"
    assert seed_database(target, template) is True
    assert target.read_bytes() == template.read_bytes()
    target.write_bytes(b"a live database")
    assert seed_database(target, template) is False
    assert target.read_bytes() == b"a live database"
    assert seed_database(tmp_path / "other" / "prefect.db", tmp_path / "no-template.db") is False
    assert not (tmp_path / "other" / "prefect.db").exists()
    assert sorted(p.name for p in target.parent.iterdir()) == ["prefect.db"]  # no partial copy left


def test_a_database_named_by_the_environment_gets_no_copy(tmp_path, template, monkeypatch):
    monkeypatch.setenv("PREFECT_SERVER_DATABASE_CONNECTION_URL", "postgresql+asyncpg://prefect@db/prefect")
    assert seed_database(tmp_path / "home" / "prefect.db", template) is False
    assert not (tmp_path / "home").exists()


def test_runs_starting_together_on_a_new_store_see_one_database(tmp_path, template):
    target = tmp_path / "home" / "prefect.db"
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(seed_database(target, template))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * 7 + [True]
    assert target.read_bytes() == template.read_bytes()
    assert sorted(p.name for p in target.parent.iterdir()) == ["prefect.db"]


def test_make_template_refuses_a_process_that_imported_prefect(tmp_path):
    import prefect  # noqa: F401  (this process has: its settings are read already)

    with pytest.raises(RuntimeError, match=r"^make_template must run before Prefect is imported"):
        make_template(tmp_path / "t.db")
    assert not (tmp_path / "t.db").exists()


def test_make_venvs_template_is_prefects_schema_at_its_newest_migration():
    """`make venv` migrated the template with Prefect's own migrations: Alembic's head revision, Prefect's tables."""
    path = template_path()
    if not path.is_file() and not os.environ.get("CI"):
        pytest.skip(f"no template at {path}: `make venv` writes it")
    import prefect.server.database
    from alembic.script import ScriptDirectory

    migrations = Path(prefect.server.database.__file__).parent / "_migrations"  # SQLite's are a folder of their own
    head = ScriptDirectory(
        str(migrations), version_locations=[str(migrations / "versions" / "sqlite")]
    ).get_current_head()
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        assert db.execute("SELECT version_num FROM alembic_version").fetchall() == [(head,)]
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert {"flow_run", "task_run", "deployment"} <= tables
        assert db.execute("SELECT count(*) FROM flow_run").fetchone() == (0,)


def test_a_new_stores_prefect_home_starts_from_the_template_unless_a_server_is_named(tmp_path):
    """configure_prefect, as `rlvr run` calls it in a fresh process: the store's database is the template's copy;
    with PREFECT_API_URL set (a real server) the store gets no database."""
    path = template_path()
    if not path.is_file() and not os.environ.get("CI"):
        pytest.skip(f"no template at {path}: `make venv` writes it")
    script = (
        "import sys\n"
        "from rlvr.flows.prefect_env import configure_prefect\n"
        "from rlvr.storage.store import Store\n"
        "configure_prefect(Store.open(sys.argv[1], create=True))\n"
    )
    env = {k: v for k, v in cli_env().items() if not k.startswith("PREFECT_")}
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "new")], env=env, check=True, timeout=60)
    assert (tmp_path / "new" / "_prefect" / "prefect.db").read_bytes() == path.read_bytes()
    env["PREFECT_API_URL"] = "http://127.0.0.1:9/api"
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "served")], env=env, check=True, timeout=60)
    assert not (tmp_path / "served" / "_prefect" / "prefect.db").exists()
