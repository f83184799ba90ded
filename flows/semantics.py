"""The invariant checker of a stored run (`rlvr check --semantics RUN`, and the covering array's tests): what a run's
rows must say of each other whatever combination of capabilities made them.

`rlvr check` without the flag checks that the files are the ones committed; this checks that what they say is
consistent: a status agrees with its score, no error row is trained on, the loss mask covers exactly the sampled
turns, a kept group has signal, and rows in equal rows out from stage to stage. The store is read once
(`read_run`); each invariant is a plain function of those tables (`RunTables`), so a test can build a violating
table by hand. What a row means (solved, unsolved, no outcome) is verifiers/outcomes.py's, never decided here.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlvr.curricula.filtering import group_std, has_reward_variance, in_band
from rlvr.errors import UserError
from rlvr.storage.manifest import Manifest
from rlvr.storage.store import Store, open_store
from rlvr.verifiers.base import STATUSES
from rlvr.verifiers.outcomes import is_error, outcome, solved

__all__ = [
    "INVARIANTS",
    "Findings",
    "RunTables",
    "SemanticsReport",
    "Violation",
    "check_run",
    "check_semantics",
    "check_tables",
    "filters_keep_signal",
    "loss_mask_matches_turns",
    "no_error_in_update",
    "read_run",
    "rows_in_equal_rows_out",
    "status_agrees_with_score",
]

RLPR = "rlpr"
RLPR_STATUSES = ("ok", "unparseable")
ENV_PREFIX = "env:"
# What environments/base.py `reward_verdict` writes as the reason of a reward judged against env.solved_at.
SOLVED_AT_REASON = re.compile(r"reward (\S+) (>=|<) env\.solved_at (\S+)")

Row = dict[str, Any]


@dataclass(frozen=True)
class Violation:
    """One row that breaks an invariant: which invariant, where (the step, None for the data stage; the row), and
    what was found against what was expected."""

    invariant: str
    step: int | None
    row: str  # "rollout r-...", "slot 3", "source skills", "train_steps"
    found: str
    expected: str

    def line(self) -> str:
        where = self.row if self.step is None else f"step {self.step}, {self.row}"
        return f"{self.invariant}: {where}: found {self.found}; expected {self.expected}"


@dataclass
class Findings:
    """What one invariant found: its violations, how many individual checks it made (0: nothing it applies to),
    and notes on what it could not check (not violations, not passes)."""

    violations: list[Violation] = field(default_factory=list)
    checks: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass
class RunTables:
    """A run's rows as the invariants read them, each a list of dicts (columns missing from older artifacts are
    absent keys). Besides the tables' own columns: `stage` on rollouts (the stage that wrote them: `rollout`, or
    CLPO's `restructure`), `trained_rollouts` on train_steps (their manifest's record: None where the train stage
    wrote none)."""

    run_id: str
    config: dict[str, Any] | None = None  # the run's config (its `config` artifact); None without one
    rewards: list[Row] = field(default_factory=list)
    rollouts: list[Row] = field(default_factory=list)
    turns: list[Row] = field(default_factory=list)
    selections: list[Row] = field(default_factory=list)
    allocations: list[Row] = field(default_factory=list)
    filtered_groups: list[Row] = field(default_factory=list)
    train_steps: list[Row] = field(default_factory=list)
    std_floors: dict[tuple[Any, Any], float | None] = field(default_factory=dict)  # (step, round) -> the filter's
    source_counts: dict[str, dict[str, Any]] = field(default_factory=dict)  # the synthesize manifest's `counts`
    problems: list[Row] = field(default_factory=list)  # the synthesize stage's (their `source`)
    quarantine: list[Row] = field(default_factory=list)  # the synthesize stage's
    duplicates: list[Row] = field(default_factory=list)

    def rows(self) -> int:
        """How many rows the invariants read."""
        tables = (self.rewards, self.rollouts, self.turns, self.selections, self.allocations, self.filtered_groups)
        more = (self.train_steps, self.problems, self.quarantine, self.duplicates)
        return sum(len(table) for table in (*tables, *more))


@dataclass(frozen=True)
class SemanticsReport:
    """Every invariant's findings over one run."""

    run_id: str
    rows: int
    checks: int
    violations: list[Violation]
    notes: list[str]

    def summary(self) -> str:
        n = len(self.violations)
        return f"run {self.run_id}: {self.checks} checks over {self.rows} rows, {n} violation{'' if n == 1 else 's'}"


# ----- the invariants -------------------------------------------------------------------------------------------


def _num(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float | int) and not isinstance(value, bool) else repr(value)


def _flagger(found: Findings, invariant: str, step: int | None, where: str) -> Callable[[str, str], None]:
    """Adds to `found` a violation of `invariant` at (step, where), given what was found and what was expected."""

    def flag(what: str, wanted: str) -> None:
        found.violations.append(Violation(invariant, step, where, what, wanted))

    return flag


def _finite(value: Any) -> bool:
    return isinstance(value, float | int) and not isinstance(value, bool) and math.isfinite(value)


def status_agrees_with_score(t: RunTables) -> Findings:
    """A rewards row's status agrees with its score: a known status, a finite score, 0 on an error row, RLPR's
    probabilities in [0, 1] with status ok or unparseable, an environment's row equal to the verdict its rollout
    carries (and, judged against env.solved_at, ok exactly at that reward or more), and within a verifier no solved
    row scoring below an unsolved one."""
    name = "status_agrees_with_score"
    found = Findings()
    episode = {r["rollout_id"]: r for r in t.rollouts}
    ranked: dict[str, dict[bool, list[Row]]] = defaultdict(lambda: {True: [], False: []})
    for row in t.rewards:
        step, where = row.get("step"), f"rollout {row.get('rollout_id')}"
        status, score, verifier = row.get("status"), row.get("score"), str(row.get("verifier"))
        violation = _flagger(found, name, step, where)
        found.checks += 2
        if status not in STATUSES:
            violation(f"status {status!r}", f"one of {', '.join(STATUSES)} (verifiers/base.py)")
            continue
        if not _finite(score):
            violation(f"score {score!r}", "a finite number")
            continue
        score = float(row["score"])
        if is_error(status):
            found.checks += 1
            if score != 0.0:
                violation(f"status error with score {_num(score)}", "score 0 (an error row has no reward)")
        if verifier == RLPR:
            found.checks += 1
            if status not in RLPR_STATUSES or not 0.0 <= score <= 1.0:
                violation(
                    f"status {status} with score {_num(score)}",
                    "an RLPR row: status ok or unparseable, a score in [0, 1]",
                )
        if verifier.startswith(ENV_PREFIX):
            _env_verdict_agrees(row, episode.get(str(row.get("rollout_id"))), found, violation)
        is_solved = solved(verifier, status)
        if is_solved is not None:
            ranked[verifier][is_solved].append(row)
    for verifier, sides in sorted(ranked.items()):
        if not sides[True] or not sides[False]:
            continue
        found.checks += 1
        lowest = min(sides[True], key=lambda r: (r["score"], str(r.get("rollout_id"))))
        highest = max(sides[False], key=lambda r: (r["score"], str(r.get("rollout_id"))))
        if lowest["score"] < highest["score"]:
            found.violations.append(
                Violation(
                    name,
                    lowest.get("step"),
                    f"rollout {lowest.get('rollout_id')}",
                    f"status ok with score {_num(lowest['score'])}, below the {highest['status']} row "
                    f"{highest.get('rollout_id')}'s {_num(highest['score'])}",
                    f"every ok row of verifier {verifier} to score at least every unsolved row's",
                )
            )
    return found


def _env_verdict_agrees(row: Row, rollout: Row | None, found: Findings, violation: Callable[[str, str], None]) -> None:
    """An environment's rewards row is the verdict its rollout carries (tasks/label.py `environment_verdicts`):
    its status, and its reward (0 for an error or an episode without one). A reward that came without a verdict
    is never solved (the issue's GEM rows: -0.1 labelled ok)."""
    if rollout is None:
        return
    if not rollout.get("env_verdict"):
        if rollout.get("env_reward") is not None:
            found.checks += 1
            if row["status"] == "ok":
                violation(
                    f"status ok with score {_num(row['score'])} and no env_verdict",
                    "a status other than ok (a reward without a verdict is never solved)",
                )
        return
    found.checks += 2
    try:
        verdict = json.loads(rollout["env_verdict"])
    except ValueError:
        violation(f"env_verdict {rollout['env_verdict']!r}", "the verdict as JSON")
        return
    status, score = row["status"], row["score"]
    wanted_status = verdict.get("status")
    if status != wanted_status:
        violation(f"status {status}", f"status {wanted_status}, as its rollout's env_verdict says")
    reward = rollout.get("env_reward")
    wanted_score = 0.0 if is_error(str(wanted_status)) or reward is None else float(reward)
    if score != wanted_score:
        violation(f"score {_num(score)}", f"score {_num(wanted_score)}, its rollout's env_reward")
    judged = SOLVED_AT_REASON.fullmatch(str(verdict.get("reason") or ""))
    if judged is None:
        return
    found.checks += 1
    solved_at = float(judged.group(3))
    if (status == "ok") != (score >= solved_at):
        wanted = "status ok" if score >= solved_at else "a status other than ok"
        violation(f"status {status} with score {_num(score)}", f"{wanted} at env.solved_at {_num(solved_at)}")


def no_error_in_update(t: RunTables) -> Findings:
    """No rollout whose rewards row is an error is among those a step trained on (the train_steps manifest's
    `trained_rollouts`), and `train_steps.reward_errors` counts the step's error rows. A step whose manifest has no
    such record (written before the train stage recorded it) is noted as not checkable."""
    name = "no_error_in_update"
    found = Findings()
    errors = Counter(r.get("step") for r in t.rewards if is_error(str(r.get("status"))))
    reward_of = {r.get("rollout_id"): r for r in t.rewards}
    unrecorded = []
    for ts in sorted(t.train_steps, key=lambda r: r.get("step") or 0):
        step = ts.get("step")
        found.checks += 1
        if ts.get("reward_errors") != errors.get(step, 0):
            found.violations.append(
                Violation(
                    name,
                    step,
                    "train_steps",
                    f"reward_errors {ts.get('reward_errors')}",
                    f"{errors.get(step, 0)}, the step's rewards rows with status error",
                )
            )
        trained = ts.get("trained_rollouts")
        if trained is None:
            unrecorded.append(step)
            continue
        for rollout_id in trained:
            found.checks += 1
            reward = reward_of.get(rollout_id)
            if reward is None or reward.get("step") != step:
                what = "no rewards row" if reward is None else f"a rollout of step {reward.get('step')}"
                wanted = f"the step's trained rollouts to be labelled rollouts of step {step}"
                found.violations.append(Violation(name, step, f"rollout {rollout_id}", what, wanted))
            elif is_error(str(reward.get("status"))):
                found.violations.append(
                    Violation(name, step, f"rollout {rollout_id}", "status error in the update", "error rows left out")
                )
    if unrecorded:
        steps = ", ".join(str(s) for s in unrecorded)
        whose = f"step {steps}: its train_steps manifest records"
        if len(unrecorded) > 1:
            whose = f"steps {steps}: their train_steps manifests record"
        found.notes.append(
            f"{name}: not checkable for {whose} no trained_rollouts (written before the train stage recorded them)"
        )
    return found


def loss_mask_matches_turns(t: RunTables) -> Findings:
    """An episode's turns (the `turns` table's spans) tile its completion_ids in order, without gap or overlap; its
    loss mask has one value per completion token, 1 on the assistant's turns and 0 on the environment's; its
    `turn_starts` are its assistant turns' starts. One-turn rollouts (no loss_mask) are not episodes: skipped."""
    name = "loss_mask_matches_turns"
    found = Findings()
    turns_of: dict[str, list[Row]] = defaultdict(list)
    for turn in t.turns:
        turns_of[str(turn.get("rollout_id"))].append(turn)
    for r in t.rollouts:
        mask = r.get("loss_mask")
        if mask is None:
            continue
        rollout_id = str(r.get("rollout_id"))
        step, where = r.get("step"), f"rollout {rollout_id}"
        ids = r.get("completion_ids") or []
        turns = sorted(turns_of.get(rollout_id, []), key=lambda x: x.get("turn") or 0)
        found.checks += 2
        if len(mask) != len(ids):
            found.violations.append(
                Violation(name, step, where, f"{len(mask)} loss_mask values", f"{len(ids)}, one per completion token")
            )
            continue
        gap = _tiling_gap(turns, len(ids))
        if gap is not None:
            found.violations.append(Violation(name, step, where, gap, "turns tiling the completion_ids in order"))
            continue
        wrong = _mask_mismatch(turns, mask)
        if wrong is not None:
            found.violations.append(Violation(name, step, where, *wrong))
        starts = r.get("turn_starts")
        if starts is not None:
            found.checks += 1
            assistant = [turn.get("token_start") for turn in turns if turn.get("role") == "assistant"]
            if list(starts) != assistant:
                found.violations.append(
                    Violation(name, step, where, f"turn_starts {list(starts)}", f"{assistant}, its assistant turns'")
                )
    return found


def _tiling_gap(turns: Sequence[Row], n_tokens: int) -> str | None:
    """Where the turns' spans fail to tile [0, n_tokens) in order, or None when they do."""
    position = 0
    for turn in turns:
        start, end = turn.get("token_start"), turn.get("token_end")
        if start != position or end is None or end < start:
            return f"turn {turn.get('turn')} spanning [{start}, {end}) after tokens [0, {position}) were covered"
        position = end
    if position != n_tokens:
        return f"turns covering tokens [0, {position}) of {n_tokens}"
    return None


def _mask_mismatch(turns: Sequence[Row], mask: Sequence[int]) -> tuple[str, str] | None:
    """The first token whose mask is not its turn's (1 on an assistant turn, else 0), as (found, expected)."""
    for turn in turns:
        role = turn.get("role")
        wanted = 1 if role == "assistant" else 0
        for position in range(turn["token_start"], turn["token_end"]):
            if mask[position] != wanted:
                return (
                    f"loss_mask {mask[position]} at token {position}, in {role} turn {turn.get('turn')}",
                    f"{wanted} on every {role} token",
                )
    return None


def filters_keep_signal(t: RunTables) -> Findings:
    """A group dynamic sampling kept (`filtered_groups.kept`) has signal: its outcomes (verifiers/outcomes.py, error
    rows left out) are not all equal; with filter.band its pass rate lies in the band, and with filter.std, past
    the warm-up, its rewards' std reaches the floor the filter's manifest records (curricula/filtering.py's rules)."""
    name = "filters_keep_signal"
    found = Findings()
    kept = [g for g in t.filtered_groups if g.get("kept")]
    if not kept:
        return found
    settings = (t.config or {}).get("filter") or {}
    if t.config is None:
        found.notes.append(f"{name}: the run has no config artifact; filter.band and filter.std are not checked")
    band = settings.get("band")
    reward_of = {r.get("rollout_id"): r for r in t.rewards}
    group_rows: dict[tuple[Any, Any], list[Row]] = defaultdict(list)
    for r in t.rollouts:
        reward = reward_of.get(r.get("rollout_id"))
        if reward is not None:
            group_rows[(r.get("step"), r.get("slot"))].append(reward)
    for group in kept:
        step, slot = group.get("step"), group.get("slot")
        rows = [r for r in group_rows.get((step, slot), []) if not is_error(str(r.get("status")))]
        outcomes = [o for r in rows if (o := outcome(str(r.get("verifier")), str(r["status"]), r["score"])) is not None]
        shown = "[" + ", ".join(_num(o) for o in outcomes) + "]"
        violation = _flagger(found, name, step, f"slot {slot}")
        found.checks += 1
        if not has_reward_variance(outcomes):
            violation(f"a kept group with outcomes {shown}", "outcomes that are not all equal (a group with signal)")
            continue
        if band is not None:
            found.checks += 1
            if not in_band(outcomes, (float(band[0]), float(band[1]))):
                rate = sum(outcomes) / len(outcomes)
                violation(f"a kept group with pass rate {_num(rate)}", f"one within filter.band {list(band)}")
        floor = t.std_floors.get((step, group.get("round"))) if settings.get("std") is not None else None
        if floor is not None:
            found.checks += 1
            spread = group_std([r["score"] for r in rows]) or 0.0
            if spread < floor:
                violation(f"a kept group with reward std {_num(spread)}", f"at least the std floor {_num(floor)}")
    return found


def rows_in_equal_rows_out(t: RunTables) -> Findings:
    """Rows in equal rows out, per step: one allocation per selection slot (of the same problem), as many sampled
    rollouts per slot as it was allocated (every refill round), exactly one rewards row per rollout and one rollout
    per rewards row; and for the data stage, per source, rows read = accepted + quarantined + duplicates."""
    name = "rows_in_equal_rows_out"
    found = Findings()

    def violation(step: Any, where: str, what: str, wanted: str) -> None:
        found.violations.append(Violation(name, step, where, what, wanted))

    selected = _by_slot(t.selections)
    allocated = _by_slot(t.allocations)
    for key in sorted(set(selected) | set(allocated), key=_order):
        found.checks += 1
        picks, given = selected.get(key, []), allocated.get(key, [])
        if len(picks) != 1 or len(given) != 1:
            violation(key[0], f"slot {key[1]}", f"{len(given)} allocations for {len(picks)} selections", "one each")
        elif picks[0].get("problem_id") != given[0].get("problem_id"):
            what = f"problem {given[0].get('problem_id')} allocated"
            violation(key[0], f"slot {key[1]}", what, f"problem {picks[0].get('problem_id')}, the one selected")
    sampled = _by_slot([r for r in t.rollouts if r.get("stage", "rollout") == "rollout"])
    for key in sorted(set(allocated) | set(sampled), key=_order):
        found.checks += 1
        budget = sum(int(a.get("n_rollouts") or 0) for a in allocated.get(key, []))
        if len(sampled.get(key, [])) != budget:
            violation(key[0], f"slot {key[1]}", f"{len(sampled.get(key, []))} rollouts", f"{budget}, as allocated")
    labels = Counter(r.get("rollout_id") for r in t.rewards)
    step_of = {r.get("rollout_id"): r.get("step") for r in [*t.rewards, *t.rollouts]}
    samples = Counter(r.get("rollout_id") for r in t.rollouts)
    for rollout_id in sorted(set(samples) | set(labels), key=str):
        found.checks += 1
        n_rollouts, n_rewards = samples[rollout_id], labels[rollout_id]
        if n_rollouts != 1 or n_rewards != 1:
            wanted = "exactly one rewards row per rollout and one rollout per rewards row"
            violation(
                step_of[rollout_id], f"rollout {rollout_id}", f"{n_rollouts} rollouts, {n_rewards} rewards rows", wanted
            )
    _synthesized_rows_add_up(t, found, violation)
    return found


def _synthesized_rows_add_up(t: RunTables, found: Findings, violation: Callable[[Any, str, str, str], None]) -> None:
    accepted = Counter(r.get("source") for r in t.problems)
    quarantined = Counter(r.get("source") for r in t.quarantine)
    duplicates = Counter(r.get("source") for r in t.duplicates)
    if not t.source_counts and not (accepted or quarantined or duplicates):
        return
    for source in sorted({*t.source_counts, *accepted, *quarantined, *duplicates}, key=str):
        found.checks += 1
        read = int((t.source_counts.get(str(source)) or {}).get("read", 0))
        a, q, d = accepted[source], quarantined[source], duplicates[source]
        if read != a + q + d:
            what = f"{read} rows read, {a} accepted + {q} quarantined + {d} duplicates"
            violation(None, f"source {source}", what, "rows read = accepted + quarantined + duplicates")


def _by_slot(rows: Iterable[Row]) -> dict[tuple[Any, Any], list[Row]]:
    grouped: dict[tuple[Any, Any], list[Row]] = defaultdict(list)
    for r in rows:
        grouped[(r.get("step"), r.get("slot"))].append(r)
    return grouped


def _order(key: tuple[Any, Any]) -> tuple[int, int]:
    return (key[0] if isinstance(key[0], int) else -1, key[1] if isinstance(key[1], int) else -1)


INVARIANTS: dict[str, Callable[[RunTables], Findings]] = {
    "status_agrees_with_score": status_agrees_with_score,
    "no_error_in_update": no_error_in_update,
    "loss_mask_matches_turns": loss_mask_matches_turns,
    "filters_keep_signal": filters_keep_signal,
    "rows_in_equal_rows_out": rows_in_equal_rows_out,
}


# ----- reading a run --------------------------------------------------------------------------------------------

_COLUMNS = {
    "rewards": ["rollout_id", "step", "problem_id", "verifier", "score", "status"],
    "rollouts": [
        "rollout_id",
        "step",
        "slot",
        "problem_id",
        "completion_ids",
        "loss_mask",
        "turn_starts",
        "env",
        "env_reward",
        "env_verdict",
    ],
    "turns": ["rollout_id", "step", "turn", "role", "token_start", "token_end"],
    "selections": ["step", "slot", "problem_id"],
    "allocations": ["step", "slot", "problem_id", "n_rollouts"],
    "filtered_groups": ["step", "round", "slot", "problem_id", "kept"],
    "train_steps": ["step", "reward_errors"],
}


def read_run(store: Store, run_id: str) -> RunTables:
    """The tables of run `run_id`, read once through the store (each part checked against its manifest); a one-line
    UserError for a run the store does not know."""
    manifests = store.manifests(run_id=run_id)
    if not manifests and store.read_run(run_id) is None:
        known = ", ".join(sorted(str(r.get("run_id")) for r in store.list_runs())) or "none"
        raise UserError(f"unknown run id {run_id!r} in store {store.root}; runs there: {known}")
    tables = RunTables(run_id=run_id)
    for m in manifests:
        if m.kind in _COLUMNS:
            rows = _rows(store, m, _COLUMNS[m.kind])
            getattr(tables, m.kind).extend(_annotated(m, rows))
            if m.kind == "filtered_groups" and m.step is not None:
                for r in rows:
                    tables.std_floors[(m.step, r.get("round"))] = m.extra.get("std_floor")
        elif m.kind == "config":
            configs = _rows(store, m, ["config_json"])
            tables.config = json.loads(configs[0]["config_json"]) if configs else None
        elif m.stage == "synthesize" and m.kind in ("problems", "quarantine", "duplicates"):
            getattr(tables, m.kind).extend(_rows(store, m, ["source"]))
            if m.kind == "problems":
                tables.source_counts.update(m.extra.get("counts") or {})
    return tables


def _rows(store: Store, manifest: Manifest, columns: list[str]) -> list[Row]:
    """The artifact's rows, these columns only (an older artifact's missing columns are absent keys)."""
    return store.read_table(manifest.artifact_id, columns).to_pylist()


def _annotated(manifest: Manifest, rows: list[Row]) -> list[Row]:
    """What the rows' manifest adds: the stage that wrote rollouts, the rollouts a train step trained on."""
    if manifest.kind == "rollouts":
        return [{**r, "stage": manifest.stage} for r in rows]
    if manifest.kind == "train_steps":
        trained = manifest.extra.get("trained_rollouts")
        return [{**r, "trained_rollouts": None if trained is None else list(trained)} for r in rows]
    return rows


# ----- the entry points -----------------------------------------------------------------------------------------


def check_tables(tables: RunTables) -> SemanticsReport:
    """Every invariant over tables already read."""
    violations: list[Violation] = []
    notes: list[str] = []
    checks = 0
    for invariant in INVARIANTS.values():
        findings = invariant(tables)
        violations += findings.violations
        notes += findings.notes
        checks += findings.checks
    return SemanticsReport(tables.run_id, tables.rows(), checks, violations, notes)


def check_run(store: Store | str, run_id: str) -> SemanticsReport:
    """Every invariant over the stored run `run_id`: its violations, how many checks over how many rows, and what
    could not be checked."""
    found = store if isinstance(store, Store) else open_store(store)
    return check_tables(read_run(found, run_id))


def check_semantics(store: Store | str, run_id: str) -> list[Violation]:
    """The violations of every invariant in the stored run `run_id` (none: the run's rows are consistent). What the
    covering array's tests call on each of their runs."""
    return check_run(store, run_id).violations
