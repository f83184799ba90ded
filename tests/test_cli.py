"""The command line: expected failures are one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import json

import pytest

from rlvr.storage.store import Store
from tests.cli_helpers import rlvr


def assert_one_line_error(result, fragment: str) -> None:
    assert result.returncode != 0, result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr
    assert len(lines) == 1, result.stderr
    assert fragment in lines[0]


@pytest.fixture
def empty_store(tmp_path) -> str:
    root = str(tmp_path / "store")
    Store.open(root, create=True)
    return root


def test_unknown_config_key(tmp_path):
    result = rlvr("run", "--store", str(tmp_path / "s"), "--set", "trian.steps=1")
    assert_one_line_error(result, "unknown config key 'trian'")


def test_wrong_config_type(tmp_path):
    result = rlvr("run", "--store", str(tmp_path / "s"), "--set", "train.steps=lots")
    assert_one_line_error(result, "config key 'train.steps': Input should be a valid integer")


def test_missing_config_file(tmp_path):
    result = rlvr("run", "--store", str(tmp_path / "s"), "--config", str(tmp_path / "none.yaml"))
    assert_one_line_error(result, "does not exist")


def test_missing_store(tmp_path):
    result = rlvr("query", "SELECT 1", "--store", str(tmp_path / "absent"))
    assert_one_line_error(result, "no store at")


def test_unknown_run_id(empty_store):
    result = rlvr("resume", "no-such-run", "--store", empty_store)
    assert_one_line_error(result, "unknown run id 'no-such-run'")


def test_bad_sql_and_unknown_lineage_id(empty_store):
    assert_one_line_error(rlvr("query", "SELECT * FROM nowhere", "--store", empty_store), "query failed")
    assert_one_line_error(rlvr("lineage", "nothing-here", "--store", empty_store), "nothing-here")


def test_query_formats_on_empty_views(empty_store):
    result = rlvr("query", "SELECT count(*) AS n FROM rollouts", "--store", empty_store, "--format", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip()) == {"n": 0}
    result = rlvr("query", "SELECT 1 AS a, 'x' AS b", "--store", empty_store, "--format", "csv")
    assert result.stdout.splitlines() == ["a,b", "1,x"]
