"""Group commits (`Store.batch`): one RL step's artifacts become visible together, after their data is durable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pyarrow as pa
import pytest

from rlvr.storage.store import Store


def write(store: Store, aid: str, kind: str = "test_rows") -> None:
    store.write_artifact(
        kind, aid, pa.table({"x": [1, 2]}), run_id="r", stage="s", parents=[], code_version="1", config={}
    )


def on_disk(store: Store, aid: str) -> bool:
    return os.path.exists(store.manifest_path(aid))


def hold_commits(monkeypatch) -> threading.Event:
    """Make background commits wait until the returned event is set."""
    release = threading.Event()
    flush = Store._flush

    def slow_flush(self, batch):
        release.wait(10)
        flush(self, batch)

    monkeypatch.setattr(Store, "_flush", slow_flush)
    return release


def test_manifests_wait_for_the_end_of_the_batch(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    with store.batch():
        write(store, "a-1")
        write(store, "b-1")
        assert store.exists("a-1") and store.exists("b-1")  # this process sees them already
        assert not on_disk(store, "a-1") and not on_disk(store, "b-1")
        assert Store.open(store.root).exists("a-1") is False  # nobody else does
        assert store.read_table("a-1").column("x").to_pylist() == [1, 2]
    assert on_disk(store, "a-1") and on_disk(store, "b-1")
    assert [m.artifact_id for m in Store.open(store.root).manifests()] == ["a-1", "b-1"]


def test_deletes_wait_for_the_batch_commit(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    write(store, "old-1")
    with store.batch():
        write(store, "new-1")
        store.delete_artifact("old-1")
        assert on_disk(store, "old-1")  # still there until the new one is committed
    assert not on_disk(store, "old-1") and on_disk(store, "new-1")


def test_an_exception_inside_commits_what_was_finished(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    with pytest.raises(RuntimeError), store.batch():
        write(store, "done-1")
        raise RuntimeError("the next stage failed")
    assert on_disk(store, "done-1")


def test_nested_batches_join_the_outer_one(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    with store.batch():
        with store.batch():
            write(store, "inner-1")
        assert not on_disk(store, "inner-1")
    assert on_disk(store, "inner-1")


def test_a_kill_inside_a_batch_leaves_nothing_committed(tmp_path):
    root = str(tmp_path / "s")
    Store.open(root, create=True)
    script = textwrap.dedent(f"""
        import os
        import pyarrow as pa
        from rlvr.storage.store import Store
        store = Store.open({root!r})
        with store.batch():
            for aid in ("a-1", "b-1"):
                store.write_artifact("test_rows", aid, pa.table({{"x": [1]}}), run_id="r", stage="s", parents=[],
                                     code_version="1", config={{}})
            os._exit(9)  # killed before the batch commits
    """)
    assert subprocess.run([sys.executable, "-c", script]).returncode == 9
    store = Store.open(root)
    assert store.manifests() == [] and not store.exists("a-1")
    assert store.cleanup_run("someone-else") == []  # only the run's owner removes its folders
    leftovers = store.cleanup_run("r")
    assert any("a-1" in path for path in leftovers) and any("b-1" in path for path in leftovers)
    assert not os.path.exists(os.path.join(root, "artifacts", "test_rows", "a-1"))


def test_background_batches_commit_in_order_and_before_anything_else(tmp_path, monkeypatch):
    store = Store.open(str(tmp_path / "s"), create=True)
    release = hold_commits(monkeypatch)
    with store.batch(background=True):
        write(store, "step1-1")
    with store.batch(background=True):
        write(store, "step2-1")
    assert store.exists("step1-1") and store.exists("step2-1")  # this process already sees them
    assert not on_disk(store, "step1-1") and not on_disk(store, "step2-1")
    release.set()
    write(store, "after-1")  # a commit outside a batch waits for the batches ahead of it
    order = [
        m.artifact_id
        for m in sorted(
            Store.open(store.root).manifests(), key=lambda m: os.path.getmtime(store.manifest_path(m.artifact_id))
        )
    ]
    assert order == ["step1-1", "step2-1", "after-1"]


def test_a_failed_background_commit_is_raised_by_the_next_wait(tmp_path, monkeypatch):
    store = Store.open(str(tmp_path / "s"), create=True)

    def broken_sync(self, paths):
        raise OSError("disk full")

    monkeypatch.setattr(Store, "_sync", broken_sync)
    with store.batch(background=True):
        write(store, "a-1")
    with pytest.raises(OSError, match="disk full"):
        store.wait()


def test_background_batches_write_data_on_the_committer_and_readers_never_see_a_missing_file(tmp_path, monkeypatch):
    """In a background batch a single-part artifact's Parquet is written by the committer thread; a reader
    in this process that needs it first (manifest, read_table, read_file) writes it itself, once."""
    store = Store.open(str(tmp_path / "s"), create=True)
    release = hold_commits(monkeypatch)
    data_file = os.path.join(store.artifact_dir("test_rows", "late-1"), "part-00000.parquet")
    with store.batch(background=True):
        write(store, "late-1")
        write(store, "read-1")
        store.write_artifact(
            "test_rows",
            "blob-1",
            pa.table({"x": [3]}),
            run_id="r",
            stage="s",
            parents=[],
            code_version="1",
            config={},
            files={"w.bin": b"weights"},
        )
        assert not os.path.exists(data_file)  # not written yet: nobody needed it
        assert store.read_table("read-1").column("x").to_pylist() == [1, 2]  # written on demand
    assert store.read_file("blob-1", "w.bin") == b"weights"  # its batch is still waiting to commit
    assert not os.path.exists(data_file) and not on_disk(store, "late-1")
    release.set()
    store.wait()
    assert os.path.exists(data_file)
    reopened = Store.open(store.root)
    for aid, rows in (("late-1", [1, 2]), ("read-1", [1, 2]), ("blob-1", [3])):
        manifest = reopened.manifest(aid)
        assert [f["path"] for f in manifest.table_files] == ["part-00000.parquet"]
        assert reopened.read_table(aid).column("x").to_pylist() == rows
        assert store.manifest(aid) == manifest  # the file-less manifest was replaced everywhere
    assert reopened.read_file("blob-1", "w.bin") == b"weights"
