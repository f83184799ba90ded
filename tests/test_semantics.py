"""The invariant checker of a stored run (flows/semantics.py, `rlvr check --semantics`): each invariant on small
hand-built tables, consistent and broken; a real run (dynamic sampling, the retry environment) that breaks none; and
a copy of its store with one rewards row edited by hand (rewritten Parquet, its manifest's size and sha256 updated,
so the store's own file checks pass), reported by the checker and by the command, with exit status 1."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlvr.errors import UserError
from rlvr.flows.semantics import (
    INVARIANTS,
    RunTables,
    Violation,
    check_run,
    check_semantics,
    filters_keep_signal,
    loss_mask_matches_turns,
    no_error_in_update,
    read_run,
    rows_in_equal_rows_out,
    status_agrees_with_score,
)
from rlvr.storage.integrity import find_damage
from rlvr.storage.manifest import Manifest, parquet_bytes, sha256_hex
from rlvr.storage.store import Store
from tests.cli_helpers import SMALL_RUN, rlvr

RUN = "semantics"
# Dynamic sampling over the retry environment: refill rounds, kept and dropped groups, episodes of several turns
# with environment tokens in their loss masks, rows from the environment's verdict and from the verifier. 60 warm-up
# steps give the tiny model some right answers, so some groups have signal.
RUN_SETTINGS = [*SMALL_RUN, "warmstart.steps=60", "filter.enabled=true", "env.type=retry", "env.max_turns=3"]


def reward(rollout_id: str, status: str, score: float, verifier: str = "arithmetic", step: int = 1) -> dict[str, Any]:
    return {"rollout_id": rollout_id, "step": step, "verifier": verifier, "status": status, "score": score}


# ----- a row's status agrees with its score ----------------------------------------------------------------------


def verdict(status: str, reason: str) -> str:
    return json.dumps({"status": status, "extracted": None, "reason": reason, "components": {}})


def consistent_rewards() -> RunTables:
    """Every kind of row, each as it should be: a verifier's ok/wrong/unparseable, a judge's error, RLPR's graded
    rows, a game's rows judged against env.solved_at (its rollouts carry the verdicts)."""
    episodes = [
        {"rollout_id": "g1", "step": 1, "env_reward": 1.0, "env_verdict": verdict("ok", "reward 1 >= env.solved_at 1")},
        {
            "rollout_id": "g2",
            "step": 1,
            "env_reward": -0.1,
            "env_verdict": verdict("wrong", "reward -0.1 < env.solved_at 1"),
        },
        {"rollout_id": "g3", "step": 1, "env_reward": None, "env_verdict": verdict("error", "the game crashed")},
    ]
    rows = [
        reward("a1", "ok", 1.0),
        reward("a2", "wrong", 0.0),
        reward("a3", "unparseable", 0.0),
        reward("j1", "error", 0.0, "judge"),
        reward("p1", "ok", 0.2, "rlpr"),
        reward("p2", "unparseable", 0.9, "rlpr"),  # graded: a probability, never ranked against ok
        reward("g1", "ok", 1.0, "env:gem"),
        reward("g2", "wrong", -0.1, "env:gem"),
        reward("g3", "error", 0.0, "env:gem"),
    ]
    return RunTables(run_id="r", rewards=rows, rollouts=episodes)


def test_consistent_rewards_break_nothing_and_every_rule_is_checked():
    found = status_agrees_with_score(consistent_rewards())
    assert found.violations == []
    # 2 per row (status, finite score) = 18; error rows' zero: 2; RLPR's range: 2; the game's verdicts: 2 x 3 rows,
    # its solved_at rule: 2 (the crash has no such reason); the ranking of ok over unsolved: arithmetic and env:gem
    assert found.checks == 18 + 2 + 2 + 6 + 2 + 2


def edited(tables: RunTables, rollout_id: str, **changes: Any) -> RunTables:
    rows = [{**r, **changes} if r["rollout_id"] == rollout_id else r for r in tables.rewards]
    return dataclasses.replace(tables, rewards=rows)


V = "status_agrees_with_score"
BROKEN_REWARDS = {
    "unknown status": (
        {"rollout_id": "a2", "status": "maybe"},
        Violation(
            V, 1, "rollout a2", "status 'maybe'", "one of ok, wrong, unparseable, timeout, error (verifiers/base.py)"
        ),
    ),
    "NaN score": (
        {"rollout_id": "a2", "score": math.nan},
        Violation(V, 1, "rollout a2", "score nan", "a finite number"),
    ),
    "error row scored": (
        {"rollout_id": "j1", "score": 0.5},
        Violation(V, 1, "rollout j1", "status error with score 0.5", "score 0 (an error row has no reward)"),
    ),
    "RLPR score past 1": (
        {"rollout_id": "p1", "score": 1.5},
        Violation(
            V, 1, "rollout p1", "status ok with score 1.5", "an RLPR row: status ok or unparseable, a score in [0, 1]"
        ),
    ),
    "RLPR status wrong": (
        {"rollout_id": "p1", "status": "wrong"},
        Violation(
            V,
            1,
            "rollout p1",
            "status wrong with score 0.2",
            "an RLPR row: status ok or unparseable, a score in [0, 1]",
        ),
    ),
    "ok below an unsolved row": (
        {"rollout_id": "a3", "score": 1.5},  # partial credit above the solved answer's reward
        Violation(
            V,
            1,
            "rollout a1",
            "status ok with score 1, below the unparseable row a3's 1.5",
            "every ok row of verifier arithmetic to score at least every unsolved row's",
        ),
    ),
    "a crashed episode labelled a wrong answer": (
        {"rollout_id": "g3", "status": "wrong"},
        Violation(V, 1, "rollout g3", "status wrong", "status error, as its rollout's env_verdict says"),
    ),
    "environment row's score not its reward": (
        {"rollout_id": "g2", "score": -0.5},
        Violation(V, 1, "rollout g2", "score -0.5", "score -0.1, its rollout's env_reward"),
    ),
}


@pytest.mark.parametrize("case", list(BROKEN_REWARDS))
def test_a_rewards_row_that_disagrees_is_the_one_violation(case):
    changes, expected = BROKEN_REWARDS[case]
    found = status_agrees_with_score(edited(consistent_rewards(), **changes))
    assert found.violations == [expected]


def test_a_reward_without_a_verdict_is_never_solved():
    """A store from before verdicts were recorded (8a5fb4b): GEM's -0.1 came without one and was labelled ok."""
    tables = consistent_rewards()
    tables.rollouts[1]["env_verdict"] = None
    found = status_agrees_with_score(edited(tables, "g2", status="ok"))
    what, wanted = (
        "status ok with score -0.1 and no env_verdict",
        "a status other than ok (a reward without a verdict is never solved)",
    )
    assert found.violations == [Violation(V, 1, "rollout g2", what, wanted)]
    assert status_agrees_with_score(tables).violations == []  # the same reward labelled wrong (or error) is fine


def test_an_ok_row_may_score_as_much_as_an_unsolved_one():
    """At least, not more: partial credit may reach a solved answer's reward (a tie is no violation)."""
    assert status_agrees_with_score(edited(consistent_rewards(), "a3", score=1.0)).violations == []


def test_a_reward_below_env_solved_at_is_never_solved():
    """GEM's -0.1 labelled ok (the issue's 4,608 rows): the verdict itself says the reward is below the threshold."""
    tables = consistent_rewards()
    tables.rollouts[1]["env_verdict"] = verdict("ok", "reward -0.1 < env.solved_at 1")
    found = status_agrees_with_score(edited(tables, "g2", status="ok"))
    assert found.violations == [
        Violation(V, 1, "rollout g2", "status ok with score -0.1", "a status other than ok at env.solved_at 1")
    ]


# ----- no error row is in the update -----------------------------------------------------------------------------


def update_tables(trained: list[str] | None, reward_errors: int = 1) -> RunTables:
    rows = [reward("r1", "ok", 1.0), reward("r2", "wrong", 0.0), reward("r3", "error", 0.0, "judge")]
    steps = [{"step": 1, "reward_errors": reward_errors, "trained_rollouts": trained}]
    return RunTables(run_id="r", rewards=rows, train_steps=steps)


def test_an_update_without_error_rows_breaks_nothing():
    found = no_error_in_update(update_tables(["r1", "r2"]))
    assert (found.violations, found.checks, found.notes) == ([], 3, [])


def test_an_error_row_in_the_update_is_a_violation():
    found = no_error_in_update(update_tables(["r1", "r2", "r3"]))
    n = "no_error_in_update"
    assert found.violations == [Violation(n, 1, "rollout r3", "status error in the update", "error rows left out")]


def test_a_trained_rollout_with_no_rewards_row_is_a_violation():
    found = no_error_in_update(update_tables(["r1", "r9"]))
    wanted = "the step's trained rollouts to be labelled rollouts of step 1"
    assert found.violations == [Violation("no_error_in_update", 1, "rollout r9", "no rewards row", wanted)]


def test_reward_errors_must_count_the_steps_error_rows():
    found = no_error_in_update(update_tables(["r1", "r2"], reward_errors=0))
    wanted = "1, the step's rewards rows with status error"
    assert found.violations == [Violation("no_error_in_update", 1, "train_steps", "reward_errors 0", wanted)]


def test_a_step_without_a_record_of_its_trained_rollouts_is_not_checkable():
    found = no_error_in_update(update_tables(None))
    assert (found.violations, found.checks) == ([], 1)  # reward_errors is still checked
    assert found.notes == [
        "no_error_in_update: not checkable for step 1: its train_steps manifest records no trained_rollouts "
        "(written before the train stage recorded them)"
    ]


# ----- the loss mask matches the turns' spans --------------------------------------------------------------------


def episode_tables(**changes: Any) -> RunTables:
    """An episode of 6 tokens: the assistant's 3, the environment's 2, the assistant's 1; and a one-turn rollout
    (no loss mask), which is skipped."""
    episode = {
        "rollout_id": "e1",
        "step": 2,
        "completion_ids": [5, 6, 7, 8, 9, 10],
        "loss_mask": [1, 1, 1, 0, 0, 1],
        "turn_starts": [0, 5],
        **changes,
    }
    one_turn = {"rollout_id": "o1", "step": 2, "completion_ids": [5, 6], "loss_mask": None, "turn_starts": None}
    spans = [("assistant", 0, 3), ("user", 3, 5), ("assistant", 5, 6)]
    turns = [
        {"rollout_id": "e1", "turn": k, "role": role, "token_start": start, "token_end": end}
        for k, (role, start, end) in enumerate(spans)
    ]
    return RunTables(run_id="r", rollouts=[episode, one_turn], turns=turns)


def test_an_episode_whose_mask_covers_its_sampled_turns_breaks_nothing():
    found = loss_mask_matches_turns(episode_tables())
    assert (found.violations, found.checks) == ([], 3)  # length, tiling and mask, turn_starts; the one-turn skipped


L = "loss_mask_matches_turns"
BROKEN_EPISODES = {
    "a mask value short": ({"loss_mask": [1, 1, 1, 0, 0]}, ("5 loss_mask values", "6, one per completion token")),
    "the environment's token trained on": (
        {"loss_mask": [1, 1, 1, 1, 0, 1]},
        ("loss_mask 1 at token 3, in user turn 1", "0 on every user token"),
    ),
    "a sampled token left out": (
        {"loss_mask": [1, 1, 1, 0, 0, 0]},
        ("loss_mask 0 at token 5, in assistant turn 2", "1 on every assistant token"),
    ),
    "a token no turn covers": (
        {"completion_ids": [5, 6, 7, 8, 9, 10, 11], "loss_mask": [1, 1, 1, 0, 0, 1, 1]},
        ("turns covering tokens [0, 6) of 7", "turns tiling the completion_ids in order"),
    ),
    "turn_starts not the assistant's": (
        {"turn_starts": [0, 3]},
        ("turn_starts [0, 3]", "[0, 5], its assistant turns'"),
    ),
}


@pytest.mark.parametrize("case", list(BROKEN_EPISODES))
def test_a_mask_that_does_not_match_the_turns_is_the_one_violation(case):
    changes, (what, wanted) = BROKEN_EPISODES[case]
    assert loss_mask_matches_turns(episode_tables(**changes)).violations == [
        Violation(L, 2, "rollout e1", what, wanted)
    ]


def test_turns_that_overlap_are_a_violation():
    tables = episode_tables()
    tables.turns[1]["token_start"] = 2
    found = loss_mask_matches_turns(tables)
    what = "turn 1 spanning [2, 5) after tokens [0, 3) were covered"
    assert found.violations == [Violation(L, 2, "rollout e1", what, "turns tiling the completion_ids in order")]


# ----- filters keep only groups with signal ----------------------------------------------------------------------


def group_tables(
    statuses: list[str], kept: bool = True, settings: dict[str, Any] | None = None, verifier: str = "arithmetic"
) -> RunTables:
    """One group (step 1, slot 0) of these statuses (scores 1 for ok, else 0; RLPR's: given as 'ok:0.3')."""
    rollouts, rewards = [], []
    for i, status in enumerate(statuses):
        status, _, given = status.partition(":")
        score = float(given) if given else float(status == "ok")
        rollouts.append({"rollout_id": f"x{i}", "step": 1, "slot": 0})
        rewards.append(reward(f"x{i}", status, score if status != "error" else 0.0, verifier))
    groups = [{"step": 1, "round": 0, "slot": 0, "kept": kept}]
    config = {"filter": {"enabled": True, **(settings or {})}}
    return RunTables(run_id="r", config=config, rollouts=rollouts, rewards=rewards, filtered_groups=groups)


F = "filters_keep_signal"


def test_a_kept_group_with_signal_breaks_nothing():
    found = filters_keep_signal(group_tables(["ok", "wrong", "wrong", "error"]))
    assert (found.violations, found.checks) == ([], 1)


def test_a_dropped_group_is_not_checked():
    found = filters_keep_signal(group_tables(["wrong", "wrong"], kept=False))
    assert (found.violations, found.checks) == ([], 0)


def test_a_kept_group_without_signal_is_a_violation():
    found = filters_keep_signal(group_tables(["wrong", "unparseable", "wrong"]))
    what = "a kept group with outcomes [0, 0, 0]"
    assert found.violations == [
        Violation(F, 1, "slot 0", what, "outcomes that are not all equal (a group with signal)")
    ]


def test_an_error_row_gives_a_group_no_signal():
    """An error row has no outcome: a group of one right answer and one failed verdict has nothing to compare."""
    found = filters_keep_signal(group_tables(["ok", "error"]))
    what = "a kept group with outcomes [1]"
    assert found.violations == [
        Violation(F, 1, "slot 0", what, "outcomes that are not all equal (a group with signal)")
    ]


def test_an_rlpr_groups_signal_is_its_rewards_spread():
    """RLPR decides no solving: its outcome is the reward, whatever the status says."""
    spread = filters_keep_signal(group_tables(["ok:0.3", "ok:0.6"], verifier="rlpr"))
    assert (spread.violations, spread.checks) == ([], 1)
    found = filters_keep_signal(group_tables(["ok:0.4", "unparseable:0.4"], verifier="rlpr"))
    what = "a kept group with outcomes [0.4, 0.4]"
    assert found.violations == [
        Violation(F, 1, "slot 0", what, "outcomes that are not all equal (a group with signal)")
    ]


def test_a_kept_group_outside_the_band_is_a_violation():
    inside = filters_keep_signal(group_tables(["ok", "wrong", "wrong", "wrong"], settings={"band": [0.2, 0.5]}))
    assert (inside.violations, inside.checks) == ([], 2)
    found = filters_keep_signal(group_tables(["ok", "ok", "ok", "wrong"], settings={"band": [0.2, 0.5]}))
    what = "a kept group with pass rate 0.75"
    assert found.violations == [Violation(F, 1, "slot 0", what, "one within filter.band [0.2, 0.5]")]


def test_a_kept_group_under_the_std_floor_is_a_violation():
    """RLPR's std filter: the floor is the filter's manifest's (`std_floor`) for the group's step and round; an
    error row's 0 is no reward and counts in no std."""
    settings = {"std": {"beta": 0.5}}
    tables = group_tables(["ok:0.3", "ok:0.5", "unparseable:0.1", "error"], settings=settings, verifier="rlpr")
    tables.std_floors = {(1, 0): 0.15}  # the stdev of 0.3, 0.5, 0.1 is 0.2
    found = filters_keep_signal(tables)
    assert (found.violations, found.checks) == ([], 2)
    tables.std_floors = {(1, 0): 0.25}
    found = filters_keep_signal(tables)
    assert found.violations == [
        Violation(F, 1, "slot 0", "a kept group with reward std 0.2", "at least the std floor 0.25")
    ]


# ----- rows in equal rows out ------------------------------------------------------------------------------------


def flow_tables() -> RunTables:
    """Step 1: two selected slots given 2 and 1 rollouts, each labelled once, and a CLPO rewrite's rollout (stage
    restructure: no allocation) labelled too; the data stage's source read 5 rows: 3 accepted, 1 quarantined, 1 a
    duplicate."""
    selections = [{"step": 1, "slot": 0, "problem_id": "p0"}, {"step": 1, "slot": 1, "problem_id": "p1"}]
    allocations = [{**s, "n_rollouts": n} for s, n in zip(selections, (2, 1))]
    rollouts = [
        {"rollout_id": "s0a", "step": 1, "slot": 0, "stage": "rollout"},
        {"rollout_id": "s0b", "step": 1, "slot": 0, "stage": "rollout"},
        {"rollout_id": "s1a", "step": 1, "slot": 1, "stage": "rollout"},
        {"rollout_id": "w0", "step": 1, "slot": 9, "stage": "restructure"},
    ]
    rewards = [reward(r["rollout_id"], "wrong", 0.0) for r in rollouts]
    return RunTables(
        run_id="r",
        selections=selections,
        allocations=allocations,
        rollouts=rollouts,
        rewards=rewards,
        source_counts={"skills": {"read": 5, "accepted": 3, "quarantined": 1, "duplicates": 1}},
        problems=[{"source": "skills"}] * 3,
        quarantine=[{"source": "skills"}],
        duplicates=[{"source": "skills"}],
    )


R = "rows_in_equal_rows_out"


def test_rows_that_add_up_break_nothing():
    found = rows_in_equal_rows_out(flow_tables())
    # 2 selection slots, 2 allocated slots, 4 rollouts each with its rewards row, 1 source
    assert (found.violations, found.checks) == ([], 9)


def broken_flow(edit: Callable[[RunTables], None]) -> list[Violation]:
    tables = flow_tables()
    edit(tables)
    return rows_in_equal_rows_out(tables).violations


def test_a_selection_without_an_allocation_is_a_violation():
    violations = broken_flow(lambda t: t.allocations.pop())
    assert violations == [
        Violation(R, 1, "slot 1", "0 allocations for 1 selections", "one each"),
        Violation(R, 1, "slot 1", "1 rollouts", "0, as allocated"),
    ]


def test_an_allocation_of_another_problem_is_a_violation():
    violations = broken_flow(lambda t: t.allocations[1].update(problem_id="p7"))
    assert violations == [Violation(R, 1, "slot 1", "problem p7 allocated", "problem p1, the one selected")]


def test_more_rollouts_than_allocated_is_a_violation():
    violations = broken_flow(lambda t: t.allocations[0].update(n_rollouts=3))
    assert violations == [Violation(R, 1, "slot 0", "2 rollouts", "3, as allocated")]


def test_a_rollout_without_its_rewards_row_and_a_row_twice_are_violations():
    def edit(t: RunTables) -> None:
        t.rewards[1] = t.rewards[0]  # s0b lost its row, s0a has two

    wanted = "exactly one rewards row per rollout and one rollout per rewards row"
    assert broken_flow(edit) == [
        Violation(R, 1, "rollout s0a", "1 rollouts, 2 rewards rows", wanted),
        Violation(R, 1, "rollout s0b", "1 rollouts, 0 rewards rows", wanted),
    ]


def test_a_data_stage_row_unaccounted_for_is_a_violation():
    violations = broken_flow(lambda t: t.source_counts["skills"].update(read=6))
    what = "6 rows read, 3 accepted + 1 quarantined + 1 duplicates"
    assert violations == [Violation(R, None, "source skills", what, "rows read = accepted + quarantined + duplicates")]
    assert violations[0].line() == (
        "rows_in_equal_rows_out: source skills: found 6 rows read, 3 accepted + 1 quarantined + 1 duplicates; "
        "expected rows read = accepted + quarantined + duplicates"
    )


# ----- a real run and its store edited by hand -------------------------------------------------------------------


@pytest.fixture(scope="module")
def semantics_run(tmp_path_factory, prefect_api) -> Store:
    """One real run of RUN_SETTINGS, shared by this module's run-level tests (they edit copies of its store)."""
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute

    root = str(tmp_path_factory.mktemp("semantics") / "store")
    execute(root, load_config(None, [f"run_id={RUN}", *RUN_SETTINGS]))
    return Store.open(root)


@pytest.mark.slow
def test_a_run_with_dynamic_sampling_over_an_environment_breaks_no_invariant(semantics_run):
    tables = read_run(semantics_run, RUN)
    # what the invariants have to work on: kept and dropped groups, episodes with environment tokens, error-free
    # updates recorded, both the environment's and the verifier's rows, the data stage's counts
    assert {g["kept"] for g in tables.filtered_groups} == {True, False}
    assert any(0 in (r["loss_mask"] or []) for r in tables.rollouts)
    assert all(ts["trained_rollouts"] for ts in tables.train_steps) and len(tables.train_steps) == 2
    assert {r["verifier"] for r in tables.rewards} == {"env:retry", "arithmetic"}
    checks = {name: invariant(tables).checks for name, invariant in INVARIANTS.items()}
    assert all(checks.values()), checks  # each invariant found something to check
    report = check_run(semantics_run, RUN)
    assert (report.violations, report.notes) == ([], [])
    assert report.checks == sum(checks.values()) and report.rows == tables.rows()
    assert check_semantics(semantics_run.root, RUN) == []
    result = rlvr("check", "--semantics", RUN, "--store", semantics_run.root)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == f"run {RUN}: {report.checks} checks over {report.rows} rows, 0 violations\n"


def edit_rewards_row(root: str, rollout_id: str, **changes: Any) -> None:
    """Rewrite the Parquet part holding this rollout's rewards row with `changes`, and its manifest's size and
    sha256 with it: the store reads the edited row back as committed."""
    store = Store.open(root)
    for manifest in store.manifests(kind="rewards", run_id=RUN):
        entries = []
        for entry in manifest.files:
            path = Path(store.artifact_dir("rewards", manifest.artifact_id)) / entry["path"]
            table = pq.read_table(path)
            rows = table.to_pylist()
            if entry["rows"] is not None and rollout_id in [r["rollout_id"] for r in rows]:
                rows = [{**r, **changes} if r["rollout_id"] == rollout_id else r for r in rows]
                data = parquet_bytes(pa.Table.from_pylist(rows, schema=table.schema))
                os.chmod(path, 0o644)
                path.write_bytes(data)
                entry = {**entry, "bytes": len(data), "sha256": sha256_hex(data)}
            entries.append(entry)
        if entries != manifest.files:
            fixed: Manifest = dataclasses.replace(manifest, files=entries)
            Path(store.manifest_path(manifest.artifact_id)).write_text(fixed.to_json(), encoding="utf-8")
            return
    raise AssertionError(f"no rewards row of rollout {rollout_id}")


def pick(tables: RunTables, verifier: str, status: str, trained: bool, signal_left: bool = False) -> dict[str, Any]:
    """The first rewards row (by rollout id) of this verifier and status, among the rollouts an update trained on
    or those it did not; with `signal_left`, one whose kept group keeps its signal without it."""
    trained_ids = {rid for ts in tables.train_steps for rid in ts["trained_rollouts"]}
    slot_of = {r["rollout_id"]: (r["step"], r["slot"]) for r in tables.rollouts}
    status_of = {r["rollout_id"]: r["status"] for r in tables.rewards}
    members: dict[tuple[int, int], list[str]] = {}
    for rollout_id, key in slot_of.items():
        members.setdefault(key, []).append(rollout_id)
    for row in sorted(tables.rewards, key=lambda r: r["rollout_id"]):
        if (row["verifier"], row["status"], row["rollout_id"] in trained_ids) != (verifier, status, trained):
            continue
        others = [status_of[m] for m in members[slot_of[row["rollout_id"]]] if m != row["rollout_id"]]
        if not signal_left or ("ok" in others and any(s != "ok" for s in others)):
            return row
    raise AssertionError(f"the run has no {status} row of {verifier} (trained: {trained})")


def expected_for(edit: str, tables: RunTables) -> tuple[str, dict[str, Any], list[Violation]]:
    """The row an edit changes, the change, and exactly what the checker must report."""
    errors = {ts["step"]: ts["reward_errors"] for ts in tables.train_steps}
    if edit == "an environment's ok flipped to wrong":
        row = pick(tables, "env:retry", "ok", trained=False)
        where = f"rollout {row['rollout_id']}"
        return (
            row["rollout_id"],
            {"status": "wrong"},
            [Violation(V, row["step"], where, "status wrong", "status ok, as its rollout's env_verdict says")],
        )
    if edit == "an environment's score changed":
        row = pick(tables, "env:retry", "ok", trained=True)
        where = f"rollout {row['rollout_id']}"
        return (
            row["rollout_id"],
            {"score": 0.25},
            [Violation(V, row["step"], where, "score 0.25", "score 1, its rollout's env_reward")],
        )
    if edit == "a wrong answer flipped to error, out of the update":
        row = pick(tables, "arithmetic", "wrong", trained=False)
        step = row["step"]
        wanted = f"{errors[step] + 1}, the step's rewards rows with status error"
        return (
            row["rollout_id"],
            {"status": "error"},
            [Violation("no_error_in_update", step, "train_steps", f"reward_errors {errors[step]}", wanted)],
        )
    assert edit == "a trained wrong answer flipped to error"
    row = pick(tables, "arithmetic", "wrong", trained=True, signal_left=True)
    step, where = row["step"], f"rollout {row['rollout_id']}"
    wanted = f"{errors[step] + 1}, the step's rewards rows with status error"
    return (
        row["rollout_id"],
        {"status": "error"},
        [
            Violation("no_error_in_update", step, "train_steps", f"reward_errors {errors[step]}", wanted),
            Violation("no_error_in_update", step, where, "status error in the update", "error rows left out"),
        ],
    )


EDITS = [
    "an environment's ok flipped to wrong",
    "an environment's score changed",
    "a wrong answer flipped to error, out of the update",
    "a trained wrong answer flipped to error",
]


@pytest.mark.slow
@pytest.mark.parametrize("edit", EDITS)
def test_a_rewards_row_edited_by_hand_is_reported(semantics_run, tmp_path, edit):
    copy = str(tmp_path / "store")
    shutil.copytree(semantics_run.root, copy)
    rollout_id, changes, expected = expected_for(edit, read_run(semantics_run, RUN))
    edit_rewards_row(copy, rollout_id, **changes)
    assert find_damage(Store.open(copy), [RUN]) == []  # the files are the committed ones: only what they say is wrong
    assert check_semantics(copy, RUN) == expected
    result = rlvr("check", "--semantics", RUN, "--store", copy)
    assert (result.returncode, result.stderr) == (1, "")
    assert result.stdout.splitlines() == [f"run {RUN}: {v.line()}" for v in expected]


@pytest.mark.slow
def test_a_run_whose_updates_record_no_rollouts_is_noted_not_passed(semantics_run, tmp_path):
    """Runs from before the train stage recorded its rollouts: the invariant is not checkable there."""
    copy = tmp_path / "store"
    shutil.copytree(semantics_run.root, copy)
    store = Store.open(str(copy))
    for manifest in store.manifests(kind="train_steps", run_id=RUN):
        extra = {k: v for k, v in manifest.extra.items() if k != "trained_rollouts"}
        Path(store.manifest_path(manifest.artifact_id)).write_text(dataclasses.replace(manifest, extra=extra).to_json())
    report = check_run(str(copy), RUN)
    assert report.violations == []
    assert report.notes == [
        "no_error_in_update: not checkable for steps 1, 2: their train_steps manifests record no trained_rollouts "
        "(written before the train stage recorded them)"
    ]


def test_an_unknown_run_is_one_line(tmp_path):
    store = Store.open(str(tmp_path / "store"), create=True)
    with pytest.raises(UserError) as caught:
        check_run(store, "nope")
    assert str(caught.value) == f"unknown run id 'nope' in store {store.root}; runs there: none"


def test_clean_and_semantics_together_are_refused(tmp_path):
    from typer.testing import CliRunner

    from rlvr.flows.cli.commands import app

    root = str(tmp_path / "store")
    Store.open(root, create=True)
    result = CliRunner().invoke(app, ["check", "--semantics", "--clean", "--store", root])
    assert result.exit_code == 1 and isinstance(result.exception, UserError)
    assert str(result.exception) == "--clean cleans files, --semantics checks rows: give one of them"
