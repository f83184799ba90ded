"""Curricula and rollout budgets side by side: uniform, SEC, Knapsack, SEC + Knapsack, dynamic sampling,
CLPO (rewrites for later steps, or the paper's same-step), GHPO's hints and SEED-GRPO on the same task, several seeds,
compared at equal total rollouts.

Each (method, seed) is a real `rlvr run` in its own store (two at a time, one per core). Figures, all read
back from the stores with SQL:
  - effective-gradient ratio: share of all generated groups (every round, before any filter) whose
    rewards are not all equal;
  - rollouts to target: generated rollouts (CLPO's rewrite checks included) up to the first evaluation at
    or above the target held-out accuracy (None when never reached within the budget);
  - accuracy at budget: held-out accuracy of the last evaluation before the method's rollouts exceed the
    budget (uniform's total);
  - wall time of the run.

    python benchmarks/curriculum.py [--seeds 0 1 2] [--steps 300] [--target 0.6] [--config FILE] [--set key=value ...]

On the real model (docs/real-model.md, "Curricula on the real model"; needs `make smollm2`):

    python benchmarks/curriculum.py --config examples/smollm2-arithmetic-mixed.yaml --seeds 1 2 3 --steps 20 \
        --every 5 --target 0.3 --set policy.threads=1 --out /tmp/curricula-real
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rlvr.flows.compare import METHODS  # the methods `rlvr compare` runs, by the same names


def run_one(
    root: Path, method: str, seed: int, steps: int, every: int, overrides: list[str], config: str | None = None
) -> float:
    """One `rlvr run` (from `config` when given); returns its wall seconds."""
    store = store_path(root, method, seed)
    sets = [*METHODS[method], f"seed={seed}", f"train.steps={steps}", f"evaluate.every={every}", *overrides]
    command = [sys.executable, "-m", "rlvr.flows.cli", "run", "--store", str(store), "--run-id", "bench"]
    if config is not None:
        command += ["--config", config]
    for item in sets:
        command += ["--set", item]
    env = {**os.environ, "PREFECT_LOGGING_LEVEL": "ERROR"}
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{method} seed {seed} failed: {result.stderr[-2000:]}")
    return time.monotonic() - started


def store_path(root: Path, method: str, seed: int) -> Path:
    return root / f"{method.replace(' ', '_').replace('+', '_')}-{seed}"


def run_seconds(root: Path, method: str, seed: int) -> float:
    """The wall time of a finished run, from its run record (for --report)."""
    from datetime import datetime

    from rlvr.storage.store import Store

    record = Store.open(str(store_path(root, method, seed))).read_run("bench") or {}
    started, ended = record.get("created_at"), record.get("updated_at")
    if not started or not ended:
        raise SystemExit(f"{method} seed {seed}: no finished run in {store_path(root, method, seed)}")
    return (datetime.fromisoformat(ended) - datetime.fromisoformat(started)).total_seconds()


def rows(root: Path, method: str, seed: int, sql: str) -> list[dict]:
    """The rows of one read-only query over the store of (method, seed)."""
    from rlvr.storage.store import Store
    from rlvr.storage.views import query

    return query(Store.open(str(store_path(root, method, seed))), sql).to_pylist()


def figures(root: Path, method: str, seed: int, budget: int | None, target: float) -> dict:
    """The method's figures from its store (see the module docstring), counted as `rlvr compare` counts them
    (rlvr.flows.compare_figures): the metric is mean@k when the runs sampled answers, else greedy accuracy."""
    from rlvr.flows.compare_figures import run_figures
    from rlvr.storage.store import Store

    run = run_figures(Store.open(str(store_path(root, method, seed))), "bench", method, seed)
    reached = run.rollouts_to(target)
    return {
        "effective_ratio": run.effective_ratio,
        "rollouts": run.rollouts,
        "rollouts_to_target": None if reached is None or (budget is not None and reached > budget) else reached,
        "accuracy": run.final if budget is None else run.at_budget(budget),
    }


def audit(root: Path, method: str, seed: int) -> dict[str, str]:
    """Why a method did what it did, from its store's audit columns: the share of its rollouts per category,
    Knapsack's rollouts per case, dynamic sampling's groups kept and filtered, CLPO's rewrites."""

    def ask(sql: str) -> list[dict]:
        return rows(root, method, seed, sql)

    by_category = ask(
        "SELECT p.category, count(*) AS n, avg(r.score) AS reward FROM rewards r JOIN problems p USING (problem_id) "
        "GROUP BY 1 ORDER BY 1"
    )
    total = sum(r["n"] for r in by_category)
    found = {
        "rollouts by category (share, mean reward)": ", ".join(
            f"{r['category']} {r['n'] / total:.2f} ({r['reward']:.2f})" for r in by_category
        )
    }
    if "knapsack" in method:
        cases = ask('SELECT "case", sum(n_rollouts) AS n FROM allocations GROUP BY 1 ORDER BY 1')
        found["knapsack rollouts by case"] = ", ".join(f"{c['case']} {c['n']}" for c in cases)
    if method == "dynamic":
        groups = ask("SELECT reason, count(*) AS n FROM filtered_groups GROUP BY 1 ORDER BY 1")
        rounds = ask("SELECT count(DISTINCT (step, round)) AS n FROM filtered_groups")[0]["n"]
        found["groups (filter)"] = ", ".join(f"{g['reason']} {g['n']}" for g in groups) + f"; {rounds} rounds"
    found["all-wrong groups, share by quarter of the run"] = all_wrong_by_quarter(ask)
    if method == "ghpo":
        found["hints"] = hint_audit(ask)
    if method.startswith("clpo"):
        made = ask(
            "SELECT count(rewrite_prompt) AS made, count(rewrite_accuracy) AS checked, "
            "count(*) FILTER (WHERE kept) AS kept FROM restructured"
        )[0]
        found["rewrites"] = f"made {made['made']}, verified {made['checked']}, kept {made['kept']}"
    return found


def all_wrong_by_quarter(ask) -> str:
    """The share of groups with no correct sample (raw correctness), per quarter of the run's steps."""
    groups = ask(
        "SELECT o.step, bool_or(r.status = 'ok') AS solved FROM rewards r JOIN rollouts o USING (rollout_id) "
        "GROUP BY o.step, o.slot"
    )
    last = max(g["step"] for g in groups)
    shares = []
    for quarter in range(4):
        inside = [g for g in groups if quarter * last / 4 < g["step"] <= (quarter + 1) * last / 4]
        shares.append(f"{sum(not g['solved'] for g in inside) / len(inside):.2f}" if inside else "n/a")
    return ", ".join(shares)


def hint_audit(ask) -> str:
    """GHPO: hinted groups and how often they were solved, and the hard problems that became solvable without a
    hint (a hinted draw, then a later unhinted group with a correct sample)."""
    hinted = ask(
        "SELECT count(*) AS n, count(*) FILTER (WHERE solved) AS solved FROM (SELECT o.step, o.slot, "
        "bool_or(r.status = 'ok') AS solved FROM rollouts o JOIN rewards r USING (rollout_id) "
        "WHERE o.hint_ratio > 0 GROUP BY 1, 2)"
    )[0]
    unaided = ask(
        "WITH g AS (SELECT o.step, o.slot, o.problem_id, max(o.hint_ratio) AS hint, bool_or(r.status = 'ok') AS solved "
        "FROM rollouts o JOIN rewards r USING (rollout_id) GROUP BY 1, 2, 3) "
        "SELECT count(DISTINCT h.problem_id) AS hinted, count(DISTINCT s.problem_id) AS unaided FROM g h "
        "LEFT JOIN g s ON s.problem_id = h.problem_id AND s.step > h.step AND s.hint = 0 AND s.solved WHERE h.hint > 0"
    )[0]
    return (
        f"{hinted['n']} hinted groups ({hinted['solved']} with a correct sample); of {unaided['hinted']} problems "
        f"ever hinted, {unaided['unaided']} later solved without a hint"
    )


def uniform_budgets(root: Path, seeds: list[int], target: float) -> dict[int, int | None]:
    """Each seed's budget: the rollouts uniform selection spent, from its store under `root` (run in this call or
    an earlier one); None for every seed (each run's figures at its own end) when a seed has no uniform run."""
    if all(store_path(root, "uniform", s).exists() for s in seeds):
        return {s: figures(root, "uniform", s, None, target)["rollouts"] for s in seeds}
    print(f"no uniform run under {root} for every seed: figures at each run's end, no ratios against uniform")
    return dict.fromkeys(seeds)


def summarise(results: dict[str, list[dict]]) -> None:
    print(f"{'method':18}{'eff. ratio':>12}{'rollouts to target':>22}{'acc at budget':>22}{'wall s':>9}")
    for method, rows in results.items():
        eff = statistics.mean(r["effective_ratio"] for r in rows)
        reached = [r["rollouts_to_target"] for r in rows]
        to_target = (
            f"{statistics.mean(reached):.0f}"
            if all(x is not None for x in reached)
            else f"{sum(x is not None for x in reached)}/{len(reached)} seeds"
        )
        accs = [r["accuracy"] for r in rows if r["accuracy"] is not None]
        acc = f"{statistics.mean(accs):.2f} ({min(accs):.2f}-{max(accs):.2f})" if accs else "n/a"
        wall = statistics.mean(r["seconds"] for r in rows)
        print(f"{method:18}{eff:>12.3f}{to_target:>22}{acc:>22}{wall:>9.0f}")
    if "uniform" not in results:
        return
    base = results["uniform"]
    base_eff = statistics.mean(r["effective_ratio"] for r in base)
    if "knapsack" in results:
        knap_eff = statistics.mean(r["effective_ratio"] for r in results["knapsack"])
        print(f"knapsack / uniform effective-gradient ratio: {knap_eff / base_eff:.2f}x (target >= 1.20x)")
    for method in (m for m in ("sec", "knapsack", "sec+knapsack") if m in results):
        pairs = [(m["rollouts_to_target"], u["rollouts_to_target"]) for m, u in zip(results[method], base)]
        if all(m is not None and u is not None for m, u in pairs):
            ratio = statistics.mean(m / u for m, u in pairs)
            print(f"{method} rollouts to target / uniform: {ratio:.2f}x (target <= 0.80x)")
        else:
            print(f"{method} rollouts to target / uniform: not comparable, target not reached on every seed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=20, help="evaluate every this many steps")
    parser.add_argument("--target", type=float, default=0.6, help="held-out accuracy to reach")
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--config", default=None, help="a run config (e.g. examples/smollm2-arithmetic-mixed.yaml)")
    parser.add_argument("--out", type=Path, default=None, help="keep the stores here (default: a temp dir)")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--report", action="store_true", help="only read the finished stores under --out again")
    parser.add_argument("--audit", action="store_true", help="also print each run's audit figures (why)")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="rlvr-curriculum-"))
    jobs = [(m, s) for s in args.seeds for m in args.methods]
    if args.report:
        seconds = {(m, s): run_seconds(root, m, s) for m, s in jobs}
    else:
        with ThreadPoolExecutor(args.parallel) as pool:
            runs = pool.map(lambda j: run_one(root, *j, args.steps, args.every, args.overrides, args.config), jobs)
            seconds = dict(zip(jobs, runs))
    budgets = uniform_budgets(root, args.seeds, args.target)
    results = {
        m: [{**figures(root, m, s, budgets[s], args.target), "seconds": seconds[(m, s)]} for s in args.seeds]
        for m in args.methods
    }
    (root / "results.json").write_text(json.dumps(results, indent=2))
    print(f"stores and results.json in {root}")
    summarise(results)
    if args.audit:
        for m, s in jobs:
            print(f"\n{m}, seed {s}:")
            for name, text in audit(root, m, s).items():
                print(f"  {name}: {text}")


if __name__ == "__main__":
    main()
