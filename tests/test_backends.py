"""Execution backends (`flow.executor`): the same run on another backend commits the same artifacts.

A short real run (two sources, difficulty in six shards, labelling in chunks of four verifications)
runs once on the default backend (threads: units in place) and once on each other backend, each in its
own store. Every artifact id must match, every artifact's rows must match (timings aside), the final
weights must be byte-identical, and every unit must have run as a task run of the backend's Prefect
task runner. Dask runs on a real LocalCluster with two worker processes (and once on a scheduler the
test started, given by address), processes on Prefect's process pool, Ray on a local Ray instance
with two CPUs (about 25 s and 1.6 GB on two cores; marked `ray` so it can be deselected).
"""

from __future__ import annotations

import json
import pickle
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from rlvr.errors import ConfigError, UserError
from rlvr.flows.config import CONFIG, load_config
from rlvr.flows.executors import (
    RAY_TOKEN_SETTINGS,
    RUNNER_PACKAGES,
    ExecutorConfig,
    FanOut,
    check_runner_package,
    use_executor,
)
from rlvr.storage.store import Store
from rlvr.verifiers.base import Score
from rlvr.verifiers.cache import VerifierConfig, cache_key, reward_cache, score_rollouts, text_hash, version_of

RUN_ID = "backends"
OVERRIDES = [
    "synthesize.sources=[{type: skills, per_category: 5}, {type: arithmetic, name: sums, digits: 1, count: 16}]",
    "warmstart.steps=0",
    "difficulty.k=2",
    "difficulty.shard_size=8",
    "train.steps=2",
    "select.batch_size=4",
    "allocate.n=2",
    "evaluate.every=2",
    "checkpoint.every=2",
    "flow.executor.verify_chunk=4",
]


def run_on(root: Path, executor: str) -> Store:
    from rlvr.flows.runs import execute

    cfg = load_config(None, [f"run_id={RUN_ID}", *OVERRIDES, *executor.split()])
    execute(str(root), cfg)
    return Store.open(str(root))


def rows_of(store: Store, artifact_id: str) -> list[dict[str, Any]]:
    """An artifact's rows; timings and the executor setting aside (neither decides any content)."""
    rows = store.read_table(artifact_id).to_pylist()
    for row in rows:
        row.pop("compute_seconds", None)
        if "turn" in row:  # a turns row: its wall seconds are a timing too
            row.pop("seconds", None)
        if "config_json" in row:
            settings = json.loads(row["config_json"])
            settings["flow"].pop("executor")
            row["config_json"] = settings
    return rows


def outcome(store: Store) -> dict[str, Any]:
    durable = [m for m in store.manifests() if m.kind != "train_state"]
    final = max((m for m in durable if m.kind == "checkpoints"), key=lambda m: m.step or 0)
    return {
        "ids": sorted((m.kind, m.artifact_id) for m in durable),
        "rows": {m.artifact_id: rows_of(store, m.artifact_id) for m in durable},
        "weights": store.read_file(final.artifact_id, "model.safetensors"),
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prefect_api) -> dict[str, Any]:
    """The run on the default backend (threads)."""
    return outcome(run_on(tmp_path_factory.mktemp("threads"), ""))


def assert_same_run(found: dict[str, Any], reference: dict[str, Any]) -> None:
    assert found["ids"] == reference["ids"]
    kinds = {kind for kind, _ in reference["ids"]}
    assert {"problems", "difficulty", "rewards", "reward_cache", "train_steps", "checkpoints"} <= kinds
    for artifact_id, rows in reference["rows"].items():
        assert found["rows"][artifact_id] == rows, artifact_id
    assert found["weights"] == reference["weights"]


def units_ran(since: datetime) -> Counter[str]:
    """Completed unit task runs since `since`, counted by unit function (`difficulty.estimate_shard[3]`)."""
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName, TaskRunFilterStartTime
    from prefect.client.schemas.sorting import TaskRunSort

    runs_filter = TaskRunFilter(name=TaskRunFilterName(like_="["), start_time=TaskRunFilterStartTime(after_=since))
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(task_run_filter=runs_filter, sort=TaskRunSort.EXPECTED_START_TIME_ASC, limit=200)
    return Counter(run.name.split("[")[0] for run in runs if run.state and run.state.is_completed())


def units_expected(found: dict[str, Any]) -> Counter[str]:
    """One unit per source, per difficulty shard (8 problems), per chunk of 4 cache misses of a step."""
    kinds = dict((aid, kind) for kind, aid in found["ids"])
    rows = lambda kind: [found["rows"][aid] for aid, k in kinds.items() if k == kind]  # noqa: E731
    misses = [sum(not r["cache_hit"] for r in step) for step in rows("rewards")]
    return Counter(
        {
            "synthesize.read_source": 2,
            "difficulty.estimate_shard": -(-len(rows("difficulty")[0]) // 8),
            "label.score_chunk": sum(-(-m // 4) for m in misses),
        }
    )


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["dask", "processes"])
def test_local_workers_commit_the_default_runs_artifacts(tmp_path, reference, executor):
    """A Dask LocalCluster, or Prefect's process pool, with two worker processes."""
    since = datetime.now(UTC)
    store = run_on(tmp_path, f"flow.executor.type={executor} flow.executor.workers=2")
    found = outcome(store)
    assert_same_run(found, reference)
    # every unit ran as a task run of the backend's runner: two sources, the shards, chunks of verifications
    expected = units_expected(found)
    assert expected["label.score_chunk"] >= 2
    assert units_ran(since) == expected


@pytest.mark.slow
def test_an_existing_dask_scheduler_runs_the_units(tmp_path, reference):
    """`flow.executor.address`: the units go to the scheduler the user started (here one in this process,
    with a thread worker, to keep the test short; its units share the flow's process)."""
    from distributed import LocalCluster

    since = datetime.now(UTC)
    with LocalCluster(n_workers=1, processes=False, threads_per_worker=1, dashboard_address=None) as cluster:
        store = run_on(tmp_path, f"flow.executor.type=dask flow.executor.address={cluster.scheduler_address}")
        assert len(cluster.scheduler.workers) == 1  # the run did not close the user's cluster
    found = outcome(store)
    assert_same_run(found, reference)
    assert units_ran(since) == units_expected(found)


@pytest.mark.slow
@pytest.mark.ray
def test_local_ray_commits_the_default_runs_artifacts(tmp_path, reference, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in RAY_TOKEN_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    since = datetime.now(UTC)
    store = run_on(tmp_path / "store", "flow.executor.type=ray flow.executor.workers=2")
    found = outcome(store)
    assert_same_run(found, reference)
    assert units_ran(since) == units_expected(found)
    assert not (home / ".ray").exists()  # Ray saves a generated auth token there unless it is given one


# ----- the config and the fan-out, without a run --------------------------------------------------


def test_executor_is_not_part_of_the_config_artifacts_id():
    ids = set()
    for executor in ("threads", "processes", "dask", "ray"):
        cfg = load_config(None, [f"run_id={RUN_ID}", f"flow.executor.type={executor}", "flow.executor.workers=4"])
        ids.add(CONFIG.output_ids(RUN_ID, None, cfg, {}, {})["config"])
    assert len(ids) == 1


def test_bad_executor_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match="flow.executor.type"):
        load_config(None, ["flow.executor.type=spark"])
    with pytest.raises(ConfigError, match="an address names a Dask or Ray cluster"):
        load_config(None, ["flow.executor.type=processes", "flow.executor.address=tcp://10.0.0.1:8786"])
    with pytest.raises(ConfigError, match="flow.executor.workers"):
        load_config(None, ["flow.executor.workers=0"])


def test_workers_cannot_reach_a_memory_store():
    dask = use_executor(ExecutorConfig(type="dask"), "memory://scratch")
    with pytest.raises(UserError, match=r"type=dask needs a store its workers can open.*memory://scratch"):
        dask.__enter__()
    with use_executor(ExecutorConfig(), "memory://scratch") as fan_out:  # threads: units in place
        assert list(fan_out(abs, [-1, 2, -3])) == [1, 2, 3]


def test_a_runner_package_missing_or_written_for_prefect_2_is_refused_in_one_line(monkeypatch):
    """prefect-ray 0.3.1 (what a resolver once installed) would fail at its import in the middle of the first stage;
    it is refused when the executor starts, as a missing package is. The releases installed here pass."""
    import importlib.metadata
    import importlib.util

    check_runner_package("ray")
    check_runner_package("dask")
    check_runner_package("threads")
    real_version, real_find = importlib.metadata.version, importlib.util.find_spec
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "0.3.1" if name == "prefect-ray" else real_version(name)
    )
    with pytest.raises(UserError) as old, use_executor(ExecutorConfig(type="ray"), "./store"):
        pytest.fail("the flow's body ran")
    assert str(old.value) == (
        "flow.executor.type=ray needs prefect-ray 0.6 or newer (0.3.1 is installed): pip install --upgrade 'prefect-ray>=0.6'"
    )
    check_runner_package("dask")  # its own version, not prefect-ray's
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "prefect_dask" else real_find(name))
    with pytest.raises(
        UserError, match=r"^flow.executor.type=dask needs prefect_dask: pip install 'rlvr-pipeline\[dask\]'$"
    ):
        check_runner_package("dask")


def test_the_runner_floors_are_pyprojects_and_make_test_floors():
    """RUNNER_PACKAGES, pyproject's dask and ray extras and constraints/floor.txt name one floor for each package."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pinned = dict(
        line.split("==") for line in (root / "constraints" / "floor.txt").read_text().splitlines() if "==" in line
    )
    for kind, (_, package, floor) in RUNNER_PACKAGES.items():
        assert f"{package}>={floor}" in extras[kind]
        assert Version(pinned[package]) == Version(floor)


def test_a_fan_out_shipped_to_a_worker_runs_units_in_place():
    shipped = pickle.loads(pickle.dumps(FanOut(ExecutorConfig(type="dask", address="tcp://10.0.0.1:8786"))))
    assert shipped.in_place
    assert list(shipped(str, [1, 2])) == ["1", "2"]


def test_labelling_in_chunks_equals_labelling_at_once():
    """The chunked path (what a backend runs) gives the same rows and cache entries as one call, with a
    cache hit, a repeated miss and a wrong answer among the rollouts."""
    from rlvr.tasks.label import chunked

    cfg = VerifierConfig(workers=0)
    problems = {"p1": ("arithmetic", "4"), "p2": ("arithmetic", "12")}
    responses = [("p1", "4"), ("p1", "5"), ("p2", "12"), ("p2", "12"), ("p1", "4x"), ("p2", "7"), ("p1", "4")]
    rollouts = [{"problem_id": pid, "response": text} for pid, text in responses]
    chunk_sizes: list[int] = []

    def fan_out(unit, jobs):
        chunk_sizes.extend(len(job.pairs) for job in jobs)
        return map(unit, jobs)

    results = []
    for name, in_chunks in (("memory://at-once", False), ("memory://chunked", True)):
        store = Store.open(name, create=True)
        known = cache_key("arithmetic", version_of("arithmetic"), "12", "12")
        reward_cache(store).remember(known, Score(1.0, "ok", extracted="12"))
        if in_chunks:
            results.append(score_rollouts(store, cfg, rollouts, problems, chunked(fan_out, 2)))
        else:
            results.append(score_rollouts(store, cfg, rollouts, problems))
    assert chunk_sizes == [2, 2, 1]  # the 5 misses (the two "12" are hits), 2 per unit
    (verdicts, entries), (chunked_verdicts, chunked_entries) = results
    assert chunked_verdicts == verdicts
    assert chunked_entries == entries
    assert [v["cache_hit"] for v in verdicts] == [False, False, True, True, False, False, False]
    assert [v["status"] for v in verdicts] == ["ok", "wrong", "ok", "ok", "unparseable", "wrong", "ok"]
    # 4, 5, 4x and 7 are new (the second "4" repeats the first); 12's verdict, known to this process only, goes too
    assert sorted(e["response_hash"] for e in entries) == sorted(text_hash(t) for t in ("4", "5", "4x", "7", "12"))


def test_a_short_answer_from_a_miss_scorer_is_an_error():
    """A (remote) scorer that loses verdicts fails loudly instead of leaving rewards out."""
    from rlvr.verifiers.cache import score_cached

    lossy = lambda cfg, names, pairs: [Score(1.0, "ok")] * (len(pairs) - 1)  # noqa: E731
    store = Store.open("memory://lossy", create=True)
    with pytest.raises(RuntimeError, match="returned 1 verdicts for 2 answers"):
        score_cached(store, VerifierConfig(verifier="arithmetic", workers=0), [("1", "2"), ("3", "4")], None, lossy)


def test_difficulty_shards_must_come_back_in_order():
    """A fan-out that returns another shard than the one asked for is an error, not a skipped shard."""
    import pyarrow as pa

    from rlvr.storage.stage import Inputs, StageContext
    from rlvr.tasks.difficulty import DifficultyConfig, ShardEstimate
    from rlvr.tasks.difficulty import build as difficulty_build

    problems = pa.table(
        {
            "problem_id": ["p1", "p2"],
            "split": ["train", "train"],
            "prompt": ["1+1", "2+2"],
            "reference": ["2", "4"],
            "verifier": ["arithmetic", "arithmetic"],
        }
    )
    reversed_fan_out = lambda fn, jobs: iter([ShardEstimate(job.index, [0], [1], []) for job in reversed(jobs)])  # noqa: E731
    ctx = StageContext(
        "r", 0, None, "difficulty", {}, {}, params={"verifier": VerifierConfig(), "fan_out": reversed_fan_out}
    )
    sharded = difficulty_build(Inputs.given(problems=problems, policy=None), DifficultyConfig(shard_size=1), ctx)[
        "difficulty"
    ]
    with pytest.raises(RuntimeError, match="shard 0 was asked for, but the fan-out returned shard 1"):
        sharded.make(0)
