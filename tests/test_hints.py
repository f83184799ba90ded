"""GHPO's hints: the schedule (grow while all wrong, shrink once there is signal), the hinted prompt, the
solutions the sources give, and a real run whose selections and rollouts follow the schedule while its
evaluation never sees a hint."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlvr.curricula.hints import (
    GroupOutcome,
    HintConfig,
    hint_prefix,
    hinted_prompt,
    level_of,
    next_levels,
    ratio_of,
    start_levels,
)
from rlvr.data.validate import Validator
from rlvr.verifiers.arithmetic import worked_solution

CFG = HintConfig(enabled=True)


def outcome(slot: int, problem: str, correct: bool) -> GroupOutcome:
    return GroupOutcome(slot, problem, correct)


def test_levels_grow_while_all_wrong_and_stop_at_the_last_ratio() -> None:
    levels: dict[str, int] = {}
    seen = []
    for _ in range(5):
        levels = next_levels(levels, [outcome(0, "p", False)], {"p"}, CFG)
        seen.append(ratio_of(levels.get("p", 0), CFG))
    assert seen == [0.25, 0.5, 0.75, 0.75, 0.75]


def test_levels_shrink_once_a_group_has_a_correct_sample() -> None:
    levels = {"p": 3, "q": 1}
    levels = next_levels(levels, [outcome(0, "p", True), outcome(1, "q", True)], {"p", "q"}, CFG)
    assert levels == {"p": 2}  # level 0 is not stored
    levels = next_levels(levels, [outcome(0, "p", True)], {"p"}, CFG)
    assert levels == {"p": 1}
    levels = next_levels(levels, [outcome(0, "p", False)], {"p"}, CFG)
    assert levels == {"p": 2}


def test_levels_follow_slot_order_and_skip_problems_without_a_solution() -> None:
    """Two groups of one problem in a step move it twice, in slot order; no solution, no hint."""
    outcomes = [outcome(1, "p", True), outcome(0, "p", False), outcome(2, "x", False)]
    assert next_levels({}, outcomes, {"p"}, CFG) == {}  # up at slot 0, down at slot 1
    assert next_levels({}, list(reversed(outcomes[:2])), {"p"}, CFG) == {}
    assert next_levels({"p": 1}, [outcome(0, "p", False), outcome(1, "p", False)], {"p"}, CFG) == {"p": 3}


def test_hint_prefix_takes_whole_words() -> None:
    solution = "37 * 48 = 37 * 40 + 37 * 8 = 1480 + 296 = 1776. The answer is 1776."  # 21 words
    assert hint_prefix(solution, 0.25) == "37 * 48 = 37 *"  # ceil(5.25) = 6 words
    assert hint_prefix(solution, 0.5) == "37 * 48 = 37 * 40 + 37 * 8"  # 11
    assert hint_prefix(solution, 1.0) == solution
    assert hint_prefix(solution, 0.0) == ""


def test_hinted_prompt_is_the_prompt_without_a_hint() -> None:
    assert hinted_prompt("2+3=", "2 + 3 = 5. The answer is 5.", 0.0, CFG) == "2+3="
    assert hinted_prompt("2+3=", None, 0.75, CFG) == "2+3="
    custom = HintConfig(enabled=True, template="{prompt} [{hint}]")
    assert hinted_prompt("2+3=", "2 + 3 = 5. The answer is 5.", 0.5, custom) == "2+3= [2 + 3 = 5.]"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"ratios": (0.5, 0.25)}, "hint ratios must be increasing shares in (0, 1], got [0.5, 0.25]"),
        ({"ratios": (0.0, 0.5)}, "hint ratios must be increasing shares in (0, 1]"),
        ({"template": "{prompt} only"}, "the hint template needs both {prompt} and {hint}"),
    ],
)
def test_hint_config_errors(fields, message) -> None:
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        HintConfig(**fields)


def test_worked_solutions_of_the_arithmetic_generator() -> None:
    assert worked_solution([37, 48], ["*"]) == "37 * 48 = 37 * 40 + 37 * 8 = 1480 + 296 = 1776. The answer is 1776."
    assert worked_solution([2, 3, 4], ["+", "*"]) == "3 * 4 = 12. 2 + 12 = 2 + 10 + 2 = 12 + 2 = 14. The answer is 14."
    assert worked_solution([52, 38], ["-"]) == "52 - 38 = 52 - 30 - 8 = 22 - 8 = 14. The answer is 14."
    assert worked_solution([5, 40], ["+"]) == "5 + 40 = 45. The answer is 45."


def test_a_solution_that_is_not_text_is_quarantined() -> None:
    validator = Validator("src", "arithmetic", 1000)
    rejected = validator.check({"source_index": 0, "prompt": "2+3=", "answer": "5", "solution": ["x"]})
    assert (rejected.check, rejected.reason) == ("solution", "solution must be text, got list")
    accepted = validator.check({"source_index": 1, "prompt": "2+4=", "answer": "6", "solution": "2 + 4 = 6."})
    assert accepted.solution == "2 + 4 = 6."


# ---------------------------------------------------------------------------------------------
# A real run with hints on


def test_from_difficulty_starts_unsolved_problems_at_level_1() -> None:
    """A problem the difficulty pass never saw solved starts at level 1 (with a solution to hint from); once it
    has had a group its carried level replaces the start, level 0 included."""
    cfg = HintConfig(enabled=True, from_difficulty=True)
    rates = {"p": 0.0, "q": 0.5, "r": 0.0, "s": None}
    start = start_levels(rates, {"p", "q", "s"}, cfg)
    assert start == {"p": 1}  # r has no solution, s was never estimated
    assert start_levels(rates, {"p", "q", "s"}, CFG) == {}  # off by default
    assert next_levels({}, [outcome(0, "p", False)], {"p"}, cfg, start) == {"p": 2}
    solved = next_levels({}, [outcome(0, "p", True)], {"p"}, cfg, start)
    assert solved == {"p": 0} and level_of("p", solved, start) == 0  # stored, so it does not start over at 1
    assert level_of("p", {}, start) == 1 and level_of("q", {}, start) == 0


GHPO_RUN = [
    "train.steps=8",
    "select.batch_size=4",
    "allocate.n=4",
    "warmstart.steps=30",
    "difficulty.k=2",
    "evaluate.every=4",
    "checkpoint.every=8",
    "select.hints.enabled=true",
    "synthesize.source.type=arithmetic",
    "synthesize.source.count=16",
]


def ghpo_run(root: str, run_id: str, *extra: str):
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute
    from rlvr.storage.store import Store

    execute(root, load_config(None, [f"run_id={run_id}", *GHPO_RUN, *extra]))
    return Store.open(root)


@pytest.fixture(scope="module")
def from_difficulty_run(tmp_path_factory, prefect_api):
    return ghpo_run(str(tmp_path_factory.mktemp("ghpo-start")), "start", "select.hints.from_difficulty=true")


@pytest.fixture(scope="module")
def hinted_run(tmp_path_factory, prefect_api):
    return ghpo_run(str(tmp_path_factory.mktemp("ghpo")), "ghpo")


def rows(store, sql: str) -> list[dict]:
    from rlvr.storage.views import query

    return query(store, sql).to_pylist()


def replay_levels(store, start: dict[str, int]) -> tuple[int, int]:
    """Replay the hint schedule by hand from the store: each pick's hint ratio is its problem's level before the
    step (`start` before its first group), and the level moves up after an all-wrong group, down after one with
    a correct sample. Returns how many groups raised a level and how many picks were hinted."""
    picks = rows(store, "SELECT step, slot, problem_id, hint_ratio FROM selections ORDER BY step, slot")
    groups = rows(
        store,
        "SELECT r.step, r.slot, r.problem_id, bool_or(w.status = 'ok') AS any_correct FROM rollouts r "
        "JOIN rewards w USING (rollout_id) GROUP BY ALL ORDER BY r.step, r.slot",
    )
    ratios, level, grew = [0.0, 0.25, 0.5, 0.75], dict(start), 0
    for step in sorted({p["step"] for p in picks}):
        for pick in (p for p in picks if p["step"] == step):
            assert pick["hint_ratio"] == ratios[level.get(pick["problem_id"], 0)], pick
        for group in (g for g in groups if g["step"] == step):
            before = level.get(group["problem_id"], 0)
            level[group["problem_id"]] = max(before - 1, 0) if group["any_correct"] else min(before + 1, 3)
            grew += level[group["problem_id"]] > before
    return grew, sum(p["hint_ratio"] > 0 for p in picks)


@pytest.mark.slow
def test_selections_follow_the_schedule_over_the_run(hinted_run) -> None:
    grew, hinted = replay_levels(hinted_run, {})
    assert grew > 0 and hinted > 0


@pytest.mark.slow
def test_from_difficulty_hints_the_first_draw_of_unsolved_problems(from_difficulty_run) -> None:
    """Every problem the difficulty pass never solved starts at level 1, so its first pick is hinted."""
    unsolved = rows(from_difficulty_run, "SELECT problem_id FROM difficulty WHERE pass_rate = 0")
    assert unsolved
    start = {row["problem_id"]: 1 for row in unsolved}  # the arithmetic generator writes every solution
    _, hinted = replay_levels(from_difficulty_run, start)
    first = rows(
        from_difficulty_run,
        "SELECT problem_id, arg_min(hint_ratio, step * 1000 + slot) AS first FROM selections GROUP BY problem_id",
    )
    assert all(row["first"] == 0.25 for row in first if row["problem_id"] in start)
    assert any(row["problem_id"] in start for row in first) and hinted > 0


@pytest.mark.slow
def test_rollouts_show_the_hint_their_selection_gave(hinted_run) -> None:
    found = rows(
        hinted_run,
        "SELECT r.prompt, r.hint_ratio, s.hint_ratio AS picked, p.prompt AS own, p.solution FROM rollouts r "
        "JOIN selections s USING (step, slot) JOIN problems p ON p.problem_id = r.problem_id",
    )
    assert {r["hint_ratio"] for r in found} >= {0.0, 0.25}
    for r in found:
        assert r["hint_ratio"] == r["picked"]
        assert r["prompt"] == hinted_prompt(r["own"], r["solution"], r["hint_ratio"], CFG)
        assert (r["prompt"] != r["own"]) == (r["hint_ratio"] > 0)


@pytest.mark.slow
def test_evaluation_never_sees_a_hint(hinted_run) -> None:
    """The evaluations read the policy and the problems only (not the selections or the selection state that
    hold the hints), and the problems' prompts carry none."""
    parents = rows(
        hinted_run,
        "SELECT DISTINCT a.kind FROM lineage l JOIN artifacts e ON e.artifact_id = l.child_id "
        "JOIN artifacts a ON a.artifact_id = l.parent_id WHERE e.kind = 'evals'",
    )
    assert {p["kind"] for p in parents} <= {"problems", "checkpoints", "train_steps"}
    assert rows(hinted_run, "SELECT count(*) AS n FROM problems WHERE prompt LIKE '%beginning of a solution%'") == [
        {"n": 0}
    ]
    assert rows(hinted_run, "SELECT count(*) AS n FROM evals WHERE phase = 'rl'") == [{"n": 2}]


def test_solutions_of_a_table_with_and_without_the_column() -> None:
    import pyarrow as pa

    from rlvr.curricula.hints import solutions_of

    with_column = pa.table({"problem_id": ["a", "b", "c"], "solution": ["2 + 3 = 5.", None, ""]})
    assert solutions_of(with_column) == {"a": "2 + 3 = 5."}
    assert solutions_of(pa.table({"problem_id": ["a"], "prompt": ["2+3="]})) == {}  # a table from before the column


def test_a_run_whose_problems_have_no_solution_is_warned(tmp_path) -> None:
    """What the progress display shows (a `warning` event), once, and only with hints on."""
    from rlvr.flows.config import load_config
    from rlvr.flows.rl_run import _warn_without_solutions
    from rlvr.progress import listen, stop_listening
    from rlvr.storage.stage import rows_to_table
    from rlvr.storage.store import Store

    store = Store.open(str(tmp_path / "store"), create=True)
    table = rows_to_table("problems", [{"problem_id": "a", "prompt": "2+3="}, {"problem_id": "b", "prompt": "4+4="}])
    common = {"run_id": "r", "code_version": "1", "config": {}, "stage": "data", "parents": []}
    store.write_artifact("problems", "problems-plain", table, **common)
    seen: list[tuple[str, dict]] = []
    listener = lambda event, fields: seen.append((event, fields))  # noqa: E731
    listen(listener)
    try:
        _warn_without_solutions(
            str(tmp_path / "store"), load_config(None, ["select.hints.enabled=true"]), "problems-plain"
        )
        _warn_without_solutions(str(tmp_path / "store"), load_config(None, []), "problems-plain")  # hints off: silent
    finally:
        stop_listening(listener)
    assert [event for event, _ in seen] == ["warning"]
    assert seen[0][1]["message"].startswith("select.hints is on but none of the run's 2 problems has a solution")
