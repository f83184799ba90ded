"""The command line: expected failures are one clear line and a non-zero exit, never a traceback.

Each refusal runs `rlvr` as a process, but for two config refusals: an `rlvr run` parses its config after importing
torch (~7 CPU-seconds a process), so the unknown key goes through a process and the wrong type and the missing file
through the same main() in this process (`rlvr_here`): its exit status and its stderr, as the process has them."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
import traceback

import pytest

from rlvr.storage.store import Store
from tests.cli_helpers import REPO, SMALL_RUN, cli_env, rlvr, rlvr_command


def rlvr_here(monkeypatch: pytest.MonkeyPatch, *args: str) -> subprocess.CompletedProcess:
    """`rlvr ARGS` by the command's main() in this process, as a finished process: its exit status, stdout and
    stderr (a bug's traceback appended, status 1). What the command sets up for itself in the process (the run's
    gc freeze, Prefect's settings, an import hook) is undone after."""
    from rlvr.flows.cli import commands

    monkeypatch.setattr(commands, "_started_as_rlvr", False)
    monkeypatch.setattr(sys, "argv", ["rlvr", *args])
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    environ = dict(os.environ)
    out, err = io.StringIO(), io.StringIO()
    status = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            commands.main()
    except SystemExit as exc:
        status = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1  # as the interpreter's
    except Exception as exc:  # a bug: shown as the process would show it
        err.write("".join(traceback.format_exception(exc)))
        status = 1
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return subprocess.CompletedProcess(["rlvr", *args], status, out.getvalue(), err.getvalue())


def assert_one_line_error(result, fragment: str) -> None:
    assert result.returncode != 0, result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr
    assert len(lines) == 1, result.stderr
    assert fragment in lines[0]


@pytest.fixture
def empty_store(tmp_path) -> str:
    root = str(tmp_path / "store")
    Store.open(root, create=True)
    return root


def test_unknown_config_key(tmp_path):
    result = rlvr("run", "--store", str(tmp_path / "s"), "--set", "trian.steps=1")
    assert_one_line_error(result, "unknown config key 'trian'")


def test_wrong_config_type(tmp_path, monkeypatch):
    result = rlvr_here(monkeypatch, "run", "--store", str(tmp_path / "s"), "--set", "train.steps=lots")
    assert_one_line_error(result, "config key 'train.steps': Input should be a valid integer")


def test_missing_config_file(tmp_path, monkeypatch):
    result = rlvr_here(monkeypatch, "run", "--store", str(tmp_path / "s"), "--config", str(tmp_path / "none.yaml"))
    assert_one_line_error(result, "does not exist")


def test_missing_store(tmp_path):
    result = rlvr("query", "SELECT 1", "--store", str(tmp_path / "absent"))
    assert_one_line_error(result, "no store at")


def test_unknown_run_id(empty_store):
    result = rlvr("resume", "no-such-run", "--store", empty_store)
    assert_one_line_error(result, "unknown run id 'no-such-run'")


def test_bad_sql_and_unknown_lineage_id(empty_store):
    assert_one_line_error(rlvr("query", "SELECT * FROM nowhere", "--store", empty_store), "query failed")
    assert_one_line_error(rlvr("lineage", "nothing-here", "--store", empty_store), "nothing-here")


def test_query_formats_on_empty_views(empty_store):
    result = rlvr("query", "SELECT count(*) AS n FROM rollouts", "--store", empty_store, "--format", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip()) == {"n": 0}
    result = rlvr("query", "SELECT 1 AS a, 'x' AS b", "--store", empty_store, "--format", "csv")
    assert result.stdout.splitlines() == ["a,b", "1,x"]


def test_progress_lines_are_plain_and_at_most_one_every_few_seconds():
    """Output that is not a terminal gets lines, not a bar: stage starts and ends at once, other events at most one
    every 5 s, the newest held-back one written before the stage ends (a step's line carrying its evaluation)."""
    from rlvr.flows.cli.common import ProgressLines

    now = [100.0]
    written = io.StringIO()
    lines = ProgressLines(written, steps=20, every=5.0, clock=lambda: now[0])
    events = [
        (0.0, "stage", {"name": "warmstart"}),
        (1.0, "eval", {"step": 0, "phase": "warmstart", "accuracy": 0.25}),
        (2.0, "shard", {"stage": "difficulty", "done": 1, "total": 3}),
        (3.0, "shard", {"stage": "difficulty", "done": 2, "total": 3}),
        (4.0, "shard", {"stage": "difficulty", "done": 3, "total": 3}),
        (7.0, "stage", {"name": "rl"}),
        (8.0, "step", {"step": 1, "reward": 0.5}),
        (9.0, "step", {"step": 2, "reward": 0.625}),
        (10.0, "warning", {"message": "slow"}),
        (12.0, "step", {"step": 3, "reward": 0.75}),
        (12.5, "eval", {"step": 3, "accuracy": 0.5}),
        (14.0, "step", {"step": 4, "reward": 1.0}),
        (15.0, "step", {"step": 5, "reward": 0.875}),
        (15.5, "eval", {"step": 5, "accuracy": 0.75}),
    ]
    for at, event, fields in events:
        now[0] = 100.0 + at
        lines.hear(event, fields)
    now[0] = 116.0
    lines.finish()
    assert written.getvalue().splitlines() == [
        "[0:00:00] warmstart",
        "[0:00:01] held-out accuracy 0.25 (warmstart)",
        "[0:00:02] warmstart done in 2 s",
        "[0:00:02] difficulty",
        "[0:00:07] difficulty: shard 3/3",  # shards 1 and 2 came within 5 s of the evaluation's line
        "[0:00:07] difficulty done in 5 s",
        "[0:00:07] rl",
        "[0:00:08] rl step 1/20: reward 0.50, held-out accuracy 0.25",
        "[0:00:10] warning: slow",
        "[0:00:14] rl step 4/20: reward 1.00, held-out accuracy 0.50",  # 6 s after step 1; steps 2 and 3 dropped
        "[0:00:16] rl step 5/20: reward 0.88, held-out accuracy 0.75",  # held back, and then evaluated
        "[0:00:16] rl done in 9 s",
    ]


@pytest.mark.slow
def test_a_run_piped_to_a_file_prints_plain_progress_lines_as_it_goes(tmp_path, prefect_api):
    """`rlvr run > log 2>&1` (a batch job, `| tee`): progress arrives while the run works, as plain lines with no
    control codes (a bar there would print nothing until the run ended). On the session's Prefect server: a
    temporary one (a user's first run; test_ui.py and test_child_processes.py start one) costs 13 CPU-seconds."""
    args = ["run", "--store", str(tmp_path / "store"), "--run-id", "piped"]
    for override in [*SMALL_RUN, "synthesize.source.per_category=10"]:  # 80 problems: every stage still runs
        args += ["--set", override]
    env = cli_env(PREFECT_API_URL=prefect_api)
    for forced in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):  # rich would draw its bar anyway
        env.pop(forced, None)
    arrived: list[tuple[float, bytes]] = []
    proc = subprocess.Popen(rlvr_command(*args), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    for line in iter(proc.stdout.readline, b""):  # bytes: a carriage return would show
        arrived.append((time.monotonic(), line))
    assert proc.wait(timeout=60) == 0, b"".join(line for _, line in arrived).decode()[-3000:]
    ended = time.monotonic()
    text = [line.decode() for _, line in arrived]
    assert not [line for line in text if "\x1b" in line or "\r" in line], text
    progress = [(at, line.decode().rstrip("\n").split("] ", 1)[1]) for at, line in arrived if line[:3] == b"[0:"]
    stages = [line for _, line in progress if " " not in line]
    assert stages == ["starting", "synthesize", "warmstart", "difficulty", "rl"], text
    assert any(re.fullmatch(r"rl step 2/2: reward \d\.\d\d, held-out accuracy \d\.\d\d", line) for _, line in progress)
    assert re.fullmatch(r"rl done in \d+ s", progress[-1][1]), text
    first = progress[0][0]
    assert ended - first > 3, f"the first progress line came {ended - first:.1f} s before the run ended"
    assert "run piped completed" in text[len(progress) + 1], text  # after a blank line: the summary
