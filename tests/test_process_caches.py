"""Every process-wide cache either holds under another task runner (each worker is its own process) or
is explicitly per-process: a worker that never saw what another cached gets the same answer from the store.
The list and the reasons are in docs/architecture.md ("Process-wide caches")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pyarrow as pa

from rlvr.storage.stage import RESIDENTS, TableCache, prune_transient, run_stage
from rlvr.storage.store import Store
from rlvr.tasks.initialize import INITIALIZE
from rlvr.trainer.checkpoints import load_policy
from rlvr.trainer.devices import CPU
from rlvr.trainer.policy import PolicyConfig, weights_bytes
from rlvr.verifiers.base import Score
from rlvr.verifiers.cache import RewardCache, cache_key, score_to_entry, stage_entries


def test_table_cache_reads_what_another_process_committed(tmp_path):
    root = str(tmp_path / "s")
    writer, reader = Store.open(root, create=True), Store.open(root)
    cache = TableCache(max_bytes=10_000)
    writer.write_artifact(
        "test_rows", "t-1", pa.table({"x": [1, 2, 3]}), run_id="r", stage="s", parents=[], code_version="1", config={}
    )
    assert cache.get(reader, "t-1").column("x").to_pylist() == [1, 2, 3]  # a miss reads the store
    assert cache.get(reader, "t-1") is cache.get(reader, "t-1")  # then memory: ids never change content
    for i in range(20):  # past max_bytes the oldest go first; a later get simply reads again
        writer.write_artifact(
            "test_rows",
            f"t-big-{i}",
            pa.table({"x": list(range(200))}),
            run_id="r",
            stage="s",
            parents=[],
            code_version="1",
            config={},
        )
        cache.get(reader, f"t-big-{i}")
    assert cache.get(reader, "t-1").column("x").to_pylist() == [1, 2, 3]


def test_a_resident_model_equals_the_one_loaded_from_the_store(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    done = run_stage(store, INITIALIZE, PolicyConfig(), run_id="r", seed=3, step=0, params={"seed": 3})
    resident = load_policy(store, done.id, device=CPU)  # the object kept by this process after the commit
    RESIDENTS.clear()  # what another worker sees
    loaded = load_policy(store, done.id, device=CPU)
    assert loaded is not resident
    assert weights_bytes(loaded.model) == weights_bytes(resident.model)


def commit_cache_entries(store, entries):
    """What a label stage commits beside its rewards: a `reward_cache` artifact of `entries`."""
    store.write_artifact(
        "reward_cache",
        "reward_cache-1",
        pa.Table.from_pylist(entries),
        run_id="r",
        stage="label",
        parents=[],
        code_version="1",
        config={},
    )


def test_reward_cache_entries_reach_other_processes_through_the_store(tmp_path):
    root = str(tmp_path / "s")
    key = cache_key("arithmetic", "1", "7", "7")
    mine, theirs = RewardCache(Store.open(root, create=True)), RewardCache(Store.open(root))
    assert theirs.lookup([key]) == [None]
    mine.remember(key, Score(1.0, "ok"))
    commit_cache_entries(mine.store, [score_to_entry(key, Score(1.0, "ok"))])
    assert theirs.lookup([key])[0].status == "ok"  # refreshed from the committed artifact


def test_a_stage_commits_its_hits_on_verdicts_only_this_process_holds(tmp_path):
    """A difficulty shard's verdicts live in the process's cache only (that stage writes no cache artifact): the
    label stage that hits them commits them, so another process (`rlvr relabel`, a resume) finds them too."""
    root = str(tmp_path / "s")
    cache = RewardCache(Store.open(root, create=True))
    stored, shards, fresh = (cache_key("arithmetic", "1", answer, "7") for answer in ("7", "8", "9"))
    commit_cache_entries(cache.store, [score_to_entry(stored, Score(1.0, "ok"))])
    cache.add_entries([score_to_entry(shards, Score(0.0, "wrong"))])  # a difficulty shard's, in this process
    assert cache.lookup([stored, shards, fresh])[:2] == [Score(1.0, "ok"), Score(0.0, "wrong")]
    assert (cache.unstored(stored), cache.unstored(shards), cache.unstored(fresh)) == (False, True, False)
    scores = [Score(1.0, "ok"), Score(0.0, "wrong"), Score(0.0, "wrong")]
    committed = stage_entries(cache, [stored, shards, fresh], scores, hits=[True, True, False])
    assert [e["response_hash"] for e in committed] == [shards[2], fresh[2]]  # not the stored one again


def test_a_fresh_process_prunes_every_stale_transient_artifact(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    for i in range(3):  # e.g. left by crashes between a commit and the delete that follows it
        row = {"run_id": "r", "step": i, "optimizer_steps": 2 * i, "n_params": 10}
        store.write_artifact(
            "train_state",
            f"train_state-{i}",
            pa.Table.from_pylist([row]),
            run_id="r",
            stage="train",
            parents=[],
            code_version="1",
            config={},
        )
    assert prune_transient(store, "train_state", "r", keep="train_state-2") == ["train_state-0", "train_state-1"]
    assert [m.artifact_id for m in store.manifests(kind="train_state")] == ["train_state-2"]


def test_a_strategy_plugin_registers_in_every_process_through_its_entry_point(tmp_path):
    """A strategy registered only in one process is unknown to the others; an entry point makes every
    process (a Dask or Ray worker, a resumed run) import and register it."""
    package = tmp_path / "toyplug"
    package.mkdir()
    (package / "__init__.py").write_text(
        textwrap.dedent("""
        from typing import Literal
        from rlvr.curricula.registry import STRATEGIES
        from rlvr.curricula.uniform import UniformConfig, UniformStrategy

        class EveryOtherConfig(UniformConfig):
            type: Literal["every_other"] = "every_other"

        class EveryOther(UniformStrategy):
            type = "every_other"

        STRATEGIES.register(EveryOtherConfig, EveryOther)
    """)
    )
    dist_info = tmp_path / "toyplug-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyplug\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[rlvr.strategies]\nevery_other = toyplug\n")
    script = (
        "from rlvr.flows.config import load_config; print(load_config(None, ['select.type=every_other']).select.type)"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "every_other"
    alone = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert alone.returncode != 0 and "unknown select.type 'every_other'" in alone.stderr
