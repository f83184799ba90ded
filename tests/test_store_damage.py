"""Damage to a store, as users meet it through the CLI: each kind gets one line naming the file and saying
what to do; `rlvr check` finds it; `rlvr resume` rebuilds what can be rebuilt (byte for byte) and says
what cannot. One real tiny run is made once, in this process, and copied for each case.

Where a case resumes a damaged copy only to see it rebuilt, the `rlvr resume` command runs in this process
(typer's CliRunner: the command's own code, its exit status and its stderr lines as a pipe gets them, without a
process's ~8 CPU-seconds of imports); the flipped-bytes case runs it as a subprocess, as a user does. The readers
(`check`, `query`, `runs`, `lineage`) and every refusal stay subprocesses: a refusal's one line is the process's
main() at work, and a reader in this process would share the resume's handle on the store (its manifest cache)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import traceback
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlvr.storage.manifest import Manifest
from rlvr.storage.store import Store
from tests.cli_helpers import REPO, cli_env, rlvr
from tests.conftest import TINY_OVERRIDES
from tests.fork_server import ForkServer

pytestmark = pytest.mark.slow

RUN = "hurt"


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory, prefect_api: str) -> Path:
    """The tiny run the cases copy, made in this process: they only read it (its process is not what they test)."""
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute

    root = tmp_path_factory.mktemp("damage") / "store"
    execute(str(root), load_config(None, [f"run_id={RUN}", *TINY_OVERRIDES]), new=True)
    return root


@pytest.fixture
def store(made: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(made, copy, ignore=shutil.ignore_patterns("_prefect"))
    return copy


def run_cli(*args: str, forks: ForkServer | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`rlvr ARGS`: forked by `forks` on the session's Prefect server, or without one a new interpreter with a
    temporary server of its own."""
    if forks is not None:
        return rlvr(*args, forks=forks, timeout=timeout)
    env = cli_env()
    env.pop("PREFECT_API_URL", None)
    return rlvr(*args, env=env, timeout=timeout)


def resume_here(run_id: str, store: Path | str) -> subprocess.CompletedProcess:
    """`rlvr resume RUN_ID --store STORE` run by the command's own code in this process (typer's CliRunner), as
    a finished process: its exit status, stdout and stderr (a bug's traceback appended to stderr)."""
    from rlvr.flows.cli import app

    args = ["resume", run_id, "--store", str(store)]
    result = CliRunner().invoke(app, args)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(["rlvr", *args], result.exit_code, result.stdout, stderr)


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def artifact(store: Path, kind: str, step: int | None = None) -> Manifest:
    found = Store.open(str(store)).manifests(kind=kind, run_id=RUN)
    return next(m for m in found if step is None or m.step == step)


def part_of(store: Path, manifest: Manifest) -> Path:
    return store / "artifacts" / manifest.kind / manifest.artifact_id / manifest.table_files[0]["path"]


def flip_byte(path: Path, offset: int = 60) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_bytes_are_found_and_resume_rebuilds_what_it_can(
    store: Path, made: Path, rlvr_forks: ForkServer
) -> None:
    rewards, rollouts = artifact(store, "rewards", 2), artifact(store, "rollouts", 3)
    flip_byte(part_of(store, rewards))
    flip_byte(part_of(store, rollouts))

    checked = run_cli("check", "--store", str(store))
    assert checked.returncode == 1
    report = " ".join(checked.stdout.split())  # the table wraps long cells
    assert "2 damaged" in report
    assert rewards.artifact_id in report and "rebuilds it" in report
    assert (
        rollouts.artifact_id in report
        and "cannot rebuild it: it needs the weights of the policy after step 2" in report
    )

    resumed = run_cli("resume", RUN, "--store", str(store), forks=rlvr_forks)
    assert resumed.returncode == 0, resumed.stderr
    # stderr is not a terminal here: each progress line, warnings too, starts with its clock ("[0:00:01] ")
    lines = [re.sub(r"^\[\d+:\d\d:\d\d\] ", "", line) for line in resumed.stderr.splitlines()]
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 2
    assert any(rewards.artifact_id in w and w.endswith("set aside, this run rebuilds it") for w in warnings)
    assert any(rollouts.artifact_id in w and "cannot be rebuilt: it needs the weights" in w for w in warnings)
    original = Store.open(str(made)).read_table(rewards.artifact_id)
    rebuilt = Store.open(str(store)).read_table(rewards.artifact_id)  # checked against its new manifest
    assert rebuilt.drop(["cache_hit"]).equals(original.drop(["cache_hit"]))
    hits = lambda table: sum(table.column("cache_hit").to_pylist())  # noqa: E731
    assert hits(rebuilt) > hits(original)  # what differs: its cacheable verdicts were in the reward cache
    again = run_cli("check", "--store", str(store))
    assert "1 damaged" in again.stdout and rollouts.artifact_id in " ".join(again.stdout.split())


def test_a_cut_part_is_one_line_on_query_and_rebuilt_by_resume(store: Path, prefect_api: str) -> None:
    evals = artifact(store, "evals", 0)
    part = part_of(store, evals)
    part.write_bytes(part.read_bytes()[:100])
    queried = run_cli("query", "SELECT phase, accuracy FROM evals", "--store", str(store))
    assert queried.returncode == 2
    (line,) = error_lines(queried.stderr)
    assert line.startswith("error: query failed:") and evals.artifact_id in line

    resumed = resume_here(RUN, store)
    assert resumed.returncode == 0, resumed.stderr
    assert f"evals {evals.artifact_id} (step 0) is damaged ({part}: 100 bytes where" in resumed.stderr
    assert hashlib.sha256(part.read_bytes()).hexdigest() == evals.table_files[0]["sha256"]
    assert run_cli("check", "--store", str(store)).returncode == 0


def test_unreadable_manifests_and_run_records_break_nothing_else(store: Path, prefect_api: str) -> None:
    difficulty = artifact(store, "difficulty")
    manifest = store / "manifests" / f"{difficulty.artifact_id}.json"
    manifest.write_bytes(b"\x00\xff half a manifest")
    ghost = store / "runs" / "ghost.json"
    ghost.write_bytes(b"\xff\xfe")

    # It names both tables those files feed (a query builds only the catalog tables it names).
    sql = "SELECT (SELECT count(*) FROM artifacts) AS n, (SELECT count(*) FROM runs) AS r"
    counted = run_cli("query", sql, "--store", str(store))
    assert counted.returncode == 0, counted.stderr
    warnings = sorted(counted.stderr.splitlines())  # one line per damaged file the views skipped
    assert len(warnings) == 2
    assert warnings[0].startswith(f"warning: skipped: manifest {manifest} is unreadable")
    assert warnings[1].startswith(f"warning: skipped: run record {ghost} is unreadable")
    listed = run_cli("runs", "--store", str(store))
    assert listed.returncode == 0 and RUN in listed.stdout
    assert next(line for line in listed.stderr.splitlines() if str(ghost) in line).startswith(
        "warning: skipped: run record"
    )
    lineage = run_cli("lineage", artifact(store, "train_steps", 6).artifact_id, "--store", str(store))
    assert lineage.returncode == 0 and f"manifest {manifest} is unreadable" in lineage.stderr

    record = store / "runs" / f"{RUN}.json"
    record.write_text("{not json")
    resumed = resume_here(RUN, store)
    assert resumed.returncode == 0, resumed.stderr
    assert f"difficulty {difficulty.artifact_id} is damaged" in resumed.stderr
    assert json.loads(manifest.read_text())["artifact_id"] == difficulty.artifact_id  # rebuilt
    assert json.loads(record.read_text())["status"] == "completed"  # rewritten from the config artifact


def test_a_damaged_prefect_database_is_one_line_at_once(store: Path) -> None:
    database = store / "_prefect" / "prefect.db"
    database.parent.mkdir(exist_ok=True)
    database.write_bytes(b"this is not SQLite" * 100)
    started = run_cli("run", "--store", str(store), "--run-id", "another", timeout=120)
    assert started.returncode == 2
    assert started.stderr.strip().splitlines() == [
        f"error: Prefect's database {database} is damaged (file is not a database); it holds only Prefect's run "
        f"history, which no run needs: move it away (mv {database} {database}.damaged) and run the command again"
    ]


def test_a_missing_model_is_one_line_before_any_stage(tmp_path: Path) -> None:
    root = tmp_path / "fresh"
    started = run_cli("run", "--store", str(root), "--set", "policy.model=./no/such/model", timeout=120)
    assert started.returncode == 2
    assert started.stderr.strip().splitlines() == [
        "error: policy.model './no/such/model' is neither a model directory here nor a model in the local Hugging "
        "Face cache, and this machine does not download from the hub; set policy.model to 'tiny' or to an existing "
        "Hugging Face model directory"
    ]
    assert not (root / "manifests").exists()


def test_data_with_no_problems_is_one_line(tmp_path: Path, prefect_api: str, rlvr_forks: ForkServer) -> None:
    root = str(tmp_path / "data")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    refused = run_cli("data", "--input", str(empty), "--store", root, "--verifier", "math", forks=rlvr_forks)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"error: input '{empty}' is empty: there is nothing to read"
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(3)))  # no reference
    made = run_cli("data", "--input", str(bad), "--store", root, "--verifier", "math", "--run-id", "bad",
                   forks=rlvr_forks)  # fmt: skip
    assert made.returncode == 2
    (line,) = error_lines(made.stderr)
    assert line.startswith("error: run 'bad' has no problems to train on: of 3 rows read, 3 were quarantined")
    # Refused before the config loads every stage: with no torch to import, it is still that one line (in a second,
    # not after ~7 CPU-seconds of imports).
    no_torch = tmp_path / "no_torch" / "torch"
    no_torch.mkdir(parents=True)
    (no_torch / "__init__.py").write_text('raise ImportError("a refused run imported torch")\n')
    path = os.pathsep.join([str(no_torch.parent), str(REPO)])
    trained = rlvr("run", "--data", "bad", "--store", root, env=cli_env(PREFECT_API_URL=prefect_api, PYTHONPATH=path))
    assert trained.returncode == 2 and len(error_lines(trained.stderr)) == 1


def _mount_tmpfs(target: Path, size: str) -> bool:
    target.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)]).returncode == 0


def test_a_full_disk_is_one_line_and_the_run_resumes(tmp_path: Path, rlvr_forks: ForkServer) -> None:
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "1500k"):
        pytest.skip("a small tmpfs could not be mounted (needs root and mount)")
    try:
        root = str(disk / "store")
        args = ["run", "--store", root, "--run-id", "full"]
        for override in TINY_OVERRIDES:
            args += ["--set", override]
        stopped = run_cli(*args, forks=rlvr_forks)
        assert stopped.returncode == 2
        (line,) = error_lines(stopped.stderr)
        assert line.startswith("error: run 'full' stopped: no space left on the device")
        assert line.endswith(f"`rlvr resume full --store {root}` continues from there")
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        resumed = resume_here("full", root)
        assert resumed.returncode == 0, resumed.stderr
        assert run_cli("check", "--store", root).returncode == 0
    finally:
        subprocess.run(["umount", "-l", str(disk)])
