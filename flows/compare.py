"""`rlvr compare`: one run config under several curricula and rollout budgets, several seeds each, as real runs in
one store, then the figures read back from it (flows/compare_figures.py), a comparison artifact and a page.

Each (method, seed) is an `rlvr run` of its own process, run id `NAME-METHOD-sSEED`, the method's overrides and
`seed=SEED` on top of the config; `parallel` at a time, as the tasks of one Prefect flow (`rlvr-compare`) on a
thread pool, or on Dask or Ray (`executor`: each task then starts its run on a worker, which must reach the store).
The runs record their flows on the same Prefect server (the store's own, started for the comparison, unless
PREFECT_API_URL names one). Running the same comparison again goes on from where it stopped: a completed run is
read as it is, a failed or killed one is resumed (`rlvr resume`, exactly), a missing one started.

Unless the config or `--set` says otherwise, every run evaluates with `evaluate.samples` sampled answers a problem
(mean@k, the papers' metric) beside greedy accuracy.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlvr.errors import UserError
from rlvr.flows.compare_figures import MethodFigures, RunFigures, method_figures, run_figures
from rlvr.flows.compare_runs_file import (
    add_to_runs_file,
    figures_of_row,
    figures_row,
    identity_in_store,
    identity_of,
    made_with,
    number_or_none,
    read_runs_file,
)

if TYPE_CHECKING:
    from rlvr.storage.store import Store

METHODS: dict[str, list[str]] = {
    "uniform": ["select.type=uniform", "allocate.type=uniform"],
    "sec": ["select.type=sec", "allocate.type=uniform"],
    # Knapsack with its difficulty-stage prior for prompts without outcomes (the default is the paper's uniform)
    "knapsack": ["select.type=uniform", "allocate.type=knapsack", "allocate.unknown=prior"],
    "sec+knapsack": ["select.type=sec", "allocate.type=knapsack", "allocate.unknown=prior"],
    "dynamic": ["select.type=uniform", "allocate.type=uniform", "filter.enabled=true"],
    "clpo": ["select.type=uniform", "allocate.type=uniform", "restructure.enabled=true"],
    # the paper's CLPO: kept rewrites train in the step that made them, within its budget
    "clpo-same-step": [
        "select.type=uniform",
        "allocate.type=uniform",
        "restructure.enabled=true",
        "restructure.join=same_step",
    ],
    "ghpo": ["select.type=uniform", "allocate.type=uniform", "select.hints.enabled=true"],
    # SEED-GRPO: each group's advantages scaled by the semantic entropy of its answers (alpha 0.5)
    "seed-grpo": ["select.type=uniform", "allocate.type=uniform", "train.grpo.semantic_entropy=0.5"],
    # groups whose pass rate lies outside [0.2, 0.8] dropped and refilled, as dynamic sampling drops all-equal ones
    "band-pass": ["select.type=uniform", "allocate.type=uniform", "filter.enabled=true", "filter.band=[0.2,0.8]"],
    # uniform sampled one step behind, beside the trainer: what staleness costs in learning
    "async-1": ["select.type=uniform", "allocate.type=uniform", "flow.async_level=1"],
}
DEFAULT_SAMPLES = 8
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


@dataclass(frozen=True)
class Job:
    """One run of the comparison."""

    method: str
    seed: int
    run_id: str
    overrides: list[str]


@dataclass(frozen=True)
class CompareSpec:
    """What `rlvr compare` was asked: the comparison's name, the config, methods, seeds and the rest."""

    name: str
    config: str | None
    methods: list[str]
    seeds: list[int]
    overrides: list[str]
    target: float | None = None
    samples: int = DEFAULT_SAMPLES
    parallel: int = 2
    executor: str = "threads"
    address: str | None = None
    runs_file: str | None = None  # finished runs shared with other stores (flows/compare_runs_file.py)
    start_runs: bool = True  # False: read what has finished, start nothing

    def command(self) -> str:
        """The `rlvr compare` command line that makes this comparison."""
        parts = ["rlvr", "compare", "--name", self.name, "--methods", ",".join(self.methods)]
        parts += ["--seeds", str(len(self.seeds)), "--samples", str(self.samples)]
        parts += [] if self.config is None else ["--config", self.config]
        parts += [] if self.target is None else ["--target", f"{self.target:g}"]
        for item in self.overrides:
            parts += ["--set", item]
        parts += [] if self.runs_file is None else ["--runs-file", self.runs_file]
        return shlex.join(parts)

    def check(self) -> None:
        """One-line errors for what cannot run, before any work."""
        if not NAME_RE.match(self.name):
            raise UserError(
                f"comparison name {self.name!r}: letters, digits, '_' and '-', at most 64, first a letter or digit"
            )
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise UserError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")
        if len(set(self.methods)) != len(self.methods) or not self.methods:
            raise UserError("name each method once, at least one")
        if not self.seeds:
            raise UserError("--seeds must be at least 1")
        if self.executor not in ("threads", "processes", "dask", "ray"):
            raise UserError(f"--executor {self.executor!r}: threads, processes, dask or ray")
        if self.config is not None and not Path(self.config).is_file():
            raise UserError(f"no config file {self.config}")


def run_id_of(name: str, method: str, seed: int) -> str:
    return f"{name}-{method.replace('+', '-')}-s{seed}"


def jobs_of(spec: CompareSpec, configured: int = 0) -> list[Job]:
    """Every (method, seed) run, seed by seed (so a stopped comparison has whole seeds first); each evaluates with
    `spec.samples` sampled answers unless `--set` or the config (`configured` > 0) says how many."""
    given = configured > 0 or any(o.startswith("evaluate.samples=") for o in spec.overrides)
    samples = [] if given else [f"evaluate.samples={spec.samples}"]
    return [
        Job(
            method,
            seed,
            run_id_of(spec.name, method, seed),
            [*samples, *spec.overrides, *METHODS[method], f"seed={seed}"],
        )
        for seed in spec.seeds
        for method in spec.methods
    ]


def check_configs(spec: CompareSpec) -> None:
    """Load every job's config as its run will (a key a method sets that this config refuses fails here, in one
    line naming the method, not after the first runs)."""
    from rlvr.flows.config import load_config

    for job in jobs_of(spec, config_samples(spec))[: len(spec.methods)]:
        try:
            load_config(spec.config, [*job.overrides, f"run_id={job.run_id}"])
        except UserError as error:
            raise UserError(f"method {job.method}: {error}") from None


def config_samples(spec: CompareSpec) -> int:
    """The sampled answers a problem the config file asks for (0 when it asks for none, or there is no file)."""
    from rlvr.flows.config import load_config

    return 0 if spec.config is None else load_config(spec.config, []).evaluate.samples


def job_command(store_root: str, config: str | None, job: Job, status: str | None) -> list[str]:
    """The `rlvr` command line that brings `job` to its end: run when it has no record, resume when it failed."""
    cli = [sys.executable, "-m", "rlvr.flows.cli"]
    if status is not None:
        return [*cli, "resume", job.run_id, "--store", store_root]
    command = [*cli, "run", "--store", store_root, "--run-id", job.run_id]
    if config is not None:
        command += ["--config", str(Path(config).resolve())]
    for item in job.overrides:
        command += ["--set", item]
    return command


def run_status_in(store_root: str, run_id: str) -> str | None:
    """The run's status in the store (completed, failed, running), None when it has no record."""
    from rlvr.storage.run_records import run_status
    from rlvr.storage.store import open_store

    record = open_store(store_root).read_run(run_id)
    return None if record is None else run_status(record)


def logs_folder(store_root: str, name: str) -> Path:
    """Where the runs' output goes: inside a local store, else a temp folder."""
    from rlvr.storage.store import open_store

    local = open_store(store_root).local_root
    folder = (
        Path(local) / "_compare" / name if local is not None else Path(tempfile.gettempdir()) / f"rlvr-compare-{name}"
    )
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def bring_to_end(unit: dict[str, Any]) -> dict[str, Any]:
    """A task of the comparison (on this machine or a worker): the job's run to its end, as a process of its own
    writing to its log; returns the run id, how it went and the log's last lines when it failed."""
    job: Job = unit["job"]
    status = run_status_in(unit["store"], job.run_id)
    if status == "completed":
        return {"run_id": job.run_id, "outcome": "completed before"}
    if status == "running":  # its process is alive (a dead one's run reads as failed)
        why = "running already, in another process (another `rlvr compare` of this name?)"
        return {"run_id": job.run_id, "outcome": f"failed: {why}", "tail": [], "log": unit["log"]}
    log = Path(unit["log"])
    env = {**os.environ, "PREFECT_LOGGING_LEVEL": "ERROR"}
    with log.open("a") as out:
        done = subprocess.run(job_command(unit["store"], unit["config"], job, status), stdout=out, stderr=out, env=env)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        return {"run_id": job.run_id, "outcome": f"failed (status {done.returncode})", "tail": tail, "log": str(log)}
    return {"run_id": job.run_id, "outcome": "resumed" if status else "completed"}


def run_comparison(store_root: str, spec: CompareSpec, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Bring every job's run to its end, `spec.parallel` at a time, as the tasks of one Prefect flow (on a thread
    pool here, or on the workers of `spec.executor` through the stages' own fan-out, flows/executors.py); say each
    as it ends. Prefect is configured by the caller."""
    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner

    folder = logs_folder(store_root, spec.name)
    jobs = jobs_of(spec, config_samples(spec))
    in_file = rows_for_jobs(spec, jobs, read_runs_file(_path(spec.runs_file)))
    units: list[dict[str, Any]] = [
        {"job": j, "store": store_root, "config": spec.config, "log": str(folder / f"{j.run_id}.log")}
        for j in jobs
        if j.run_id not in in_file
    ]
    if in_file:
        say(f"{len(in_file)} run(s) taken from {spec.runs_file}")
    runner: Any = ThreadPoolTaskRunner(max_workers=spec.parallel)
    # a module-level function, its progress through a module global: a worker backend pickles the flow's context,
    # which must hold no closure (a console's lock)
    compare = flow(name="rlvr-compare", flow_run_name=spec.name, task_runner=runner, validate_parameters=False)
    _PROGRESS[:] = [lambda text, result: say(text)]
    if spec.runs_file is not None:
        _PROGRESS.append(lambda text, result: _add_when_done(store_root, spec, jobs, result))
    try:
        ended: list[dict[str, Any]] = compare(_compare_flow)(store_root, units, executor_settings(spec))
        return ended
    finally:
        _PROGRESS.clear()


_PROGRESS: list[Callable[[str, dict[str, Any]], None]] = []


def _path(runs_file: str | None) -> Path | None:
    return None if runs_file is None else Path(runs_file)


def _add_when_done(store_root: str, spec: CompareSpec, jobs: list[Job], result: dict[str, Any]) -> None:
    """Add a run that ended well to the runs file."""
    from rlvr.storage.store import open_store

    if not result["outcome"].startswith("failed"):
        job = next(j for j in jobs if j.run_id == result["run_id"])
        add_to_runs_file(Path(str(spec.runs_file)), [store_row(open_store(store_root), spec, job)])


def _compare_flow(store_root: str, units: list[dict[str, Any]], executor: dict[str, Any]) -> list[dict[str, Any]]:
    """The comparison's flow: every unit's run to its end, said as each ends."""
    from prefect import task
    from prefect.cache_policies import NONE
    from prefect.futures import as_completed

    from rlvr.flows.executors import ExecutorConfig, use_executor

    if executor["type"] == "threads":
        one = task(name="compare-run", task_run_name="{run_id}", cache_policy=NONE)(_task_body)
        results: Iterator[dict[str, Any]] = (
            f.result() for f in as_completed([one.submit(u["job"].run_id, u) for u in units])
        )
    else:  # one unit a worker process at a time: `parallel` workers, `parallel` runs
        results = _fanned_out(use_executor(ExecutorConfig.model_validate(executor), store_root), units)
    ended: list[dict[str, Any]] = []
    for result in results:
        ended.append(result)
        for told in _PROGRESS:
            told(f"[{len(ended)}/{len(units)}] {result['run_id']}: {result['outcome']}", result)
    return ended


def _fanned_out(executor: Any, units: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    with executor as fan_out:
        yield from fan_out(bring_to_end, units)


def executor_settings(spec: CompareSpec) -> dict[str, Any]:
    return {"type": spec.executor, "address": spec.address, "workers": spec.parallel}


def _task_body(run_id: str, unit: dict[str, Any]) -> dict[str, Any]:
    """The task's function (`run_id` names the task run)."""
    return bring_to_end(unit)


def rows_for_jobs(spec: CompareSpec, jobs: list[Job], rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The file's rows of these jobs, each checked against its job's config identity (one line when one differs)."""
    taken = {}
    for job in jobs:
        row = rows.get(job.run_id)
        if row is None:
            continue
        if row["config"] != identity_of(spec.config, [*job.overrides, f"run_id={job.run_id}"]):
            raise UserError(
                f"--runs-file has run {job.run_id} under another config than this comparison gives it "
                f"(read by {row['origin']}): compare it under its own config and --set, or use another file"
            )
        taken[job.run_id] = row
    return taken


def store_row(store: Store, spec: CompareSpec, job: Job) -> dict[str, Any]:
    """The row of a run finished in the store, to add to the runs file."""
    run = replace(run_figures(store, job.run_id, job.method, job.seed), origin=made_with())
    return figures_row(run, spec.name, identity_in_store(store, job.run_id))


def save_finished(store_root: str, spec: CompareSpec) -> int:
    """Add every run of the comparison completed in the store to the runs file; how many."""
    from rlvr.storage.store import open_store

    store = open_store(store_root)
    done = [j for j in jobs_of(spec, config_samples(spec)) if run_status_in(store_root, j.run_id) == "completed"]
    if done:
        add_to_runs_file(Path(str(spec.runs_file)), [store_row(store, spec, job) for job in done])
    return len(done)


def read_figures(store_root: str, spec: CompareSpec) -> tuple[str, list[MethodFigures]]:
    """The metric the runs share and each method's figures: a run completed in the store is read from it, else
    from the runs file; with `start_runs` off, a run in neither is left out (and a method without runs)."""
    from rlvr.storage.store import open_store

    store = open_store(store_root)
    jobs = jobs_of(spec, config_samples(spec))
    in_file = rows_for_jobs(spec, jobs, read_runs_file(_path(spec.runs_file)))
    runs: dict[str, list[RunFigures]] = {method: [] for method in spec.methods}
    for job in jobs:
        if run_status_in(store_root, job.run_id) == "completed":
            runs[job.method].append(run_figures(store, job.run_id, job.method, job.seed))
        elif job.run_id in in_file:
            runs[job.method].append(figures_of_row(in_file[job.run_id]))
        elif spec.start_runs:
            raise UserError(f"run {job.run_id} has not completed in {store_root}")
    runs = {method: own for method, own in runs.items() if own}
    if not runs:
        raise UserError(f"no run of comparison {spec.name!r} has completed in {store_root} or the runs file")
    metrics = {run.metric for own in runs.values() for run in own}
    if len(metrics) > 1:
        raise UserError(f"the runs were evaluated differently ({', '.join(sorted(metrics))}): compare like with like")
    return metrics.pop(), method_figures(runs, spec.target)


def commit_comparison(store_root: str, spec: CompareSpec, metric: str, methods: list[MethodFigures], page: str) -> str:
    """The comparison as two artifacts of run `compare-NAME`: `comparison_runs` (a row a run: its curve, rollouts and
    figures) and `comparisons` (a row a method, with intervals; the page is its file comparison.html), whose parents
    are every run's last evaluation. Returns the `comparisons` artifact's id."""
    import pyarrow as pa

    from rlvr.storage.ids import artifact_id
    from rlvr.storage.store import open_store

    store = open_store(store_root)
    run_id = f"compare-{spec.name}"
    parents = [last_evaluation(store, run.run_id) for m in methods for run in m.runs if run.origin == "store"]
    identity = {
        "name": spec.name,
        "methods": spec.methods,
        "seeds": spec.seeds,
        "target": spec.target,
        "metric": metric,
    }
    per_run = pa.Table.from_pylist([run_row(store, spec.name, run) for m in methods for run in m.runs])
    runs_id = artifact_id("comparison_runs", "compare", COMPARE_VERSION, identity, parents, run_id)
    common = dict(run_id=run_id, stage="compare", code_version=COMPARE_VERSION, config=identity)
    store.write_artifact("comparison_runs", runs_id, per_run, parents=parents, **common)  # type: ignore[arg-type]
    summary = pa.Table.from_pylist([method_row(spec.name, metric, m) for m in methods])
    aid = artifact_id("comparisons", "compare", COMPARE_VERSION, identity, [runs_id], run_id)
    files = {"comparison.html": page.encode()}
    store.write_artifact("comparisons", aid, summary, parents=[runs_id], files=files, **common)  # type: ignore[arg-type]
    return aid


COMPARE_VERSION = "2"  # 2: comparison_runs has the runs file's columns (the effective ratio step by step, origin)


def last_evaluation(store: Store, run_id: str) -> str:
    evals = store.manifests(kind="evals", run_id=run_id)
    return max(evals, key=lambda m: (m.step or 0, m.created_at)).artifact_id


def run_row(store: Store, name: str, run: RunFigures) -> dict[str, Any]:
    """A run's row of `comparison_runs`: the runs file's row (its config identity from the store or the file)."""
    identity = identity_in_store(store, run.run_id) if run.origin == "store" else ""
    return figures_row(run, name, identity)


def method_row(name: str, metric: str, m: MethodFigures) -> dict[str, Any]:
    row: dict[str, Any] = {"comparison": name, "method": m.method, "seeds": len(m.runs), "metric": metric}
    figures = {
        "final": m.final,
        "at_uniform_budget": m.at_uniform_budget,
        "rollouts_to_target": m.rollouts_to_target,
        "effective_ratio": m.effective_ratio,
        "compute_equivalence": m.compute_equivalence,
        "late_all_right": m.late_all_right,
        "late_all_wrong": m.late_all_wrong,
    }
    for key, found in figures.items():
        for part in ("mean", "low", "high"):
            value = None if found is None else getattr(found, part)
            row[f"{key}_{part}" if part != "mean" else key] = None if value is None else number_or_none(value)
    row["target_reached_seeds"] = None if m.rollouts_to_target is None else m.rollouts_to_target.seeds
    row["notes"] = "; ".join(m.notes)
    return row
