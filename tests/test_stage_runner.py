"""The stage runner: a stage defined here, with two outputs and carried state, gets ids, skip, commit,
resume, progress, timings and the Prefect wrapper from the runner alone."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from pydantic import BaseModel, ConfigDict

from rlvr.storage.stage import (
    Built,
    Inputs,
    Output,
    Sharded,
    Stage,
    StageContext,
    StageRun,
    on_stage_run,
    run_stage,
)
from rlvr.storage.store import Store
from rlvr.storage.views import query


class SplitConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scale: int = 1


calls: list[int | None] = []


def split_numbers(inputs: Inputs, cfg: SplitConfig, ctx: StageContext) -> dict[str, Built]:
    """Evens and odds of the input numbers (times `scale`); the state adds up every number seen."""
    calls.append(ctx.step)
    numbers = [row["n"] * cfg.scale for row in inputs.rows("numbers")]
    total = (ctx.state or {}).get("total", 0) + sum(numbers)
    return {
        "evens": Built(pa.table({"n": [n for n in numbers if n % 2 == 0]}), state={"total": total}),
        "odds": Built(pa.table({"n": [n for n in numbers if n % 2]})),
    }


SPLIT: Stage[SplitConfig] = Stage(
    name="split",
    code_version="1",
    section=None,
    config=SplitConfig,
    inputs=("state", "numbers"),
    outputs={"evens": Output("test_evens"), "odds": Output("test_odds")},
    build=split_numbers,
    carries_state=True,
)


@pytest.fixture
def store(tmp_path) -> Store:
    return Store.open(str(tmp_path / "store"), create=True)


def numbers_artifact(store: Store, values: list[int], name: str = "numbers-1") -> str:
    store.write_artifact(
        "test_numbers", name, pa.table({"n": values}), run_id="r", stage="test", parents=[], code_version="1", config={}
    )
    return name


def run_split(store: Store, step: int, numbers: str, state: str | None, scale: int = 1) -> StageRun:
    return run_stage(
        store, SPLIT, SplitConfig(scale=scale), run_id="r", step=step, inputs={"state": state, "numbers": numbers}
    )


def test_commit_then_skip_with_the_same_ids(store):
    calls.clear()
    numbers = numbers_artifact(store, [1, 2, 3, 4, 5])
    first = run_split(store, 1, numbers, None)
    assert not first.skipped and calls == [1]
    assert store.read_table(first["evens"]).column("n").to_pylist() == [2, 4]
    assert store.read_table(first["odds"]).column("n").to_pylist() == [1, 3, 5]
    assert store.manifest(first["odds"]).parents == [numbers]
    again = run_split(store, 1, numbers, None)
    assert again.skipped and again.ids == first.ids and calls == [1]
    other = run_split(store, 1, numbers, None, scale=3)  # config that affects the outputs: new ids
    assert set(other.ids.values()).isdisjoint(first.ids.values())


def test_state_is_carried_from_step_to_step(store):
    numbers = numbers_artifact(store, [1, 2, 3])
    step1 = run_split(store, 1, numbers, None)
    step2 = run_split(store, 2, numbers, step1["evens"])
    step3 = run_split(store, 3, numbers, step2["evens"])
    totals = [store.manifest(s["evens"]).extra["state"]["total"] for s in (step1, step2, step3)]
    assert totals == [6, 12, 18]
    assert store.manifest(step3["evens"]).parents == [step2["evens"], numbers]


def test_resume_after_a_crash_between_two_outputs(store, monkeypatch):
    numbers = numbers_artifact(store, [7, 8])
    write = Store.write_artifact

    def crash_on_odds(self, kind, *args, **kwargs):
        if kind == "test_odds":
            raise KeyboardInterrupt("killed between the two commits")
        return write(self, kind, *args, **kwargs)

    monkeypatch.setattr(Store, "write_artifact", crash_on_odds)
    with pytest.raises(KeyboardInterrupt):
        run_split(store, 1, numbers, None)
    monkeypatch.setattr(Store, "write_artifact", write)
    evens = [m for m in store.manifests(kind="test_evens")]
    assert len(evens) == 1 and not store.manifests(kind="test_odds")
    committed_at = evens[0].created_at
    resumed = run_split(store, 1, numbers, None)
    assert not resumed.skipped  # one durable output was missing, so the stage ran again
    assert store.manifest(resumed["evens"]).created_at == committed_at  # the committed one was kept
    assert store.read_table(resumed["odds"]).column("n").to_pylist() == [7]
    assert run_split(store, 1, numbers, None).skipped


def test_progress_events_and_the_stage_runs_view(store):
    seen: list[StageRun] = []
    stop = on_stage_run(seen.append)
    try:
        numbers = numbers_artifact(store, [1, 2])
        first = run_split(store, 1, numbers, None)
        run_split(store, 1, numbers, None)
    finally:
        stop()
    assert [(r.stage, r.step, r.skipped) for r in seen] == [("split", 1, False), ("split", 1, True)]
    assert seen[0].build_seconds >= 0 and seen[0].commit_seconds > 0
    rows = query(
        store, "SELECT stage, step, outputs, rows, read_seconds, build_seconds, commit_seconds FROM stage_runs"
    ).to_pylist()
    assert len(rows) == 1
    assert rows[0]["stage"] == "split" and rows[0]["step"] == 1 and rows[0]["rows"] == 2
    assert sorted(rows[0]["outputs"]) == sorted(first.ids.values())
    assert rows[0]["commit_seconds"] > 0 and rows[0]["read_seconds"] >= 0


def test_execution_params_are_part_of_no_id():
    """Where the units run (`fan_out`, storage/stage.py's EXECUTION_PARAMS) changes no id; other params do."""
    ids = lambda params: SPLIT.output_ids("r", 1, SplitConfig(), params, {"numbers": "numbers-1"})  # noqa: E731
    assert ids({"fan_out": map}) == ids({})
    assert ids({"fan_out": map, "phase": "rl"}) == ids({"phase": "rl"}) != ids({})


def test_build_runs_without_a_store():
    ctx = StageContext(run_id="r", seed=0, step=1, stage="split", input_ids={}, output_ids={}, state={"total": 10})
    built = split_numbers(Inputs.given(numbers=pa.table({"n": [3, 4]})), SplitConfig(scale=2), ctx)
    assert built["evens"].table.column("n").to_pylist() == [6, 8]
    assert built["evens"].state == {"total": 24}


made: list[int] = []
crash_at: list[int] = []


def squares(inputs: Inputs, cfg: SplitConfig, ctx: StageContext) -> Sharded:
    def make(index: int) -> pa.Table:
        made.append(index)
        if index in crash_at:
            raise KeyboardInterrupt(f"killed in shard {index}")
        return pa.table({"n": [index * index]})

    return Sharded(count=4, make=make)


SQUARES: Stage[SplitConfig] = Stage(
    name="squares",
    code_version="1",
    section=None,
    config=SplitConfig,
    inputs=(),
    outputs={"squares": Output("test_squares", sharded=True)},
    build=squares,
)


def test_sharded_output_resumes_from_committed_shards(store):
    made.clear()
    crash_at[:] = [2]
    with pytest.raises(KeyboardInterrupt):
        run_stage(store, SQUARES, SplitConfig(), run_id="r")
    assert made == [0, 1, 2] and not store.manifests(kind="test_squares")
    made.clear()
    crash_at.clear()
    done = run_stage(store, SQUARES, SplitConfig(), run_id="r")
    assert made == [2, 3]  # shards 0 and 1 were committed before the crash
    assert store.read_table(done.id).column("n").to_pylist() == [0, 1, 4, 9]


def squares_and_total(inputs: Inputs, cfg: SplitConfig, ctx: StageContext) -> dict[str, Sharded]:
    """Two sharded outputs, the second made from what the first's shards made in this process."""
    seen: list[int] = []

    def total(index: int) -> pa.Table:
        made.append(-1)
        if -1 in crash_at:
            raise KeyboardInterrupt("killed in the total")
        return pa.table({"n": [sum(seen)]})

    square = squares(inputs, cfg, ctx)

    def seen_square(index: int) -> pa.Table:
        seen.append(index * index)
        return square.make(index)

    return {"squares": Sharded(count=4, make=seen_square), "total": Sharded(count=1, make=total)}


SQUARES_AND_TOTAL: Stage[SplitConfig] = Stage(
    name="squares_and_total",
    code_version="1",
    section=None,
    config=SplitConfig,
    inputs=(),
    outputs={"squares": Output("test_squares", sharded=True), "total": Output("test_total", sharded=True)},
    build=squares_and_total,
)


def test_a_sharded_output_committed_before_a_crash_is_not_made_again(store):
    made.clear()
    crash_at[:] = [-1]  # killed after the squares' manifest, in the second output
    with pytest.raises(KeyboardInterrupt):
        run_stage(store, SQUARES_AND_TOTAL, SplitConfig(), run_id="r")
    assert made == [0, 1, 2, 3, -1] and len(store.manifests(kind="test_squares")) == 1
    made.clear()
    crash_at.clear()
    done = run_stage(store, SQUARES_AND_TOTAL, SplitConfig(), run_id="r")
    assert made == [-1]  # the squares stand as committed: a stage whose second output needs them makes them again
    assert store.read_table(done["squares"]).column("n").to_pylist() == [0, 1, 4, 9]
    assert store.read_table(done["total"]).column("n").to_pylist() == [0]
    assert run_stage(store, SQUARES_AND_TOTAL, SplitConfig(), run_id="r").skipped


def keep_latest(inputs: Inputs, cfg: SplitConfig, ctx: StageContext) -> dict[str, Built]:
    return {"state": Built(pa.table({"step": [ctx.step]})), "log": Built(pa.table({"step": [ctx.step]}))}


LATEST: Stage[SplitConfig] = Stage(
    name="latest",
    code_version="1",
    section=None,
    config=SplitConfig,
    inputs=(),
    outputs={"state": Output("test_state", transient=True), "log": Output("test_log")},
    build=keep_latest,
)


def test_only_the_newest_transient_output_is_kept(store):
    runs = [run_stage(store, LATEST, SplitConfig(), run_id="r", step=step) for step in (1, 2, 3)]
    assert [m.artifact_id for m in store.manifests(kind="test_state")] == [runs[-1]["state"]]
    assert len(store.manifests(kind="test_log")) == 3
    # a durable output that exists is enough to skip, even though its transient sibling is gone
    assert run_stage(store, LATEST, SplitConfig(), run_id="r", step=1).skipped


def test_declarations_are_checked():
    with pytest.raises(ValueError, match="carries state, so it needs an input named 'state'"):
        Stage(
            name="x",
            code_version="1",
            section=None,
            config=SplitConfig,
            inputs=(),
            outputs={"a": Output("a")},
            build=split_numbers,
            carries_state=True,
        )
    with pytest.raises(ValueError, match="declare transient output 'b' before durable ones"):
        Stage(
            name="x",
            code_version="1",
            section=None,
            config=SplitConfig,
            inputs=(),
            outputs={"a": Output("a"), "b": Output("b", transient=True)},
            build=split_numbers,
        )


def test_unknown_input_names_are_refused(store):
    with pytest.raises(ValueError, match="has no inputs \\['number'\\]"):
        run_stage(store, SPLIT, SplitConfig(), run_id="r", inputs={"number": "x"})


in_task: list[Any] = []


def where_am_i(inputs: Inputs, cfg: SplitConfig, ctx: StageContext) -> Built:
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    in_task.append(context.task_run.name if context else None)
    return Built(pa.table({"step": [ctx.step]}))


WHERE: Stage[SplitConfig] = Stage(
    name="where",
    code_version="1",
    section=None,
    config=SplitConfig,
    inputs=(),
    outputs={"log": Output("test_where")},
    build=where_am_i,
)


@pytest.mark.slow
def test_prefect_task_per_stage_unless_inside_a_task(tmp_path, prefect_api):
    from prefect import flow, task

    from rlvr.flows.stages import RunContext, run

    root = str(tmp_path / "store")
    Store.open(root, create=True)

    @task
    def step_task(step: int) -> str:
        return run(WHERE, SplitConfig(), RunContext(root, "r", step=step)).id

    @flow
    def pipeline() -> list[str]:
        return [run(WHERE, SplitConfig(), RunContext(root, "r", step=1)).id, step_task(2)]

    in_task.clear()
    ids = pipeline()
    assert in_task[0].startswith("where") and in_task[1].startswith("step_task")
    assert len(set(ids)) == 2


def test_an_input_may_name_several_artifacts_of_one_kind(store):
    first, second = numbers_artifact(store, [1, 2], "numbers-a"), numbers_artifact(store, [3, 4], "numbers-b")
    both = run_stage(
        store, SPLIT, SplitConfig(), run_id="r", step=1, inputs={"state": None, "numbers": [first, second]}
    )
    assert store.read_table(both["evens"]).column("n").to_pylist() == [2, 4]  # read as one table, in order
    assert store.manifest(both["odds"]).parents == [first, second]
    one = run_stage(store, SPLIT, SplitConfig(), run_id="r", step=1, inputs={"state": None, "numbers": [first]})
    assert one.ids == run_split(store, 1, first, None).ids  # a list of one is that one id
    with pytest.raises(ValueError, match="names 2 artifacts; read it with table"):
        Inputs(store, {"numbers": [first, second]}).id("numbers")
