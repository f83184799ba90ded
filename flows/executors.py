"""Execution backends: where the independent units of a stage's work run (`flow.executor`).

Three stages split their work into units that do not depend on each other: `synthesize` (one unit per
source: read and validate its rows), `difficulty` (one per shard: sample k rollouts of each problem and
verify them) and `label` (chunks of `verify_chunk` cache misses, when a step has more rollouts than
that). The flow puts the run's `FanOut` in those stages' params (`fan_out`, never part of an id:
storage/stage.py's EXECUTION_PARAMS); a build maps its unit function over its units with it and stays a
plain function (without one it maps in place, with Python's `map`).

    threads    the default: units run one after another in the stage's own thread, in the flow's
               process, as they did before backends existed; parallelism comes from the verifier
               pool's worker processes. (Units are not spread over threads: torch's sampling RNG and
               the verifier pool are per-process resources.)
    processes  Prefect's ProcessPoolTaskRunner: `workers` spawned processes on this machine.
    dask       prefect-dask's DaskTaskRunner: a LocalCluster of `workers` single-threaded worker
               processes, or the scheduler at `address` (tcp://host:8786).
    ray        prefect-ray's RayTaskRunner: a new local Ray instance with `workers` CPUs, or the
               cluster at `address` (host:6379, ray://host:10001, or "auto").

On the last three every unit is a Prefect task run of that runner (named like
`difficulty.estimate_shard[3]`). One runner serves the whole run, started at its first unit and
stopped when the flow ends, not one per subflow: a LocalCluster or a Ray instance takes seconds to
start. Units are deterministic functions of their inputs (seeds are derived per shard, cache hits are
decided by the stage before its units run), so the artifacts and their rows are the same whichever
backend ran them, and the executor is part of no artifact id. Workers open the store from its root
string: it must be a store they can reach (a local path for workers on this machine, a shared path or
object storage for a cluster; never memory://), and they must have this project installed.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import os
import secrets
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from importlib import metadata
from typing import Any, Literal, TypeVar

from packaging.version import Version
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlvr.errors import UserError

T = TypeVar("T")
R = TypeVar("R")

ExecutorType = Literal["threads", "processes", "dask", "ray"]


class ExecutorConfig(BaseModel):
    """Where the units of the fanned-out stages run (`flow.executor`); not part of any artifact id."""

    model_config = ConfigDict(extra="forbid")

    type: ExecutorType = Field("threads", description="threads (in place), processes, dask or ray")
    address: str | None = Field(
        None, description="an existing cluster: Dask scheduler tcp://host:8786, Ray ray://host:10001 or auto"
    )
    workers: int = Field(2, ge=1, description="local processes / Dask workers / Ray CPUs; units in flight = 2x")
    verify_chunk: int = Field(1024, ge=1, description="verifications per unit when labelling fans out")

    @model_validator(mode="after")
    def _address_needs_a_cluster(self) -> ExecutorConfig:
        if self.address is not None and self.type not in ("dask", "ray"):
            raise ValueError(f"an address names a Dask or Ray cluster; flow.executor.type is {self.type!r}")
        return self


class FanOut:
    """Maps a unit function over units on the run's workers; results come back in the units' order.

    At most `window` units are in flight, so a large stage does not create all its task runs at once
    and a crash loses only those. Pickled (Prefect ships the calling task's parameters to workers) it
    becomes an in-place one: a unit that fans out again on a worker runs its sub-units there.
    """

    def __init__(self, cfg: ExecutorConfig) -> None:
        self.cfg = cfg
        self.window = 2 * cfg.workers
        self._runner: Any = None

    @property
    def in_place(self) -> bool:
        return self.cfg.type == "threads"

    @property
    def verify_chunk(self) -> int:
        """Verifications per unit when `label` fans out (`flow.executor.verify_chunk`)."""
        return self.cfg.verify_chunk

    def __call__(self, fn: Callable[[T], R], units: Iterable[T]) -> Iterator[R]:
        return map(fn, units) if self.in_place else self._on_workers(fn, units)

    def _on_workers(self, fn: Callable[[T], R], units: Iterable[T]) -> Iterator[R]:
        runner, task = self._started(), unit_task()
        name = f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"
        numbered = enumerate(units)
        in_flight: deque[Any] = deque()

        def submit_next() -> None:
            following = next(numbered, None)
            if following is not None:
                index, unit = following
                in_flight.append(runner.submit(task, {"fn": fn, "unit": unit, "label": f"{name}[{index}]"}))

        for _ in range(self.window):
            submit_next()
        while in_flight:
            result = in_flight.popleft().result()
            submit_next()
            yield result

    def _started(self) -> Any:
        if self._runner is None:
            runner = task_runner(self.cfg)
            runner.__enter__()
            self._runner = runner
        return self._runner

    def close(self) -> None:
        """Stop the runner (and the local cluster it started), if a unit ever started it."""
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.__exit__(None, None, None)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (FanOut, (ExecutorConfig(),))


def task_runner(cfg: ExecutorConfig) -> Any:
    """The Prefect task runner of `cfg`, for the backends that run units elsewhere (imported here: Prefect
    must not load before it is configured)."""
    if cfg.type == "processes":
        from prefect.task_runners import ProcessPoolTaskRunner

        return ProcessPoolTaskRunner(max_workers=cfg.workers)
    return _dask_runner(cfg) if cfg.type == "dask" else _ray_runner(cfg)


def _dask_runner(cfg: ExecutorConfig) -> Any:
    import dask
    from prefect_dask import DaskTaskRunner

    if cfg.address:
        return DaskTaskRunner(address=cfg.address)
    # A unit verifies through a pool of worker processes, which a daemonic process may not start.
    dask.config.set({"distributed.worker.daemon": False})
    # The scheduler runs in this process; its INFO lines would interleave with the progress bars.
    logging.getLogger("distributed").setLevel(logging.WARNING)
    local = {"n_workers": cfg.workers, "threads_per_worker": 1, "processes": True, "dashboard_address": None}
    return DaskTaskRunner(cluster_class="distributed.LocalCluster", cluster_kwargs=local)


def _ray_runner(cfg: ExecutorConfig) -> Any:
    from prefect_ray import RayTaskRunner

    if cfg.address == "auto":  # the cluster this machine belongs to (prefect-ray would start a new one)
        return RayTaskRunner(init_kwargs={"address": "auto"})
    if cfg.address:
        return RayTaskRunner(address=cfg.address)
    # address "local": a new instance even when this machine runs a cluster (ray.init() would join that one)
    keep_ray_token_out_of_home()
    local = {"address": "local", "num_cpus": cfg.workers, "include_dashboard": False, "logging_level": logging.WARNING}
    return RayTaskRunner(init_kwargs=local)


RAY_TOKEN_SETTINGS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def keep_ray_token_out_of_home() -> None:
    """Give a new local Ray instance its token in the environment, which its processes inherit.

    Ray turns on token authentication for a new local instance and, without a token, generates one and
    saves it as ~/.ray/auth_token; runs must not write to the home directory. A user's own Ray auth
    settings are left alone."""
    if not any(os.environ.get(name) for name in RAY_TOKEN_SETTINGS):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


# One unit runs at a time per worker process: a Dask worker with several threads would otherwise run two
# units at once, and torch's sampling RNG and the verifier pools are per process.
_UNIT_LOCK = threading.Lock()


def _run_unit(fn: Callable[[Any], Any], unit: Any, label: str) -> Any:
    if multiprocessing.current_process().daemon:
        raise UserError(
            "this worker is a daemonic process, which cannot start the verifier pool's processes; start Dask "
            "workers with DASK_DISTRIBUTED__WORKER__DAEMON=False (e.g. `DASK_DISTRIBUTED__WORKER__DAEMON=False "
            "dask worker tcp://scheduler:8786`)"
        )
    with _UNIT_LOCK:
        return fn(unit)


@cache
def unit_task() -> Any:
    """The Prefect task every unit runs as (made on first use, after Prefect is configured). The task
    wraps `_run_unit`, which workers import by name, so shipping it pickles no code."""
    from prefect import task
    from prefect.cache_policies import NONE

    return task(name="unit", task_run_name="{label}", cache_policy=NONE)(_run_unit)


_current: ContextVar[FanOut | None] = ContextVar("rlvr_fan_out", default=None)


def current_fan_out() -> FanOut:
    """The fan-out of the run this flow is executing (in place outside `use_executor`)."""
    return _current.get() or FanOut(ExecutorConfig())


# The task runner package of each backend and pyproject's floor for it (tests/test_backends.py holds them equal): an
# install resolved beside other pins once took prefect-ray 0.3.1, a release for Prefect 2, whose import failed in the
# middle of a run's first stage.
RUNNER_PACKAGES = {"dask": ("prefect_dask", "prefect-dask", "0.3.7"), "ray": ("prefect_ray", "prefect-ray", "0.6")}


def check_runner_package(kind: str) -> None:
    """A one-line UserError, before any unit runs, unless backend `kind`'s task runner package is installed at
    pyproject's floor or newer."""
    if kind not in RUNNER_PACKAGES:
        return
    module, package, floor = RUNNER_PACKAGES[kind]
    if importlib.util.find_spec(module) is None:
        raise UserError(f"flow.executor.type={kind} needs {module}: pip install 'rlvr-pipeline[{kind}]'")
    try:
        installed = metadata.version(package)
    except metadata.PackageNotFoundError:  # importable without a distribution (a source tree on the path)
        return
    if Version(installed) < Version(floor):
        raise UserError(
            f"flow.executor.type={kind} needs {package} {floor} or newer ({installed} is installed): "
            f"pip install --upgrade '{package}>={floor}'"
        )


@contextmanager
def use_executor(cfg: ExecutorConfig, store_root: str) -> Iterator[FanOut]:
    """Make `cfg`'s backend the current fan-out for the duration (a flow's body); stop it after."""
    if cfg.type != "threads" and store_root.startswith("memory://"):
        raise UserError(
            f"flow.executor.type={cfg.type} needs a store its workers can open; {store_root} lives in this "
            "process's memory: use a local path or an object-store URL (s3://...)"
        )
    check_runner_package(cfg.type)
    fan_out = FanOut(cfg)
    token = _current.set(fan_out)
    try:
        yield fan_out
    finally:
        _current.reset(token)
        fan_out.close()
