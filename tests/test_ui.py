"""`rlvr ui`: Prefect's own server and UI over a store's run history (its Prefect database), read back here
through the Prefect API; and `rlvr schedule` without PREFECT_API_URL, which starts that server itself."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from rlvr.flows.ui import SERVER_FILE, free_port, healthy
from tests.cli_helpers import cli_env, rlvr, rlvr_command, wait_for
from tests.conftest import TINY_OVERRIDES

pytestmark = pytest.mark.slow


def user_env(**extra: str) -> dict[str, str]:
    """A user's shell: no Prefect home or server given, so a run records into the store's Prefect database."""
    env = cli_env(**extra)
    for key in ("PREFECT_HOME", "PREFECT_RESULTS_LOCAL_STORAGE_PATH", "PREFECT_API_URL"):
        env.pop(key, None)
    return env


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ui") / "store"
    overrides = [*TINY_OVERRIDES, "train.steps=2", "warmstart.steps=0", "synthesize.source.per_category=6"]
    sets = [arg for override in overrides for arg in ("--set", override)]
    result = rlvr("run", "--store", str(root), "--run-id", "demo", *sets, env=user_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert (root / "_prefect" / "prefect.db").is_file()
    return root


def start(args: list[str], log: Path, ready: str, timeout: float = 180) -> tuple[subprocess.Popen[bytes], str]:
    """Start an rlvr command that keeps running; wait for the line containing `ready`, return it."""
    with open(log, "wb") as out:
        process = subprocess.Popen(rlvr_command(*args), env=user_env(), stdout=out, stderr=subprocess.STDOUT)

    def ready_line() -> str | None:
        line = next((line for line in log.read_text().splitlines() if ready in line), None)
        assert line is not None or process.poll() is None, f"rlvr {args[0]} ended: {log.read_text()[-3000:]}"
        return line

    return process, wait_for(ready_line, timeout, f"{ready!r} from rlvr {args[0]}", log=log)


def stop(process: subprocess.Popen[bytes]) -> int:
    process.send_signal(signal.SIGTERM)
    return process.wait(timeout=60)


def post(api: str, path: str, body: dict) -> list[dict]:
    response = httpx.post(f"{api}{path}", json=body, timeout=30)
    response.raise_for_status()
    return list(response.json())


def test_rlvr_ui_serves_the_flow_and_task_runs_of_a_store(demo_store, tmp_path):
    port = free_port()
    ui, line = start(["ui", "--store", str(demo_store), "--port", str(port)], tmp_path / "ui.log", "Prefect UI for")
    try:
        url = f"http://127.0.0.1:{port}"
        assert url in line and str(demo_store / "_prefect" / "prefect.db") in line
        api = f"{url}/api"
        assert "<!DOCTYPE html>" in httpx.get(url, timeout=30).text  # the UI itself
        assert {"rl-run", "rl-steps"} <= {f["name"] for f in post(api, "/flows/filter", {})}
        runs = post(api, "/flow_runs/filter", {"flows": {"name": {"any_": ["rl-run"]}}})
        assert [(r["state_type"], r["parameters"]["cfg"]["run_id"]) for r in runs] == [("COMPLETED", "demo")]
        tasks = post(api, "/task_runs/filter", {"limit": 200})
        stages = {re.sub(r"-[0-9a-f]{3}$", "", t["name"]) for t in tasks}  # task run names: TASK-<3 hex>
        assert {"synthesize", "initialize", "evaluate", "difficulty", "rl-step", "checkpoint"} <= stages
        assert {t["state_type"] for t in tasks} == {"COMPLETED"}
        record = json.loads((demo_store / "_prefect" / SERVER_FILE).read_text())
        assert (record["url"], record["started_by"]) == (url, "rlvr ui")
        again = rlvr("ui", "--store", str(demo_store), env=user_env())  # a second `rlvr ui` finds it
        assert again.returncode == 0 and f"{url} (already running, started by rlvr ui)" in again.stdout
    finally:
        assert stop(ui) == 0
    assert not (demo_store / "_prefect" / SERVER_FILE).exists()
    assert not healthy(f"http://127.0.0.1:{port}")


def test_schedule_without_a_prefect_server_starts_the_stores_own(demo_store, tmp_path):
    args = ["schedule", "yearly", "--cron", "0 0 1 1 *", "--set", "train.steps=1", "--store", str(demo_store)]
    serving, _ = start(args, tmp_path / "schedule.log", "serving schedule yearly")
    try:
        record = json.loads((demo_store / "_prefect" / SERVER_FILE).read_text())
        assert record["started_by"] == "rlvr schedule yearly"
        api = f"{record['url']}/api"
        deployment = httpx.get(f"{api}/deployments/name/rlvr-pipeline/yearly", timeout=30).json()
        assert deployment["paused"] is False
        assert deployment["schedules"][0]["schedule"]["cron"] == "0 0 1 1 *"
        assert deployment["parameters"]["store"] == str(demo_store)
        assert deployment["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"
        ui = rlvr("ui", "--store", str(demo_store), env=user_env())
        assert f"{record['url']} (already running, started by rlvr schedule yearly)" in ui.stdout
        # Wide enough that no cell wraps: on an 80-column terminal the cron cell wraps at its spaces.
        listed = rlvr("schedule", "--list", "--store", str(demo_store), env=user_env(COLUMNS="200"))
        row = next(line for line in listed.stdout.splitlines() if "yearly" in line)
        assert re.search(r"cron '0 0 1 1 \*' \(UTC\).*active", row), listed.stdout
        paused = rlvr("schedule", "yearly", "--pause", "--store", str(demo_store), env=user_env())
        assert "schedule yearly paused" in paused.stdout, paused.stderr
        assert httpx.get(f"{api}/deployments/name/rlvr-pipeline/yearly", timeout=30).json()["paused"] is True
    finally:
        assert stop(serving) == 0, (tmp_path / "schedule.log").read_text()[-3000:]
    assert not (demo_store / "_prefect" / SERVER_FILE).exists()
    assert not healthy(record["url"])
