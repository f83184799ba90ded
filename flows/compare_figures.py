"""What `rlvr compare` reads back from the store: each run's curve and budget, and each method's figures over seeds
with bootstrap 95% intervals (flows/compare.py runs the runs; compare_page.py draws these).

Per run, from the store's views (SQL over the runs' Parquet):
  - rollouts: every sampled rollout of a step counted once it has a reward (dynamic sampling's refills and CLPO's
    rewrites included), cumulated over steps;
  - its accuracy curve: at each RL evaluation (and the last one before RL, at 0 rollouts) the metric, mean@k of the
    sampled answers when the runs evaluated with `evaluate.samples`, else greedy accuracy;
  - its effective-gradient ratio per step: the share of groups (a step's rollouts of one slot) whose rewards are
    not all equal;
  - its budget over difficulty: rollouts allotted to problems by the p̂ the allocator decided on, in bins.
Per method, over its seeds: the final metric, the metric at uniform's budget (the last evaluation before the method
has spent what uniform spent on that seed), rollouts to the target (when every seed reached it), the mean effective
ratio, and the compute-equivalence ratio: the rollouts uniform's mean curve needs to reach the method's final metric,
over the method's own rollouts (above 1: the method matches uniform with fewer rollouts). Intervals are percentile
bootstraps over seeds (scipy.stats.bootstrap for a mean; for the ratio, the method's and uniform's seeds are
resampled independently by hand, since a resample where uniform never reaches the method has no value)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlvr.storage.store import Store
from rlvr.storage.views import connect, sql_string

DIFFICULTY_BINS = ("p̂ = 0", "0 < p̂ ≤ 0.25", "0.25 < p̂ ≤ 0.5", "0.5 < p̂ ≤ 0.75", "0.75 < p̂ < 1", "p̂ = 1", "unknown")
RESAMPLES = 2000


@dataclass(frozen=True)
class RunFigures:
    """One run's figures (see the module docstring)."""

    run_id: str
    method: str
    seed: int
    metric: str  # "mean@k" or "greedy accuracy"
    curve: list[tuple[int, int, float]]  # (step, cumulative rollouts, metric) from the last pre-RL evaluation on
    rollouts: int
    effective: list[tuple[int, float]]  # (step, effective ratio)
    budget: dict[str, int]  # rollouts allotted per difficulty bin
    late: dict[str, float]  # the outcome mix of the last quarter of steps' groups: all_right, all_wrong, mixed
    origin: str = "store"  # or, for a run read from a --runs-file, the commit of the code that read it there

    @property
    def final(self) -> float:
        return self.curve[-1][2]

    @property
    def effective_ratio(self) -> float:
        return float(np.mean([ratio for _, ratio in self.effective])) if self.effective else math.nan

    def at_budget(self, budget: int) -> float:
        """The metric of the last evaluation made within `budget` rollouts."""
        return [value for _, rollouts, value in self.curve if rollouts <= budget][-1]

    def rollouts_to(self, target: float) -> int | None:
        return next((rollouts for _, rollouts, value in self.curve if value >= target), None)


@dataclass(frozen=True)
class Estimate:
    """A mean over seeds and its bootstrap 95% interval (nan bounds when fewer than two seeds have a value)."""

    mean: float
    low: float
    high: float
    seeds: int  # how many seeds gave a value

    def text(self, digits: int = 3) -> str:
        if math.isnan(self.mean):
            return "n/a"
        if math.isnan(self.low):
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


@dataclass(frozen=True)
class MethodFigures:
    """One method's figures over its seeds."""

    method: str
    runs: list[RunFigures]
    final: Estimate
    at_uniform_budget: Estimate | None  # None: no uniform runs to take the budget from
    rollouts_to_target: Estimate | None  # None: no target given; seeds < len(runs): not reached on every seed
    effective_ratio: Estimate
    compute_equivalence: Estimate | None  # None: no uniform runs
    late_all_right: Estimate
    late_all_wrong: Estimate
    notes: list[str] = field(default_factory=list)


class RunViews:
    """The store's views over one run's artifacts only, one snapshot for all of a run's queries: views over a store
    of many runs would read every run's file footers for each query (34 s a run in a store of 13 600-step runs,
    2026-12-04)."""

    def __init__(self, store: Store, run_id: str) -> None:
        self.con = connect(store, RUN_SQL, run_ids={run_id})

    def rows(self, sql: str) -> list[dict[str, Any]]:
        return self.con.sql(sql).to_arrow_table().to_pylist()

    def __enter__(self) -> RunViews:
        return self

    def __exit__(self, *_: object) -> None:
        self.con.close()


RUN_SQL = "; ".join(
    f"SELECT * FROM {kind}" for kind in ("rewards", "rollouts", "evals", "config", "restructured", "allocations")
)


def run_figures(store: Store, run_id: str, method: str, seed: int) -> RunFigures:
    """The figures of one finished run of the comparison, read from the store."""
    with RunViews(store, run_id) as views:
        return _figures(views, run_id, method, seed)


def _figures(views: RunViews, run_id: str, method: str, seed: int) -> RunFigures:
    rid = sql_string(run_id)
    groups = views.rows(
        "SELECT r.step, o.slot, count(*) AS n, min(r.score) <> max(r.score) AS mixed FROM rewards r JOIN rollouts o "
        f"ON o.rollout_id = r.rollout_id AND o.run_id = r.run_id WHERE r.run_id = {rid} GROUP BY r.step, o.slot",
    )
    per_step: dict[int, list[dict[str, Any]]] = {}
    for group in groups:
        per_step.setdefault(group["step"], []).append(group)
    checks = rewrite_checks(views, run_id)
    cumulative, total = {0: 0}, 0
    for step in sorted(per_step.keys() | checks.keys()):
        total += sum(g["n"] for g in per_step.get(step, [])) + checks.get(step, 0)
        cumulative[step] = total
    order = "step, CASE phase WHEN 'init' THEN 0 WHEN 'warmstart' THEN 1 ELSE 2 END"
    evals = views.rows(f"SELECT * FROM evals WHERE run_id = {rid} ORDER BY {order}")
    sampled = all(e.get("mean_at_k") is not None for e in evals)
    column = "mean_at_k" if sampled else "accuracy"
    before = [e for e in evals if e["phase"] != "rl"][-1:]  # the last evaluation before RL: 0 rollouts
    rl = [e for e in evals if e["phase"] == "rl"]
    curve = [(0, 0, float(e[column])) for e in before]
    curve += [(e["step"], cumulative.get(e["step"], total), float(e[column])) for e in rl]
    effective = [(step, float(np.mean([g["mixed"] for g in gs]))) for step, gs in sorted(per_step.items())]
    k = evals[-1].get("samples") if sampled and evals else None
    metric = f"mean@{k}" if k else "greedy accuracy"
    return RunFigures(
        run_id, method, seed, metric, curve, total, effective, budget(views, run_id), late_mix(views, run_id)
    )


def late_mix(views: RunViews, run_id: str) -> dict[str, float]:
    """The share of groups (a step's rollouts of one slot) in the last quarter of the run's steps that every rollout
    solved, that none solved, and the rest: the papers' regime has about 40% and 20% late in uniform training."""
    rows = views.rows(
        "WITH g AS (SELECT r.step, o.slot, count(*) AS n, count(*) FILTER (WHERE r.status = 'ok') AS solved "
        "FROM rewards r JOIN rollouts o ON o.rollout_id = r.rollout_id AND o.run_id = r.run_id "
        f"WHERE r.run_id = {sql_string(run_id)} GROUP BY r.step, o.slot) "
        "SELECT count(*) AS groups, count(*) FILTER (WHERE solved = n) AS all_right, "
        "count(*) FILTER (WHERE solved = 0) AS all_wrong FROM g "
        "WHERE step > (SELECT max(step) FROM g) * 3 / 4",
    )
    found = rows[0]
    if not found["groups"]:
        return {"all_right": math.nan, "all_wrong": math.nan, "mixed": math.nan}
    right, wrong = found["all_right"] / found["groups"], found["all_wrong"] / found["groups"]
    return {"all_right": right, "all_wrong": wrong, "mixed": 1.0 - right - wrong}


def rewrite_checks(views: RunViews, run_id: str) -> dict[int, int]:
    """Rollouts CLPO sampled to check its rewrites, per step, beyond the rollouts that got rewards: every check's
    `restructure.rollouts` when rewrites train a later step; with `join: same_step` a kept rewrite's samples are
    the step's rollouts already, so only those of rewrites not kept count (`allocate.n` each)."""
    rid = sql_string(run_id)
    config = json.loads(views.rows(f"SELECT config_json FROM config WHERE run_id = {rid}")[0]["config_json"])
    if not config.get("restructure", {}).get("enabled"):
        return {}
    same_step = config["restructure"].get("join") == "same_step"
    counted = "count(rewrite_accuracy) FILTER (WHERE NOT kept)" if same_step else "count(rewrite_accuracy)"
    each = config["allocate"]["n"] if same_step else config["restructure"]["rollouts"]
    rows = views.rows(f"SELECT step, {counted} AS n FROM restructured WHERE run_id = {rid} GROUP BY step")
    return {row["step"]: int(row["n"]) * int(each) for row in rows}


def budget(views: RunViews, run_id: str) -> dict[str, int]:
    """Rollouts allotted per difficulty bin of the estimate the allocator decided on (allocations.p_hat)."""
    rows = views.rows(
        f"SELECT p_hat, sum(n_rollouts) AS n FROM allocations WHERE run_id = {sql_string(run_id)} GROUP BY p_hat",
    )
    spread = dict.fromkeys(DIFFICULTY_BINS, 0)
    for row in rows:
        spread[difficulty_bin(row["p_hat"])] += int(row["n"] or 0)
    return spread


def difficulty_bin(p_hat: float | None) -> str:
    if p_hat is None or math.isnan(p_hat):
        return DIFFICULTY_BINS[-1]
    if p_hat <= 0:
        return DIFFICULTY_BINS[0]
    if p_hat >= 1:
        return DIFFICULTY_BINS[5]
    return DIFFICULTY_BINS[min(math.ceil(p_hat * 4), 4)]


def estimate(values: Sequence[float], seed: int = 0) -> Estimate:
    """The mean of `values` (one a seed; nan values left out) and its percentile-bootstrap 95% interval."""
    kept = np.array([v for v in values if not math.isnan(v)], dtype=float)
    if len(kept) == 0:
        return Estimate(math.nan, math.nan, math.nan, 0)
    if len(kept) < 2:
        return Estimate(float(kept[0]), math.nan, math.nan, 1)
    if np.all(kept == kept[0]):  # nothing to resample: the interval is the value
        return Estimate(float(kept[0]), float(kept[0]), float(kept[0]), len(kept))
    low, high = _bootstrap((kept,), np.mean, seed)
    return Estimate(float(kept.mean()), low, high, len(kept))


def _bootstrap(samples: tuple[np.ndarray, ...], statistic: Callable[..., float], seed: int) -> tuple[float, float]:
    from scipy.stats import bootstrap  # only here: scipy is slow to import

    result = bootstrap(
        samples,
        statistic,
        n_resamples=RESAMPLES,
        confidence_level=0.95,
        method="percentile",
        vectorized=False,
        paired=False,
        rng=np.random.default_rng(seed),
    )
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def uniform_rollouts_for(uniform: Sequence[RunFigures], value: float) -> float:
    """The rollouts at which uniform's mean curve (its seeds' metric and rollouts averaged evaluation by evaluation)
    first reaches `value`, linearly between evaluations; nan when it never does."""
    length = min(len(run.curve) for run in uniform)
    xs = np.mean([[point[1] for point in run.curve[:length]] for run in uniform], axis=0)
    ys = np.mean([[point[2] for point in run.curve[:length]] for run in uniform], axis=0)
    if ys[0] >= value:
        return float(xs[0])
    for i in range(1, length):
        if ys[i] >= value:
            return float(xs[i - 1] + (value - ys[i - 1]) / (ys[i] - ys[i - 1]) * (xs[i] - xs[i - 1]))
    return math.nan


def equivalence(method: Sequence[RunFigures], uniform: Sequence[RunFigures]) -> float:
    """Uniform's rollouts to the method's mean final metric over the method's mean rollouts (nan: uniform never
    got there)."""
    final = float(np.mean([run.final for run in method]))
    return uniform_rollouts_for(uniform, final) / float(np.mean([run.rollouts for run in method]))


def equivalence_estimate(method: list[RunFigures], uniform: list[RunFigures], seed: int = 0) -> Estimate:
    """The compute-equivalence ratio and its bootstrap interval, seeds of the method and of uniform resampled
    independently (a resample where uniform never reaches the method is left out of the interval)."""
    point = equivalence(method, uniform)
    if len(method) < 2 or len(uniform) < 2:
        return Estimate(point, math.nan, math.nan, len(method))
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(RESAMPLES):
        m = [method[i] for i in rng.integers(0, len(method), len(method))]
        u = [uniform[i] for i in rng.integers(0, len(uniform), len(uniform))]
        draws.append(equivalence(m, u))
    kept = np.array([d for d in draws if not math.isnan(d)])
    if len(kept) < RESAMPLES // 2:
        return Estimate(point, math.nan, math.nan, len(method))
    return Estimate(point, float(np.percentile(kept, 2.5)), float(np.percentile(kept, 97.5)), len(method))


def method_figures(runs: dict[str, list[RunFigures]], target: float | None) -> list[MethodFigures]:
    """Each method's figures over its seeds, uniform's runs (when compared) giving the budgets and the ratio."""
    uniform = runs.get("uniform")
    by_seed = {run.seed: run.rollouts for run in uniform or []}
    found = []
    for method, own in runs.items():
        notes = []
        at_budget = None
        if uniform:
            at_budget = estimate([run.at_budget(by_seed[run.seed]) for run in own if run.seed in by_seed])
        to_target = None
        if target is not None:
            reached = [run.rollouts_to(target) for run in own]
            to_target = estimate([math.nan if r is None else float(r) for r in reached])
            if to_target.seeds < len(own):
                notes.append(f"target {target:g} reached on {to_target.seeds} of {len(own)} seeds")
        ratio = equivalence_estimate(own, uniform) if uniform else None
        if ratio is not None and math.isnan(ratio.mean):
            notes.append("uniform's mean curve never reaches this method's final metric: ratio above its budget")
        found.append(
            MethodFigures(
                method,
                own,
                estimate([run.final for run in own]),
                at_budget,
                to_target,
                estimate([run.effective_ratio for run in own]),
                ratio,
                estimate([run.late["all_right"] for run in own]),
                estimate([run.late["all_wrong"] for run in own]),
                notes,
            )
        )
    return found
