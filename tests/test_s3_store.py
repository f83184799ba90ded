"""The store on S3 through s3fs, against moto's S3-compatible server started by these tests on localhost.

The commit protocol, shard resume, binary files and DuckDB views on a bucket; the reward cache finding
new verdicts from its index log, never from a listing, at every labelling call; and a whole run with its
queries, SIGKILLed and resumed, ending with exactly the artifacts, decisions and weights of an
uninterrupted run (made in the test's own process beside the resume: only its store is read). s3fs finds
the server through the standard variables (AWS_ENDPOINT_URL and keys), as a user's shell would set them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pyarrow as pa
import pytest

from rlvr.errors import UserError
from rlvr.storage.errors import StoreNotFound
from rlvr.storage.schemas import SCHEMAS
from rlvr.storage.stage import run_stage
from rlvr.storage.store import Store
from rlvr.storage.views import connect, query
from rlvr.tasks.label import LABEL
from rlvr.verifiers import cache as cache_module
from rlvr.verifiers.cache import RewardCache, VerifierConfig, cache_key, score_to_entry
from tests.cli_helpers import REPO, cli_env, rlvr, rlvr_command

moto_server = pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

BUCKET = "rlvr-test"


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """moto's server on a free localhost port with one bucket; the variables that point s3fs at it."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION"):
            patch.delenv(name, raising=False)
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir(BUCKET)
        yield env
        s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


def new_root(prefix: str) -> str:
    return f"s3://{BUCKET}/{prefix}-{uuid.uuid4().hex[:8]}"


@contextmanager
def s3_requests(store: Store) -> Iterator[Counter[str]]:
    """Count the S3 API calls the store's filesystem makes inside the block, by operation, and by
    operation on Parquet parts ("GetObject .parquet")."""
    counts: Counter[str] = Counter()

    def count(model: Any, params: dict[str, Any], **_: Any) -> None:
        counts[model.name] += 1
        if str(params.get("Key", "")).endswith(".parquet"):
            counts[f"{model.name} .parquet"] += 1

    client = store.fs.s3
    client.meta.events.register("before-parameter-build.s3", count)
    try:
        yield counts
    finally:
        client.meta.events.unregister("before-parameter-build.s3", count)


def write(store: Store, kind: str, table: pa.Table, aid: str, **extra: Any) -> None:
    store.write_artifact(kind, aid, table, run_id="r", stage="test", parents=[], code_version="1", config={}, **extra)


# ----- the commit protocol on a bucket -----------------------------------------------------------------


def test_commit_read_files_and_delete_on_s3(s3_env):
    store = Store.open(new_root("commit"), create=True)
    weights = os.urandom(70_000)
    write(store, "test_rows", pa.table({"x": [1, 2, 3]}), "rows-1", files={"model.safetensors": weights})
    other = Store.open(store.root)  # another process: nothing cached
    assert other.exists("rows-1") and not other.exists("rows-2")
    assert other.read_table("rows-1").column("x").to_pylist() == [1, 2, 3]
    assert other.read_file("rows-1", "model.safetensors") == weights
    assert other.local_file_path("rows-1", "model.safetensors") is None
    assert other.fs.cat_file(other.manifest_path("rows-1")).startswith(b"{")  # one object: the commit
    other.delete_artifact("rows-1")
    assert not store.exists("rows-1")  # the other Store's cached manifest does not make it exist
    assert not store.fs.exists(store.artifact_dir("test_rows", "rows-1"))
    assert Store.open(store.root).manifests() == []


def test_a_store_that_cannot_be_reached_is_one_clear_line(s3_env):
    with pytest.raises(UserError) as caught:
        Store.open("s3://no-such-bucket/store", create=True)
    assert str(caught.value).startswith(
        "cannot reach the store at s3://no-such-bucket/store: The specified bucket does not exist; the bucket must exist"
    )
    with pytest.raises(StoreNotFound):
        Store.open(f"s3://{BUCKET}/never-made")


def test_a_crashed_sharded_write_resumes_from_its_committed_shards_on_s3(s3_env):
    root = new_root("shards")
    store = Store.open(root, create=True)
    kwargs: dict[str, Any] = dict(run_id="r", stage="s", parents=[], code_version="1", config={}, step=None, extra={})
    writer = store.writer("test_rows", "sharded-1", **kwargs)
    for index in (0, 1):
        writer.write_shard(index, pa.table({"x": [index * 10, index * 10 + 1]}))
    store.fs.pipe_file(f"{writer.directory}/part-00002.parquet", b"cut short by a kill")  # data, no marker

    resumed = Store.open(root)  # the next process
    assert resumed.cleanup_run("another-run") == []
    removed = resumed.cleanup_run("r")
    assert [path.rsplit("/", 1)[-1] for path in removed] == ["part-00002.parquet"]
    assert resumed.owner_of(writer.directory) == "r"  # the owner mark stays with the committed shards
    again = resumed.writer("test_rows", "sharded-1", **kwargs)
    assert again.committed_shards() == {0, 1}
    again.write_shard(2, pa.table({"x": [20, 21]}))
    assert again.commit().rows == 6
    assert query(Store.open(root), "SELECT list(x ORDER BY x) AS xs FROM test_rows").column("xs").to_pylist() == [
        [0, 1, 10, 11, 20, 21]
    ]


def test_views_read_each_part_once_and_only_the_views_a_query_names(s3_env):
    store = Store.open(new_root("views"), create=True)
    for step in range(4):
        write(store, "test_rows", pa.table({"x": [step, step]}), f"rows-{step}", step=step)
    write(store, "other_rows", pa.table({"y": ["a"]}), "other-1")
    reader = Store.open(store.root)
    reader.manifests()  # the manifests are read once per connection; count what the views cost
    with s3_requests(reader) as calls:
        con = connect(reader, "SELECT step, sum(x) AS s FROM test_rows JOIN artifacts USING (step) GROUP BY step")
        tables = {name for (name,) in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        assert con.execute("SELECT sum(x) FROM test_rows").fetchone() == (12,)
        assert con.execute("SELECT sum(x) FROM test_rows WHERE x > 1").fetchone() == (10,)
    # Four parts, one GET each, fetched together; no HEAD; the second query reads nothing again.
    assert calls["GetObject .parquet"] == 4 and calls["HeadObject .parquet"] == 0, calls
    assert "test_rows" in tables and "other_rows" not in tables and "artifacts" in tables
    everything = connect(reader)  # without the statement: every view (SHOW TABLES sees them all)
    assert {"test_rows", "other_rows", "rollouts"} <= {name for (name,) in everything.execute("SHOW TABLES").fetchall()}


# ----- the reward cache's index ------------------------------------------------------------------------


def table_of(kind: str, rows: list[dict[str, Any]]) -> pa.Table:
    schema = SCHEMAS[kind]
    return pa.Table.from_pylist([{name: row.get(name) for name in schema.names} for row in rows], schema=schema)


def label_step(store: Store, step: int, answers: list[str]) -> Any:
    """One labelling call, as an RL step makes it: the label stage over this step's rollouts."""
    problems = f"problems-{step}"
    write(
        store,
        "problems",
        table_of("problems", [{"problem_id": "p1", "reference": "7", "verifier": "arithmetic", "split": "train"}]),
        problems,
    )
    rows = [
        {"rollout_id": f"s{step}-{i}", "problem_id": "p1", "response": a, "step": step} for i, a in enumerate(answers)
    ]
    rollouts = f"rollouts-{step}"
    write(store, "rollouts", table_of("rollouts", rows), rollouts)
    cfg = VerifierConfig(workers=0)
    return run_stage(store, LABEL, cfg, run_id="r", step=step, inputs={"rollouts": rollouts, "problems": problems})


def test_a_labelling_call_finds_new_verdicts_without_listing_the_bucket(s3_env, monkeypatch):
    root = new_root("cache")
    mine = Store.open(root, create=True)
    monkeypatch.setattr(cache_module, "_caches", {})  # this process has seen no verdicts yet
    label_step(mine, 0, ["7", "8"])  # the process's first call lists once: what earlier runs left

    theirs = Store.open(root)  # another process (another run) commits verdicts in the meantime
    key = cache_key("arithmetic", cache_module.version_of("arithmetic"), "12", "7")
    write(theirs, "reward_cache", pa.Table.from_pylist([score_to_entry(key, cache_module.Score(0.0, "wrong"))]), "rc-x")

    with s3_requests(mine) as calls:
        done = label_step(mine, 1, ["7", "8", "12"])
    assert calls["ListObjectsV2"] == 0, calls
    rewards = mine.read_table(done.ids["rewards"]).to_pylist()
    # "7" and "8" were scored at step 0 by this process, "12" by the other one: all three are hits.
    assert [(r["status"], r["cache_hit"]) for r in rewards] == [("ok", True), ("wrong", True), ("wrong", True)]


def test_a_writer_with_a_stale_log_end_takes_the_next_free_position_leaving_no_gaps(s3_env):
    root = new_root("log")
    first, second = Store.open(root, create=True), Store.open(root)
    reader = RewardCache(Store.open(root))
    assert reader.lookup([cache_key("arithmetic", "1", "a", "b")]) == [None]
    entries = []
    for i in range(6):  # each writer's idea of where the log ends goes stale at every turn of the other
        key = cache_key("arithmetic", "1", str(i), "b")
        entries.append(key)
        table = pa.Table.from_pylist([score_to_entry(key, cache_module.Score(1.0, "ok"))])
        write(first if i % 2 else second, "reward_cache", table, f"rc-{i}")
    ids, end = first.read_index("reward_cache", 0)
    assert (sorted(ids), end) == ([f"rc-{i}" for i in range(6)], 6)
    assert first.index_end("reward_cache") == 6
    assert [score.status for score in reader.lookup(entries)] == ["ok"] * 6  # type: ignore[union-attr]


# ----- a whole run, its queries, a kill and a resume ------------------------------------------------------

RUN_ID = "s3run"
OVERRIDES = [
    "train.steps=4",
    "select.batch_size=4",
    "allocate.n=4",
    "warmstart.steps=5",
    "difficulty.k=2",
    "difficulty.shard_size=8",
    "evaluate.every=2",
    "checkpoint.every=2",
    "flow.steps_per_subflow=2",
    "synthesize.source.per_category=5",
    "select.type=sec",  # curricula whose decisions carry state from step to step
    "allocate.type=knapsack",
]
KILL_AT = 20  # committed artifacts; the whole run commits 48 (asserted below; 4 of them the turns tables, 1 the difficulty stage's reward_cache)


def start_run(root: str, env: dict[str, str]) -> subprocess.Popen:
    args = ["run", "--store", root, "--run-id", RUN_ID]
    for override in OVERRIDES:
        args += ["--set", override]
    return subprocess.Popen(
        rlvr_command(*args), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def committed(store: Store) -> int:
    return len(store._committed_ids())


def decisions(store: Store) -> dict[str, list[dict[str, Any]]]:
    sql = {
        "selections": "SELECT step, slot, problem_id, arm, probability FROM selections ORDER BY step, slot",
        "allocations": "SELECT step, slot, n_rollouts, p_hat FROM allocations ORDER BY step, slot",
        "train_steps": "SELECT step, loss, mean_reward, effective_ratio FROM train_steps ORDER BY step",
        "evals": "SELECT step, phase, accuracy FROM evals ORDER BY step, phase",
    }
    return {name: query(store, text).to_pylist() for name, text in sql.items()}


def final_weights(store: Store) -> bytes:
    final = max(store.manifests(kind="checkpoints"), key=lambda m: m.step)
    return store.read_file(final.artifact_id, "model.safetensors")


@pytest.mark.slow
def test_a_run_on_s3_is_queried_killed_and_resumed_like_a_local_one(s3_env, prefect_api, tmp_path):
    # TMPDIR: the local folder a bucket store keeps beside it (flows/prefect_env.py) goes to tmp_path.
    env = cli_env(PREFECT_API_URL=prefect_api, TMPDIR=str(tmp_path), **s3_env)
    reference, killed = new_root("reference"), new_root("killed")

    proc = start_run(killed, env)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        # A listing of the bucket, as another process sees it (12 ms of CPU here, moto's included): one every half
        # second still lands the kill among step 2's commits or just after them, seconds before step 3's.
        if committed(Store(killed)) >= KILL_AT:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.5)
    assert proc.wait(timeout=60) == -signal.SIGKILL, proc.stderr.read()  # type: ignore[union-attr]
    halfway = committed(Store(killed))

    log = tmp_path / "resume.log"
    with log.open("w") as stderr:
        resuming = subprocess.Popen(
            rlvr_command("resume", RUN_ID, "--store", killed), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
            stderr=stderr,
        )  # fmt: skip
    # The uninterrupted run goes on beside the resumed one, in this process: only its artifacts are compared.
    from rlvr.flows.config import load_config
    from rlvr.flows.prefect_env import remote_store_home
    from rlvr.flows.runs import execute

    try:
        execute(reference, load_config(None, [f"run_id={RUN_ID}", *OVERRIDES]), new=True)
    except BaseException:
        resuming.kill()
        resuming.wait()
        raise
    finally:  # the local folder this process made beside the bucket store (empty: Prefect's home is the tests')
        shutil.rmtree(remote_store_home(reference), ignore_errors=True)
    assert resuming.wait(timeout=400) == 0, log.read_text()[-3000:]
    ref_store = Store.open(reference)
    assert KILL_AT <= halfway < committed(ref_store) == 48

    store = Store.open(killed)
    ids = lambda s: sorted(m.artifact_id for m in s.manifests())  # noqa: E731
    assert ids(store) == ids(ref_store)
    assert decisions(store) == decisions(ref_store)
    assert final_weights(store) == final_weights(ref_store)

    listed = rlvr("runs", "--store", killed, env=env)
    assert listed.returncode == 0 and RUN_ID in listed.stdout and "completed" in listed.stdout, listed.stderr
    sql = f"SELECT step, phase, accuracy FROM evals WHERE run_id = '{RUN_ID}' ORDER BY step, phase"
    shown = rlvr("query", sql, "--store", killed, "--format", "json", env=env)
    assert shown.returncode == 0, shown.stderr
    rows = [json.loads(line) for line in shown.stdout.splitlines()]
    assert rows == decisions(ref_store)["evals"]
    final = max(store.manifests(kind="checkpoints"), key=lambda m: m.step).artifact_id
    walked = rlvr("lineage", final, "--up", "--store", killed, "--format", "json", env=env)
    assert walked.returncode == 0, walked.stderr
    kinds = {json.loads(line)["kind"] for line in walked.stdout.splitlines()}
    assert {"problems", "rollouts", "rewards", "train_steps"} <= kinds


def test_run_leases_on_s3_have_exactly_one_winner_and_hand_over(s3_env):
    """Conditional PUTs make a lease number single-owner on a bucket too; a released run is taken with the next."""
    from concurrent.futures import ThreadPoolExecutor

    from rlvr.storage.leases import Lease, RunClaimed, RunExists, claim_run, current_owner

    root = new_root("leases")
    Store.open(root, create=True)

    def race(_: int) -> str:
        try:
            return f"won {claim_run(Store(root), 'shared', new=True).number}"
        except (RunClaimed, RunExists) as exc:
            return type(exc).__name__

    with ThreadPoolExecutor(6) as pool:
        outcomes = sorted(pool.map(race, range(6)))
    assert outcomes.count("won 0") == 1 and len([o for o in outcomes if o.startswith("won")]) == 1
    store = Store.open(root)
    assert current_owner(store, "shared")["pid"] == os.getpid()
    with pytest.raises(RunClaimed, match="run 'shared' is already running: process"):
        claim_run(store, "shared", new=False)
    Lease(store, "shared", 0, dict(current_owner(store, "shared") or {})).release()
    assert current_owner(store, "shared") is None
    assert claim_run(store, "shared", new=False).number == 1


def test_commits_check_the_lease_on_s3(s3_env):
    """Fencing on a bucket (tests/test_fencing.py's checks): after a takeover nothing more of the run is PUT."""
    from tests.test_fencing import check_fencing

    check_fencing(Store.open(new_root("fencing"), create=True))
