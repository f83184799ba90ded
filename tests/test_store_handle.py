"""One store handle per process: `open_store` hands out the same object, a whole `rlvr run` builds one, and a
step's batch belongs to the thread that opened it."""

from __future__ import annotations

import os
import threading

import pytest
from typer.testing import CliRunner

from rlvr.storage.store import Store, open_store
from tests.conftest import TINY_OVERRIDES


@pytest.fixture
def constructions(monkeypatch) -> list[str]:
    """The root of every Store built in this process while the test runs."""
    built: list[str] = []
    original = Store.__init__

    def counting(self: Store, root: str) -> None:
        built.append(root)
        original(self, root)

    monkeypatch.setattr(Store, "__init__", counting)
    return built


def test_open_store_is_one_handle_per_root(tmp_path, constructions):
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    assert open_store(first, create=True) is open_store(first)
    assert open_store(second, create=True) is not open_store(first)
    assert constructions == [first, second]


def test_open_store_refuses_a_missing_store_without_create(tmp_path, constructions):
    from rlvr.storage.errors import StoreNotFound

    with pytest.raises(StoreNotFound, match="no store at"):
        open_store(str(tmp_path / "typo"))
    assert not (tmp_path / "typo").exists()
    assert open_store(str(tmp_path / "typo"), create=True).exists("nothing") is False


def test_a_batch_belongs_to_the_thread_that_opened_it(tmp_path):
    """The heartbeat thread writes the run record while the main thread holds a step's batch open: the record
    is durable at once and the batch holds only what the main thread wrote."""
    store = open_store(str(tmp_path / "s"), create=True)
    seen: dict[str, object] = {}

    def beat() -> None:
        seen["batch"] = store._batch
        store.write_run({"run_id": "r", "status": "running"})

    with store.batch():
        opened = store._batch
        helper = threading.Thread(target=beat)
        helper.start()
        helper.join()
        assert seen["batch"] is None
        assert opened is not None and opened.written == []
        assert os.path.exists(store.path("runs", "r.json"))
    assert store._batch is None


@pytest.mark.slow
def test_rlvr_run_builds_one_store_handle(tmp_path, prefect_api, constructions):
    """A whole run (synthesis, warm start, difficulty, RL steps, evaluation, checkpoints, the run record's
    heartbeat and the summary) goes through one Store object in this process."""
    from rlvr.flows.cli import app

    root = str(tmp_path / "store")
    sets = [arg for item in [*TINY_OVERRIDES, "train.steps=2", "evaluate.every=2"] for arg in ("--set", item)]
    result = CliRunner().invoke(app, ["run", "--store", root, "--run-id", "one", *sets])
    assert result.exit_code == 0, result.output
    assert constructions == [root]
    assert open_store(root).read_run("one")["status"] == "completed"
