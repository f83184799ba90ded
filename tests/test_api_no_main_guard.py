"""The Python API from a script without an `if __name__ == "__main__":` guard: verifier workers must not
re-import (and so re-run) the script. Each script runs in its own interpreter, as a user would run it; the two
runs of `execute` are one script's, one after the other (a sweep), so one interpreter's imports serve both."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlvr.storage.store import Store
from rlvr.storage.views import query
from tests.cli_helpers import cli_env

# One run of `execute` per (store, extra overrides) in argv[1] (JSON), each in its own store, in this order.
RUN = """
import json, os, sys
from rlvr.flows.config import load_config
from rlvr.flows.runs import execute

print("script body runs in", os.getpid(), flush=True)
for case, (root, extra) in enumerate(json.loads(sys.argv[1])):
    cfg = load_config(None, ["run_id=noguard", "train.steps=2", "warmstart.steps=0", "select.batch_size=4",
                             "allocate.n=4", "difficulty.k=2", "evaluate.every=2", "checkpoint.every=2",
                             "synthesize.source.per_category=4", "label.workers=2", *extra])
    summary = execute(root, cfg)
    fields = ("run_id", "accuracy_init", "accuracy_final", "final_checkpoint")
    print(f"SUMMARY{case} " + json.dumps({k: summary[k] for k in fields}), flush=True)
"""
EXTRAS = [(), ("flow.async_level=1",)]  # the second also starts the sampler process

# A verifier defined in the script itself: its workers would need the script.
OWN_VERIFIER = """
import json, os
from rlvr.verifiers.base import Score, Verifier
from rlvr.verifiers.pool import VerifierPool

print("script body runs in", os.getpid(), flush=True)


class Shout(Verifier):
    name = "shout"
    domain = "text"
    version = "1"

    def score(self, response, reference):
        ok = response == reference.upper()
        return Score(1.0 if ok else 0.0, "ok" if ok else "wrong", {"pid": os.getpid()})

{guard}
    with VerifierPool(Shout, workers=1, timeout_s=5.0) as pool:
        scores = pool.score_many([("HI", "hi"), ("hi", "hi")])
        print("RESULT " + json.dumps({"in_process": pool.in_process, "workers": len(pool.worker_pids()),
              "statuses": [s.status for s in scores], "pids": [s.components["pid"] for s in scores],
              "main_pid": os.getpid()}), flush=True)
"""


def run_script(tmp_path: Path, source: str, *args: str, env: dict[str, str] | None = None, timeout: float = 240):
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(source))
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=tmp_path,
        env=env or cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tagged(stdout: str, tag: str) -> dict:
    [line] = [line for line in stdout.splitlines() if line.startswith(tag + " ")]
    return json.loads(line[len(tag) + 1 :])


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory, prefect_api) -> tuple[subprocess.CompletedProcess, list[Path]]:
    """The script of RUN, run once for the module: a run for each of EXTRAS; its process and their stores."""
    folder = tmp_path_factory.mktemp("noguard")
    roots = [folder / f"store-{case}" for case in range(len(EXTRAS))]
    cases = json.dumps([[str(root), list(extra)] for root, extra in zip(roots, EXTRAS, strict=True)])
    return run_script(folder, RUN, cases, env=cli_env(PREFECT_API_URL=prefect_api), timeout=480), roots


@pytest.mark.slow
@pytest.mark.parametrize("extra", EXTRAS)
def test_execute_from_a_script_without_main_guard_finishes(script_runs, extra):
    done, roots = script_runs
    root = roots[EXTRAS.index(extra)]
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("script body runs in") == 1  # no worker (nor the sampler) re-ran the script
    assert "bootstrapping phase" not in done.stderr
    summary = tagged(done.stdout, f"SUMMARY{EXTRAS.index(extra)}")
    assert summary["run_id"] == "noguard"
    assert summary["accuracy_init"] is not None and summary["accuracy_final"] is not None
    store = Store.open(str(root))
    assert store.read_run("noguard")["status"] == "completed"
    evals = query(store, "SELECT phase, step FROM evals ORDER BY step").to_pylist()
    assert [(e["phase"], e["step"]) for e in evals] == [("init", 0), ("rl", 2)]
    [final] = query(store, "SELECT artifact_id FROM checkpoints WHERE step = 2").to_pylist()
    assert summary["final_checkpoint"] == final["artifact_id"]
    # the verifier workers really scored: 2 steps x 4 prompts x 4 rollouts, none of them a worker failure
    statuses = query(store, "SELECT status, count(*) AS n FROM rewards GROUP BY status").to_pylist()
    assert sum(s["n"] for s in statuses) == 32
    assert "error" not in {s["status"] for s in statuses}


def test_verifier_defined_in_an_unguarded_script_is_scored_in_process(tmp_path):
    done = run_script(tmp_path, OWN_VERIFIER.replace("{guard}", "if True:"), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = tagged(done.stdout, "RESULT")
    assert result["in_process"] is True and result["workers"] == 0
    assert result["statuses"] == ["ok", "wrong"]
    assert result["pids"] == [result["main_pid"]] * 2
    assert done.stdout.count("script body runs in") == 1
    assert "without the pool's hard timeout" in done.stderr


def test_verifier_defined_in_a_guarded_script_still_runs_in_workers(tmp_path):
    done = run_script(tmp_path, OWN_VERIFIER.replace("{guard}", 'if __name__ == "__main__":'), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = tagged(done.stdout, "RESULT")
    assert result["in_process"] is False and result["workers"] == 1
    assert result["statuses"] == ["ok", "wrong"]
    assert result["main_pid"] not in result["pids"]  # scored in the worker, which imported the script safely
    assert done.stdout.count("script body runs in") == 2  # the script, and the worker's guarded import of it
