"""OpenLineage events: a real run with the file transport writes START/COMPLETE (and FAIL) events that
validate against the published OpenLineage schemas (tests/data/openlineage, no network) and name the
artifacts each stage read and wrote, with their row counts and columns; events are off by default, an
emission failure never fails a stage, and a slow transport never holds one up."""

from __future__ import annotations

import json
import logging
import threading
import uuid
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from rlvr.errors import UserError
from rlvr.flows import openlineage_events
from rlvr.flows.openlineage_events import OpenLineageConfig
from rlvr.storage.stage import Built, Output, Stage, failed_stage, run_stage
from rlvr.storage.store import Store
from tests.conftest import TINY_OVERRIDES

SCHEMAS = Path(__file__).parent / "data" / "openlineage"
CORE = "https://openlineage.io/spec/2-0-2/OpenLineage.json"


@pytest.fixture(scope="module")
def registry() -> Registry:
    resources = [Resource.from_contents(json.loads(p.read_text())) for p in sorted(SCHEMAS.rglob("*.json"))]
    return Registry().with_resources((r.contents["$id"], r) for r in resources)


def facets_of(event: dict) -> list[dict]:
    """Every facet in an event (run, job, and each dataset's facets, input facets and output facets)."""
    groups = [event["run"].get("facets", {}), event["job"].get("facets", {})]
    for dataset in event.get("inputs", []) + event.get("outputs", []):
        groups += [dataset.get("facets", {}), dataset.get("inputFacets", {}), dataset.get("outputFacets", {})]
    return [facet for group in groups for facet in group.values()]


def assert_valid(event: dict, registry: Registry) -> None:
    Draft202012Validator({"$ref": f"{CORE}#/$defs/RunEvent"}, registry=registry).validate(event)
    for facet in facets_of(event):  # each facet against the schema its _schemaURL names (all stored locally)
        Draft202012Validator({"$ref": facet["_schemaURL"]}, registry=registry).validate(facet)
    uuid.UUID(event["run"]["runId"])
    datetime.fromisoformat(event["eventTime"])


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tags(event: dict) -> dict[str, str]:
    return {t["key"]: t["value"] for t in event["run"]["facets"]["tags"]["tags"]}


@pytest.fixture(scope="module")
def lineage_run(tmp_path_factory, prefect_api):
    """A short real run (tiny model, 2 RL steps) whose events go to a file through the run config."""
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute

    tmp = tmp_path_factory.mktemp("openlineage")
    root, events = str(tmp / "store"), tmp / "events.jsonl"
    transport = ["type=file", f"log_file_path={events}", "append=true"]
    overrides = [*TINY_OVERRIDES, "train.steps=2", "warmstart.steps=0", "evaluate.every=2", "checkpoint.every=2"]
    overrides += ["synthesize.source.per_category=4", *(f"openlineage.transport.{t}" for t in transport)]
    execute(root, load_config(None, ["run_id=ol", *overrides]))
    return Store.open(root), read_events(events)


@pytest.mark.slow
def test_every_event_validates_against_the_openlineage_schema(lineage_run, registry):
    _, events = lineage_run
    assert len(events) > 20
    for event in events:
        assert_valid(event, registry)


@pytest.mark.slow
def test_each_stage_run_starts_and_completes_under_the_run(lineage_run):
    store, events = lineage_run
    assert (events[0]["job"]["name"], events[0]["eventType"]) == ("rlvr.rl_run", "START")
    assert (events[-1]["job"]["name"], events[-1]["eventType"]) == ("rlvr.rl_run", "COMPLETE")
    parent = events[0]["run"]["runId"]
    stage_events = events[1:-1]
    by_run: dict[str, list[str]] = {}
    for event in stage_events:
        by_run.setdefault(event["run"]["runId"], []).append(event["eventType"])
        assert event["run"]["facets"]["parent"]["run"]["runId"] == parent
        assert event["job"]["namespace"] == "rlvr"
    assert set(map(tuple, by_run.values())) == {("START", "COMPLETE")}
    completed = sorted(
        (e["job"]["name"], tags(e).get("rlvr.step")) for e in stage_events if e["eventType"] == "COMPLETE"
    )
    # every stage run that did work (its outputs are in the catalog) has its events, and nothing else has
    runs = {(m.stage, m.step) for m in store.manifests(run_id="ol")}
    expected = sorted((f"rlvr.{stage}", None if step is None else str(step)) for stage, step in runs)
    assert completed == expected
    # config, synthesize, initialize, evaluate, difficulty, 2 x 6 step stages, evaluate, checkpoint
    assert len(completed) == 19


@pytest.mark.slow
def test_label_event_names_rollouts_in_and_rewards_out_with_rows_and_columns(lineage_run):
    store, events = lineage_run
    [rollouts] = store.manifests(kind="rollouts", run_id="ol")[:1]
    [rewards] = [m for m in store.manifests(kind="rewards", run_id="ol") if m.step == rollouts.step]
    [problems] = store.manifests(kind="problems", run_id="ol")
    [done] = [
        e
        for e in events
        if e["job"]["name"] == "rlvr.label" and e["eventType"] == "COMPLETE" and tags(e)["rlvr.step"] == "1"
    ]
    namespace = Path(store.root).resolve().as_uri()
    inputs = {d["name"]: d for d in done["inputs"]}
    outputs = {d["name"]: d for d in done["outputs"]}
    assert set(inputs) == {rollouts.artifact_id, problems.artifact_id}
    assert rewards.artifact_id in outputs
    assert {d["namespace"] for d in done["inputs"] + done["outputs"]} == {namespace}
    assert inputs[rollouts.artifact_id]["inputFacets"]["inputStatistics"]["rowCount"] == rollouts.rows == 16
    assert outputs[rewards.artifact_id]["outputFacets"]["outputStatistics"]["rowCount"] == rewards.rows == 16
    columns = [f["name"] for f in outputs[rewards.artifact_id]["facets"]["schema"]["fields"]]
    assert columns == store.read_table(rewards.artifact_id).column_names
    types = {f["name"]: f["type"] for f in outputs[rewards.artifact_id]["facets"]["schema"]["fields"]}
    assert (types["score"], types["step"], types["status"]) == ("double", "int64", "string")
    assert tags(done)["rlvr.run_id"] == "ol"


# ----- one stage through the runner, no flow ----------------------------------------------------------


def _store(tmp_path: Path) -> Store:
    store = Store.open(str(tmp_path / "store"), create=True)
    store.write_artifact("notes", "notes-in", pa.table({"text": ["a", "b", "c"]}), **_common("seed"))
    return store


def _common(stage: str) -> dict:
    return dict(run_id="r1", stage=stage, parents=[], code_version="1", config={})


BROKEN: set[str] = set()  # runs whose copy build raises (the config stays the same, so the ids do too)


def _copy(inputs, cfg, ctx) -> Built:
    if ctx.run_id in BROKEN:
        raise RuntimeError("the build broke")
    return Built(inputs.table("notes").append_column("n", pa.array([1, 2, 3], pa.int64())))


COPY: Stage = Stage(
    name="copy",
    code_version="1",
    section=None,
    config=dict,
    inputs=("notes",),
    outputs={"copied": Output("copied_notes")},
    build=_copy,
)


@pytest.fixture
def no_client_config(monkeypatch, tmp_path):
    """No OpenLineage configuration anywhere: no variables, no openlineage.yml here or in ~/.openlineage."""
    for key in list(__import__("os").environ):
        if key.startswith("OPENLINEAGE"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    openlineage_events.forget_runs()
    yield
    openlineage_events.forget_runs()


def test_a_failing_stage_sends_fail_with_the_error_and_still_raises(tmp_path, registry, no_client_config):
    store = _store(tmp_path)
    events = tmp_path / "events.jsonl"
    transport = {"type": "file", "log_file_path": str(events), "append": True}
    openlineage_events.configure_run(store.root, "r1", OpenLineageConfig(transport=transport, namespace="team"))
    BROKEN.add("r1")
    with pytest.raises(RuntimeError, match="the build broke") as raised:
        run_stage(store, COPY, {}, run_id="r1", step=3, inputs={"notes": "notes-in"})
    BROKEN.discard("r1")
    assert failed_stage(raised.value) == ("copy", 3)
    openlineage_events.flush_events()
    start, fail = read_events(events)
    assert (start["eventType"], fail["eventType"]) == ("START", "FAIL")
    assert start["run"]["runId"] == fail["run"]["runId"]
    assert fail["job"] == {**fail["job"], "namespace": "team", "name": "rlvr.copy"}
    error = fail["run"]["facets"]["errorMessage"]
    assert error["message"] == "RuntimeError: the build broke"
    assert "_copy" in error["stackTrace"] and error["programmingLanguage"] == "python"
    assert [d["name"] for d in fail["inputs"]] == ["notes-in"]
    assert fail["inputs"][0]["inputFacets"]["inputStatistics"]["rowCount"] == 3
    for event in (start, fail):
        assert_valid(event, registry)

    # the same stage run redone (a resume) completes the OpenLineage run its failed attempt started
    done = run_stage(store, COPY, {}, run_id="r1", step=3, inputs={"notes": "notes-in"})
    openlineage_events.flush_events()
    _, _, start_again, complete = read_events(events)
    assert start_again["run"]["runId"] == complete["run"]["runId"] == start["run"]["runId"]
    [output] = complete["outputs"]
    assert output["name"] == done.id
    assert output["outputFacets"]["outputStatistics"]["rowCount"] == 3
    columns = [(f["name"], f["type"]) for f in output["facets"]["schema"]["fields"]]
    assert columns == [("text", "string"), ("n", "int64")]
    assert_valid(complete, registry)
    # a skipped (already committed) stage did no work and sends nothing
    assert run_stage(store, COPY, {}, run_id="r1", step=3, inputs={"notes": "notes-in"}).skipped
    openlineage_events.flush_events()
    assert len(read_events(events)) == 4


def test_off_by_default_and_on_through_the_clients_own_environment(tmp_path, monkeypatch, no_client_config):
    store = _store(tmp_path)
    assert openlineage_events.emitter_for(store.root, "r1", None) is None
    with monkeypatch.context() as patched:  # no configuration: no client is ever made
        patched.setattr(openlineage_events, "_make_client", lambda settings: pytest.fail("a client was made"))
        run_stage(store, COPY, {}, run_id="r1", step=1, inputs={"notes": "notes-in"})
    assert openlineage_events._emitters == {(store.root, "r1"): None}

    events = tmp_path / "env-events.jsonl"
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__TYPE", "file")
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__LOG_FILE_PATH", str(events))
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__APPEND", "true")
    openlineage_events.forget_runs()
    run_stage(store, COPY, {}, run_id="r1", step=2, inputs={"notes": "notes-in"})
    openlineage_events.flush_events()
    assert [e["eventType"] for e in read_events(events)] == ["START", "COMPLETE"]

    monkeypatch.setenv("OPENLINEAGE_DISABLED", "true")
    assert openlineage_events.emitter_for(store.root, "r1", None) is None


def test_emission_failure_is_a_warning_not_a_failed_stage(tmp_path, caplog, no_client_config):
    store = _store(tmp_path)
    unwritable = tmp_path / "no-such-dir" / "events.jsonl"
    settings = OpenLineageConfig(transport={"type": "file", "log_file_path": str(unwritable), "append": True})
    openlineage_events.configure_run(store.root, "r1", settings)
    with caplog.at_level(logging.WARNING, logger="rlvr.flows.openlineage_events"):
        result = run_stage(store, COPY, {}, run_id="r1", step=1, inputs={"notes": "notes-in"})
        openlineage_events.flush_events()  # the warning comes from the sending thread
    assert store.exists(result.id) and not result.skipped
    warnings = [r.getMessage() for r in caplog.records if "OpenLineage event not sent" in r.getMessage()]
    assert warnings and warnings[0].startswith("OpenLineage event not sent (1 so far)")


class GatedClient:
    """A transport that sends nothing until the test opens its gate, then records what it was given."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.sent: list[tuple[str, str]] = []

    def emit(self, event) -> None:
        assert self.gate.wait(timeout=30), "the gate was never opened: the caller waited on the transport"
        self.sent.append((event.job.name, event.eventType.value))

    def close(self, timeout: float = -1.0) -> bool:
        self.sent.append(("closed", ""))
        return True


def test_a_slow_transport_holds_up_no_stage_and_the_run_end_sends_every_event_in_order(
    tmp_path, monkeypatch, no_client_config
):
    store = _store(tmp_path)
    client = GatedClient()
    monkeypatch.setattr(openlineage_events, "_make_client", lambda settings: client)
    openlineage_events.configure_run(store.root, "r1", OpenLineageConfig(transport={"type": "console"}))
    openlineage_events.run_event(store.root, "r1", "START")
    try:
        for step in (1, 2):  # the transport is stuck on the first event: the stages go on regardless
            assert not run_stage(store, COPY, {}, run_id="r1", step=step, inputs={"notes": "notes-in"}).skipped
        assert client.sent == []
    finally:
        client.gate.set()
    openlineage_events.run_event(store.root, "r1", "COMPLETE")  # returns once everything is sent
    stage = [("rlvr.copy", "START"), ("rlvr.copy", "COMPLETE")]
    assert client.sent == [("rlvr.rl_run", "START"), *stage, *stage, ("rlvr.rl_run", "COMPLETE"), ("closed", "")]


def test_a_bad_transport_is_one_clear_error_before_the_run(tmp_path, no_client_config):
    with pytest.raises(UserError, match="openlineage.transport needs a type"):
        openlineage_events.emitter_for(str(tmp_path), "r1", OpenLineageConfig(transport={"url": "http://x"}))
    with pytest.raises(UserError, match="bad OpenLineage transport configuration"):
        openlineage_events.emitter_for(str(tmp_path), "r1", OpenLineageConfig(transport={"type": "carrier-pigeon"}))


def test_config_key_changes_no_artifact_id():
    from rlvr.flows.config import CONFIG, load_config

    plain = load_config(None, ["run_id=same"])
    with_events = load_config(None, ["run_id=same", "openlineage.transport.type=console"])
    ids = [CONFIG.output_ids("same", None, cfg, {}, {}) for cfg in (plain, with_events)]
    assert ids[0] == ids[1]
