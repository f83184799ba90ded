"""`rlvr compare` (flows/compare.py, compare_figures.py, compare_page.py): two methods on two seeds of three steps are
four real runs in one store (processes of their own, on the session's Prefect server); the figures stored and drawn
are the runs' own, read again here with plain SQL; a second invocation resumes nothing and stores the same artifact.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlvr.flows.cli import app
from rlvr.flows.compare_figures import RunFigures
from rlvr.storage.store import Store
from rlvr.storage.views import query

SMALL = [
    "train.steps=3",
    "evaluate.every=1",
    "select.batch_size=8",
    "allocate.n=4",
    "warmstart.steps=5",
    "synthesize.source.per_category=4",
    "difficulty.k=1",
]
RUNS = {f"cmp-{method}-s{seed}" for method in ("uniform", "knapsack") for seed in (0, 1)}


def compare(store: Path, page: Path, methods: str = "uniform,knapsack", extra: list[str] | None = None) -> object:
    args = ["compare", "--store", str(store), "--name", "cmp", "--methods", methods, "--seeds", "2", "--samples", "2"]
    args += ["--target", "0.05", "--page", str(page)]
    for item in SMALL:
        args += ["--set", item]
    return CliRunner().invoke(app, args + (extra or []))


def rows(store: Store, sql: str) -> list[dict]:
    return query(store, sql).to_pylist()


@pytest.mark.slow
def test_a_two_method_two_seed_comparison_stores_the_runs_figures_and_page(tmp_path, monkeypatch, prefect_api):
    monkeypatch.setenv("PREFECT_API_URL", prefect_api)  # the runs, processes of their own, record their flows there
    root, page = tmp_path / "store", tmp_path / "cmp.html"
    result = compare(root, page)
    assert result.exit_code == 0, result.output
    store = Store.open(str(root))
    assert {r["run_id"] for r in store.list_runs()} == RUNS
    assert all(r["status"] == "completed" for r in store.list_runs())

    per_run = {r["run_id"]: r for r in rows(store, "SELECT * FROM comparison_runs")}
    assert per_run.keys() == RUNS
    for run_id, run in per_run.items():  # each figure is the run's own, read again here
        last = rows(store, f"SELECT mean_at_k FROM evals WHERE run_id = '{run_id}' AND phase = 'rl' ORDER BY step")
        assert run["metric"] == "mean@2" and run["final"] == last[-1]["mean_at_k"]
        rewarded = rows(store, f"SELECT count(*) AS n FROM rewards WHERE run_id = '{run_id}'")[0]["n"]
        assert run["rollouts"] == rewarded == run["curve_rollouts"][-1] == sum(run["budget_rollouts"])
        assert run["curve_steps"] == [0, 1, 2, 3] and run["curve_rollouts"][0] == 0
        # step 3 is the last quarter's: its groups' outcomes, counted here from the rewards
        groups = rows(
            store,
            "SELECT count(*) FILTER (WHERE status = 'ok') AS ok, count(*) AS n FROM rewards r JOIN rollouts o "
            f"USING (rollout_id) WHERE r.run_id = '{run_id}' AND r.step = 3 GROUP BY o.slot",
        )
        assert run["late_all_right"] == sum(g["ok"] == g["n"] for g in groups) / len(groups)
        assert run["late_all_wrong"] == sum(g["ok"] == 0 for g in groups) / len(groups)

    methods = {r["method"]: r for r in rows(store, "SELECT * FROM comparisons")}
    assert methods.keys() == {"uniform", "knapsack"}
    for method, m in methods.items():
        finals = [per_run[f"cmp-{method}-s{seed}"]["final"] for seed in (0, 1)]
        assert m["seeds"] == 2 and m["final"] == pytest.approx(sum(finals) / 2)
        assert m["final_low"] <= m["final"] <= m["final_high"]
        assert min(finals) <= m["final_low"] and m["final_high"] <= max(finals)
    uniform = methods["uniform"]
    assert uniform["at_uniform_budget"] == pytest.approx(uniform["final"])  # its own budget: its last evaluation
    assert uniform["compute_equivalence"] is None or uniform["compute_equivalence"] <= 1.0 + 1e-9

    (summary,) = store.manifests(kind="comparisons")
    (runs_artifact,) = summary.parents
    lasts = {
        m.run_id: max(store.manifests(kind="evals", run_id=m.run_id), key=lambda e: e.step or 0).artifact_id
        for m in store.manifests(kind="config")
    }
    assert set(store.manifest(runs_artifact).parents) == set(lasts.values())
    html = page.read_text()
    assert store.read_file(summary.artifact_id, "comparison.html").decode() == html
    assert html.count("<svg") == 3 and "mean@2 at uniform&#x27;s budget" in html and ">knapsack</td>" in html
    assert "knapsack" in result.output and "bootstrap 95% intervals" in result.output

    again = compare(root, page)
    assert again.exit_code == 0, again.output
    assert again.output.count("completed before") == 4
    assert [m.artifact_id for m in Store.open(str(root)).manifests(kind="comparisons")] == [summary.artifact_id]
    the_runs_file_carries_the_comparison_to_another_store(tmp_path, root, methods)


def the_runs_file_carries_the_comparison_to_another_store(tmp_path: Path, root: Path, methods: dict) -> None:
    """`--report-only --runs-file F` saves the store's finished runs to F; another store reads the same figures
    from F alone, starts none of F's runs, and refuses F under another config in one line."""
    runs_file = tmp_path / "shared" / "runs.parquet"
    saved = compare(root, tmp_path / "p1.html", extra=["--runs-file", str(runs_file), "--report-only"])
    assert saved.exit_code == 0, saved.output
    assert f"4 run(s) of {root} added to {runs_file}" in saved.output

    other = tmp_path / "other"
    read = compare(other, tmp_path / "p2.html", extra=["--runs-file", str(runs_file), "--report-only"])
    assert read.exit_code == 0, read.output
    store = Store.open(str(other))
    assert store.list_runs() == [] or {r["run_id"] for r in store.list_runs()} == {"compare-cmp"}
    again = {r["method"]: r for r in rows(store, "SELECT * FROM comparisons")}
    for method, m in methods.items():  # the same figures, intervals included, from the file as from the runs
        for key in ("final", "final_low", "final_high", "effective_ratio", "compute_equivalence", "at_uniform_budget"):
            assert again[method][key] == m[key], (method, key)
    origins = {r["origin"] for r in rows(store, "SELECT origin FROM comparison_runs")}
    assert len(origins) == 1 and origins != {"store"}  # the commit that read them

    ran = compare(other, tmp_path / "p3.html", extra=["--runs-file", str(runs_file)])
    assert ran.exit_code == 0, ran.output
    assert "4 run(s) taken from" in ran.output and "completed" not in ran.output
    assert {r["run_id"] for r in Store.open(str(other)).list_runs()} <= {"compare-cmp"}

    refused = compare(other, tmp_path / "p4.html", extra=["--runs-file", str(runs_file), "--set", "allocate.n=2"])
    assert refused.exit_code != 0
    message = str(refused.exception) + refused.output
    assert "--runs-file has run cmp-uniform-s0 under another config than this comparison gives it" in message


def test_an_unknown_method_is_refused_in_one_line_before_any_run(tmp_path):
    result = compare(tmp_path / "store", tmp_path / "p.html", methods="uniform,spiral")
    assert result.exit_code != 0
    assert "unknown method(s) spiral; known: uniform, sec, knapsack" in str(result.exception) + result.output
    assert not (tmp_path / "store").exists()


def curve_run(method: str, seed: int, values: list[float], per_step: int = 100) -> RunFigures:
    from rlvr.flows.compare_figures import DIFFICULTY_BINS

    curve = [(step, step * per_step, value) for step, value in enumerate(values)]
    late = {"all_right": 0.0, "all_wrong": 0.0, "mixed": 1.0}
    return RunFigures(
        f"{method}-{seed}",
        method,
        seed,
        "mean@2",
        curve,
        curve[-1][1],
        [(1, 0.5)],
        dict.fromkeys(DIFFICULTY_BINS, 0),
        late,
    )


def test_the_compute_equivalence_ratio_reads_uniforms_mean_curve_by_hand():
    """Uniform's seeds average to 0.1, 0.3, 0.5 at 0, 100, 200 rollouts; a method that ends at 0.4 after 100
    rollouts needs 150 of uniform's (halfway from 0.3 to 0.5): 1.5x. One that ends above uniform's best has none."""
    from rlvr.flows.compare_figures import equivalence, method_figures, uniform_rollouts_for

    uniform = [curve_run("uniform", 0, [0.0, 0.2, 0.4]), curve_run("uniform", 1, [0.2, 0.4, 0.6])]
    assert uniform_rollouts_for(uniform, 0.4) == pytest.approx(150.0)
    assert uniform_rollouts_for(uniform, 0.1) == 0.0  # reached before any rollout
    fast = [curve_run("fast", 0, [0.1, 0.4], per_step=100), curve_run("fast", 1, [0.1, 0.4], per_step=100)]
    assert equivalence(fast, uniform) == pytest.approx(1.5)
    assert math.isnan(equivalence([curve_run("best", 0, [0.1, 0.7])], uniform))
    found = {m.method: m for m in method_figures({"uniform": uniform, "fast": fast}, target=0.4)}
    assert found["fast"].compute_equivalence.mean == pytest.approx(1.5)
    assert found["fast"].rollouts_to_target.mean == 100.0 and found["fast"].rollouts_to_target.seeds == 2
    assert found["uniform"].rollouts_to_target.seeds == 2  # seed 0 at 200, seed 1 at 100
    assert found["uniform"].rollouts_to_target.mean == 150.0
    assert found["fast"].at_uniform_budget.mean == pytest.approx(0.4)  # its last evaluation within 200 rollouts
    final = found["uniform"].final
    assert final.mean == pytest.approx(0.5) and 0.4 <= final.low <= final.high <= 0.6


def test_an_estimate_of_equal_values_is_that_value_and_of_one_value_has_no_interval():
    from rlvr.flows.compare_figures import estimate

    same = estimate([0.3, 0.3, 0.3])
    assert (same.mean, same.low, same.high, same.seeds) == (0.3, 0.3, 0.3, 3)
    one = estimate([0.7, math.nan])
    assert one.mean == 0.7 and one.seeds == 1 and math.isnan(one.low) and one.text() == "0.700"


def test_the_runs_evaluate_with_the_asked_samples_unless_the_config_or_a_set_says_how_many(tmp_path):
    from rlvr.flows.compare import CompareSpec, config_samples, jobs_of

    config = tmp_path / "c.yaml"
    config.write_text("evaluate: {samples: 4}\n")
    spec = CompareSpec(name="c", config=str(config), methods=["uniform", "sec"], seeds=[0, 1], overrides=[])
    assert config_samples(spec) == 4
    assert not any(o.startswith("evaluate.samples=") for job in jobs_of(spec, 4) for o in job.overrides)
    plain = CompareSpec(name="c", config=None, methods=["uniform"], seeds=[0], overrides=[], samples=6)
    (job,) = jobs_of(plain, config_samples(plain))
    assert job.overrides[0] == "evaluate.samples=6" and job.overrides[-1] == "seed=0"
    assert job.run_id == "c-uniform-s0" and "select.type=uniform" in job.overrides
    given = CompareSpec(name="c", config=None, methods=["uniform"], seeds=[0], overrides=["evaluate.samples=3"])
    assert [o for o in jobs_of(given)[0].overrides if o.startswith("evaluate.samples=")] == ["evaluate.samples=3"]


def test_a_runs_file_row_gives_the_run_back_whole_and_a_foreign_file_is_refused_in_one_line(tmp_path):
    from dataclasses import replace

    from rlvr.errors import UserError
    from rlvr.flows.compare_runs_file import add_to_runs_file, figures_of_row, figures_row, read_runs_file

    run = replace(curve_run("sec", 3, [0.1, 0.25, 0.5]), effective=[(1, 0.5), (2, 0.25)], origin="abc1234")
    run.late.update(all_right=math.nan)  # a run too short for a late quarter keeps its nan
    path = tmp_path / "runs.parquet"
    add_to_runs_file(path, [figures_row(run, "c", "{}")])
    add_to_runs_file(path, [figures_row(replace(run, run_id="sec-4", seed=4), "c", "{}")])
    back = read_runs_file(path)
    assert sorted(back) == ["sec-3", "sec-4"]
    again = figures_of_row(back["sec-3"])
    assert again.curve == run.curve and again.effective == run.effective and again.budget == run.budget
    assert (again.run_id, again.seed, again.metric, again.rollouts, again.origin) == (
        "sec-3",
        3,
        "mean@2",
        200,
        "abc1234",
    )
    assert math.isnan(again.late["all_right"]) and again.late["mixed"] == 1.0
    assert not list(tmp_path.glob(".*.part"))

    (tmp_path / "notes.parquet").write_text("not parquet")
    with pytest.raises(UserError, match=r"^--runs-file .*notes.parquet: not a comparison's runs file \("):
        read_runs_file(tmp_path / "notes.parquet")


def test_a_ratio_reads_as_a_ratio_with_its_interval_and_none_is_n_a():
    from rlvr.flows.compare_figures import Estimate
    from rlvr.flows.compare_page import ratio_text

    assert ratio_text(Estimate(0.69, 0.42, 0.914, 5)) == "0.69x [0.42, 0.91]"
    assert ratio_text(Estimate(1.0, math.nan, math.nan, 1)) == "1.00x"
    assert ratio_text(Estimate(math.nan, math.nan, math.nan, 0)) == "n/a"
