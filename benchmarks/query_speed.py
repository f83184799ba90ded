"""Query speed of the store's DuckDB views against two peers on the same files, in the same run.

Builds a store with >= 5M rollouts (and as many rewards) in >= 10 committed artifacts each, plus 100k
problems, then times, best of 3:
  group-by  per-step mean score over rewards
  join      rewards -> rollouts -> problems, aggregated per split
with (1) our views (`storage.connect`), (2) plain DuckDB over a direct glob of the same files, no views,
(3) pyarrow compute (dataset read + group_by / join). All three must return the same numbers.

    python benchmarks/query_speed.py [--store DIR] [--rollouts 5000000] [--artifacts 10] [--problems 100000]

Row ids here are vectorised counters ("r-123"), not storage.row_id hashes: hashing 5M rows in Python
would dominate the set-up and is not what is measured.

`--runs 5,50,500` measures instead how queries grow with the number of runs in a store: one store grows to
each size in turn, every run a realistic handful of small committed artifacts (config, problems, difficulty,
then 5 RL steps of selections, allocations, rollouts, rewards, train_steps, curriculum_state and
reward_cache, each step one commit batch, plus evals and a checkpoint: 41 artifacts) and a completed run
record, written through the Store API (no training). At each size it times, in a fresh `Store` handle each
time as a new `rlvr` process would have:
  train_steps  `rlvr query` on one run's train_steps (storage.views.query: connect + query)
  artifacts    `rlvr query` on one run's rows of the `artifacts` catalog table
  runs         `rlvr runs` (the rows it prints: list_runs + describe_run)
the first call after the store grew (cold) and the best of --repeats after it.

    python benchmarks/query_speed.py --runs 5,50,500 [--store DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlvr.storage import Store, artifact_id, connect
from rlvr.storage.manifest import utc_now
from rlvr.storage.schemas import SCHEMAS
from rlvr.storage.views import data_paths

RUN_ID = "bench"
CODE_VERSION = "bench-1"
STEPS_PER_ARTIFACT = 10
SPLITS = np.array(["train", "validation", "test"])
RESPONSES = pa.array([f"The answer is {i}." for i in range(64)])

GROUP_BY_SQL = "SELECT step, avg(score) AS mean_score, count(*) AS n FROM {rewards} GROUP BY step ORDER BY step"
JOIN_SQL = """
SELECT p.split, count(*) AS n, avg(w.score) AS mean_score, avg(r.n_tokens) AS mean_tokens
FROM {rewards} w
JOIN {rollouts} r ON r.rollout_id = w.rollout_id
JOIN {problems} p ON p.problem_id = r.problem_id
GROUP BY p.split ORDER BY p.split
"""


def prefixed(prefix: str, numbers: np.ndarray) -> pa.Array:
    """'prefix' + number for every number, without a Python loop."""
    return pc.binary_join_element_wise(prefix, pc.cast(pa.array(numbers), pa.string()), "")


def complete(kind: str, columns: dict[str, pa.Array], n: int) -> pa.Table:
    """A table with the kind's declared columns: the given ones, nulls for the rest."""
    schema = SCHEMAS[kind]
    arrays = [columns[f.name] if f.name in columns else pa.nulls(n, f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def problems_table(n: int, rng: np.random.Generator) -> pa.Table:
    a, b = rng.integers(0, 1000, n), rng.integers(0, 1000, n)
    prompts = pc.binary_join_element_wise(
        "What is ", pc.cast(pa.array(a), pa.string()), " + ", pc.cast(pa.array(b), pa.string()), "?", ""
    )
    columns = {
        "problem_id": prefixed("p-", np.arange(n)),
        "run_id": pa.array(np.full(n, RUN_ID)),
        "split": pa.array(SPLITS[rng.integers(0, len(SPLITS), n)]),
        "domain": pa.array(np.full(n, "math")),
        "prompt": prompts,
        "answer": pc.cast(pa.array(a + b), pa.string()),
        "seed": pa.array(np.arange(n)),
        "source_index": pa.array(np.arange(n)),
    }
    return complete("problems", columns, n)


def rollout_and_reward_tables(
    index: int, rows: int, problems: pa.Table, pass_rate: np.ndarray
) -> tuple[pa.Table, pa.Table]:
    rng = np.random.default_rng([0, index])  # per artifact: a partial rebuild makes the same data
    first = index * rows
    problem_index = rng.integers(0, problems.num_rows, rows)
    steps = index * STEPS_PER_ARTIFACT + (np.arange(rows) * STEPS_PER_ARTIFACT) // rows
    rollout_ids = prefixed("r-", np.arange(first, first + rows))
    problem_ids = problems.column("problem_id").take(pa.array(problem_index))
    correct = rng.random(rows) < pass_rate[problem_index]
    rollouts = {
        "rollout_id": rollout_ids,
        "run_id": pa.array(np.full(rows, RUN_ID)),
        "step": pa.array(steps),
        "problem_id": problem_ids,
        "sample_index": pa.array(np.arange(rows) % 8),
        "prompt": problems.column("prompt").take(pa.array(problem_index)),
        "response": RESPONSES.take(pa.array(rng.integers(0, len(RESPONSES), rows))),
        "n_tokens": pa.array(rng.integers(1, 200, rows)),
        "finish_reason": pa.array(np.where(rng.random(rows) < 0.95, "stop", "length")),
        "policy_id": pa.array(np.full(rows, f"policy-{index}")),
    }
    rewards = {
        "rollout_id": rollout_ids,
        "run_id": pa.array(np.full(rows, RUN_ID)),
        "step": pa.array(steps),
        "problem_id": problem_ids,
        "verifier": pa.array(np.full(rows, "math")),
        "verifier_version": pa.array(np.full(rows, "1")),
        "score": pa.array(correct.astype(np.float64)),
        "status": pa.array(np.where(correct, "ok", "wrong")),
    }
    return complete("rollouts", rollouts, rows), complete("rewards", rewards, rows)


def commit(store: Store, kind: str, table: pa.Table, config: dict, parents: list[str], step: int | None) -> str:
    aid = artifact_id(kind, kind, CODE_VERSION, config, parents, RUN_ID)
    store.write_artifact(
        kind,
        aid,
        table,
        run_id=RUN_ID,
        stage=kind,
        parents=parents,
        code_version=CODE_VERSION,
        config=config,
        step=step,
    )
    return aid


def build_store(store: Store, n_rollouts: int, n_artifacts: int, n_problems: int) -> None:
    """Write the data through the store's own commit path (idempotent: a second run reuses it)."""
    rng = np.random.default_rng(0)
    problems = problems_table(n_problems, rng)
    problems_id = commit(store, "problems", problems, {"n": n_problems}, [], None)
    pass_rate = rng.beta(1.0, 1.5, n_problems)
    rows = math.ceil(n_rollouts / n_artifacts)
    for index in range(n_artifacts):
        config = {"rows": rows, "index": index, "problems": n_problems}
        rollouts_id = artifact_id("rollouts", "rollouts", CODE_VERSION, config, [problems_id], RUN_ID)
        rewards_id = artifact_id("rewards", "rewards", CODE_VERSION, config, [rollouts_id], RUN_ID)
        if store.exists(rollouts_id) and store.exists(rewards_id):
            continue
        rollouts, rewards = rollout_and_reward_tables(index, rows, problems, pass_rate)
        step = index * STEPS_PER_ARTIFACT
        commit(store, "rollouts", rollouts, config, [problems_id], step)
        commit(store, "rewards", rewards, config, [rollouts_id], step)


def best_of(repeats: int, run: Callable[[], list[tuple]]) -> tuple[float, list[tuple]]:
    best, result = float("inf"), []
    for _ in range(repeats):
        started = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - started)
    return best, result


def arrow_group_by(files: dict[str, list[str]]) -> list[tuple]:
    rewards = ds.dataset(files["rewards"], format="parquet").to_table(columns=["step", "score"])
    grouped = rewards.group_by("step").aggregate([("score", "mean"), ("score", "count")]).sort_by("step")
    return list(zip(*(grouped.column(c).to_pylist() for c in ("step", "score_mean", "score_count"))))


def arrow_join(files: dict[str, list[str]]) -> list[tuple]:
    rewards = ds.dataset(files["rewards"], format="parquet").to_table(columns=["rollout_id", "score"])
    rollouts = ds.dataset(files["rollouts"], format="parquet").to_table(
        columns=["rollout_id", "problem_id", "n_tokens"]
    )
    problems = ds.dataset(files["problems"], format="parquet").to_table(columns=["problem_id", "split"])
    joined = rewards.join(rollouts, "rollout_id").join(problems, "problem_id")
    grouped = joined.group_by("split").aggregate([("score", "count"), ("score", "mean"), ("n_tokens", "mean")])
    grouped = grouped.sort_by("split")
    names = ("split", "score_count", "score_mean", "n_tokens_mean")
    return list(zip(*(grouped.column(c).to_pylist() for c in names)))


def same(a: list[tuple], b: list[tuple]) -> bool:
    """Equal up to float summation order."""

    def close(u: object, v: object) -> bool:
        return math.isclose(u, v, rel_tol=1e-9) if isinstance(u, float) else u == v

    return len(a) == len(b) and all(len(x) == len(y) and all(map(close, x, y)) for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="store directory (default: a temporary one, removed at the end)")
    parser.add_argument("--rollouts", type=int, default=5_000_000)
    parser.add_argument("--artifacts", type=int, default=10)
    parser.add_argument("--problems", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runs", help="comma-separated store sizes in runs, e.g. 5,50,500: the growth mode")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = args.store or str(Path(scratch) / "store")
        store = Store.open(root, create=True)
        if args.runs:
            grow(root, [int(n) for n in args.runs.split(",")], args.repeats)
            return
        if not store.is_local:
            parser.error("--store must be a local directory: the glob peer reads the files directly")
        started = time.perf_counter()
        build_store(store, args.rollouts, args.artifacts, args.problems)
        build_seconds = time.perf_counter() - started
        run(store, build_seconds, args.repeats)


def run(store: Store, build_seconds: float, repeats: int) -> None:
    files = {
        kind: [path for m in store.manifests(kind=kind) for path in data_paths(store, m)]
        for kind in ("problems", "rollouts", "rewards")
    }
    started = time.perf_counter()
    views = connect(store)
    connect_seconds = time.perf_counter() - started
    plain = duckdb.connect()
    globs = {kind: f"read_parquet('{store.local_root}/artifacts/{kind}/*/part-*.parquet')" for kind in files}
    names = {kind: kind for kind in files}
    rows = views.execute("SELECT (SELECT count(*) FROM rollouts), (SELECT count(*) FROM rewards)").fetchone()
    print(
        f"store {store.root}: {rows[0]:,} rollouts + {rows[1]:,} rewards in {len(files['rollouts'])} + "
        f"{len(files['rewards'])} artifacts, {len(files['problems'])} problems artifact; "
        f"built in {build_seconds:.1f} s; connect() {connect_seconds * 1000:.0f} ms"
    )
    results: dict[str, tuple[float, float, float]] = {}
    for label, sql, arrow in (("group-by", GROUP_BY_SQL, arrow_group_by), ("join", JOIN_SQL, arrow_join)):
        ours, ours_rows = best_of(repeats, lambda sql=sql: views.execute(sql.format(**names)).fetchall())
        glob, glob_rows = best_of(repeats, lambda sql=sql: plain.execute(sql.format(**globs)).fetchall())
        peer, peer_rows = best_of(repeats, lambda arrow=arrow: arrow(files))
        if not (same(ours_rows, glob_rows) and same(ours_rows, peer_rows)):
            raise SystemExit(f"{label}: results differ:\n{ours_rows[:3]}\n{glob_rows[:3]}\n{peer_rows[:3]}")
        results[label] = (ours, glob, peer)
    print(f"{'query (best of ' + str(repeats) + ')':<22}{'ours: views':>14}{'duckdb glob':>14}{'pyarrow':>14}")
    for label, (ours, glob, peer) in results.items():
        print(f"{label:<22}{ours:>12.3f} s{glob:>12.3f} s{peer:>12.3f} s")
    ratios = ", ".join(
        f"{label} pyarrow/ours {peer / ours:.2f}x, glob/ours {glob / ours:.2f}x"
        for label, (ours, glob, peer) in results.items()
    )
    print(f"ratio (time over time; >1 means ours is faster): {ratios}")


# ----- growth mode: queries at 5, 50, 500 runs ------------------------------------------------------

RL_STEPS = 5
GROUP = 8  # rollouts per problem
PROMPTS = 4  # problems per step


def run_name(index: int) -> str:
    return f"run-{index:04d}"


def small(kind: str, columns: dict[str, list], n: int) -> pa.Table:
    return complete(
        kind, {name: pa.array(values, SCHEMAS[kind].field(name).type) for name, values in columns.items()}, n
    )


def step_tables(run_id: str, step: int, rng: np.random.Generator) -> dict[str, pa.Table]:
    """One RL step's artifacts, a few rows each, as the stages write them."""
    slots = list(range(PROMPTS))
    problems = [f"{run_id}-p{(step * PROMPTS + i) % 16}" for i in slots]
    n = PROMPTS * GROUP
    scores = (rng.random(n) < 0.5).astype(float).tolist()
    rollout_ids = [f"{run_id}-s{step}-r{i}" for i in range(n)]
    common = {"run_id": [run_id] * n, "step": [step] * n}
    return {
        "selections": small(
            "selections",
            {"run_id": [run_id] * PROMPTS, "step": [step] * PROMPTS, "slot": slots, "problem_id": problems},
            PROMPTS,
        ),
        "allocations": small(
            "allocations",
            {
                "run_id": [run_id] * PROMPTS,
                "step": [step] * PROMPTS,
                "slot": slots,
                "problem_id": problems,
                "n_rollouts": [GROUP] * PROMPTS,
            },
            PROMPTS,
        ),
        "rollouts": small(
            "rollouts",
            {
                **common,
                "rollout_id": rollout_ids,
                "problem_id": [problems[i // GROUP] for i in range(n)],
                "sample_index": [i % GROUP for i in range(n)],
                "response": [f"The answer is {i}." for i in range(n)],
                "n_tokens": [12] * n,
            },
            n,
        ),
        "rewards": small(
            "rewards",
            {**common, "rollout_id": rollout_ids, "score": scores, "status": ["ok"] * n},
            n,
        ),
        "train_steps": small(
            "train_steps",
            {"run_id": [run_id], "step": [step], "loss": [float(rng.random())], "mean_reward": [sum(scores) / n]},
            1,
        ),
        "curriculum_state": small(
            "curriculum_state",
            {"run_id": [run_id] * 2, "step": [step] * 2, "arm": ["easy", "hard"], "probability": [0.5, 0.5]},
            2,
        ),
        "reward_cache": small(
            "reward_cache",
            {"response_hash": [f"{run_id}-{step}-{i}" for i in range(4)], "score": [1.0, 0.0, 1.0, 0.0]},
            4,
        ),
    }


def write_run(store: Store, index: int) -> None:
    """One completed run: its record and 41 small artifacts, each RL step one commit batch."""
    run_id = run_name(index)
    rng = np.random.default_rng(index)
    config = {"train": {"steps": RL_STEPS}, "seed": index}
    made: list[str] = []

    def put(kind: str, table: pa.Table, stage: str, step: int | None, parents: list[str]) -> str:
        aid = artifact_id(kind, stage, CODE_VERSION, {"step": step}, parents, run_id)
        started = utc_now()
        record = {"outputs": {kind: aid}, "started_at": started, "read_seconds": 0.001, "build_seconds": 0.01}
        store.write_artifact(
            kind,
            aid,
            table,
            run_id=run_id,
            stage=stage,
            parents=parents,
            code_version=CODE_VERSION,
            config={"step": step},
            step=step,
            extra={"stage_run": record},
        )
        made.append(aid)
        return aid

    with store.batch():
        config_id = put(
            "config",
            small("config", {"run_id": [run_id], "config_json": [json.dumps(config)]}, 1),
            "initialize",
            None,
            [],
        )
        problems = small("problems", {"problem_id": [f"{run_id}-p{i}" for i in range(16)], "run_id": [run_id] * 16}, 16)
        problems_id = put("problems", problems, "synthesize", None, [config_id])
        difficulty = small(
            "difficulty", {"run_id": [run_id] * 16, "problem_id": problems.column("problem_id").to_pylist()}, 16
        )
        put("difficulty", difficulty, "difficulty", None, [problems_id])
        put(
            "evals",
            small("evals", {"run_id": [run_id], "step": [0], "phase": ["init"], "accuracy": [0.3]}, 1),
            "evaluate",
            0,
            [problems_id],
        )
    for step in range(1, RL_STEPS + 1):
        with store.batch():
            parents = [problems_id]
            for kind, table in step_tables(run_id, step, rng).items():
                parents = [put(kind, table, kind, step, parents)]
    with store.batch():
        put(
            "evals",
            small("evals", {"run_id": [run_id], "step": [RL_STEPS], "phase": ["rl"], "accuracy": [0.6]}, 1),
            "evaluate",
            RL_STEPS,
            made[-1:],
        )
        checkpoint = small("checkpoints", {"run_id": [run_id], "step": [RL_STEPS], "n_params": [1000]}, 1)
        put("checkpoints", checkpoint, "checkpoint", RL_STEPS, made[-2:-1])
    store.write_run(
        {
            "run_id": run_id,
            "status": "completed",
            "kind": "rl",
            "config_json": json.dumps(config),
            "steps": RL_STEPS,
            "step": RL_STEPS,
            "accuracy": 0.6,
            "phase": "rl",
        }
    )


def timed(repeats: int, call: Callable[[], object]) -> tuple[float, float, object]:
    """The first call's seconds, the best of `repeats` more, and the last result."""
    started = time.perf_counter()
    result = call()
    first = time.perf_counter() - started
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        result = call()
        best = min(best, time.perf_counter() - started)
    return first, best, result


def grow(root: str, sizes: list[int], repeats: int) -> None:
    from rlvr.flows.runs import describe_run
    from rlvr.storage import query

    def fresh() -> Store:
        return Store.open(root)  # a new handle, as a new process has: nothing cached

    def runs_rows() -> list[dict]:
        store = fresh()
        return [describe_run(r, root, store) for r in store.list_runs()]

    store = Store.open(root)
    have = len(store.list_runs())
    print(f"store {root}; code {CODE_VERSION}; each run 41 artifacts in 7 commit batches and a run record")
    print(f"{'runs':>5}{'artifacts':>11}{'build s':>9}   cold / best of {repeats}, milliseconds")
    figures = {}
    for size in sizes:
        started = time.perf_counter()
        for index in range(have, size):
            write_run(store, index)
        have = max(have, size)
        built = time.perf_counter() - started
        target = run_name(size // 2)
        steps_sql = f"SELECT step, loss, mean_reward FROM train_steps WHERE run_id = '{target}' ORDER BY step"
        catalog_sql = f"SELECT kind, count(*) AS n FROM artifacts WHERE run_id = '{target}' GROUP BY kind"
        steps = timed(repeats, lambda sql=steps_sql: query(fresh(), sql))
        catalog = timed(repeats, lambda sql=catalog_sql: query(fresh(), sql))
        runs = timed(repeats, runs_rows)
        assert steps[2].num_rows == RL_STEPS and sum(catalog[2].column("n").to_pylist()) == 41 and len(runs[2]) == size
        figures[size] = (steps, catalog, runs)
        n_artifacts = len(store._committed_ids())
        cells = "  ".join(
            f"{label} {cold * 1000:.1f} / {best * 1000:.1f}"
            for label, (cold, best, _) in zip(("train_steps", "artifacts", "runs"), (steps, catalog, runs))
        )
        print(f"{size:>5}{n_artifacts:>11}{built:>9.1f}   {cells}", flush=True)
    low, high = sizes[0], sizes[-1]
    growth = ", ".join(
        f"{label} {figures[high][i][1] / figures[low][i][1]:.1f}x"
        for i, label in enumerate(("train_steps", "artifacts", "runs"))
    )
    print(f"growth from {low} to {high} runs (best over best): {growth}")


if __name__ == "__main__":
    main()
