"""`rlvr compare`: a config under several methods and seeds, as real runs in one store, then the figures read back
(flows/compare.py). Registered in flows/cli/commands.py. Exit status 1 when a run failed (run the same command
again to resume the comparison)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from rlvr.errors import UserError
from rlvr.flows.cli.common import StoreOption, store_root

if TYPE_CHECKING:
    from rlvr.flows.compare import CompareSpec

out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 170)  # a log or a pipe: a figure a line


def compare(
    config: Path | None = typer.Option(None, "--config", help="the run config every method starts from"),
    methods: str = typer.Option(
        "uniform,sec,knapsack",
        "--methods",
        help="comma-separated: uniform, sec, knapsack, sec+knapsack, dynamic, clpo, ...",
    ),
    seeds: int = typer.Option(3, "--seeds", min=1, help="seeds 0 .. N-1, each method once a seed"),
    name: str = typer.Option("compare", "--name", help="the comparison's name: its runs are NAME-METHOD-sSEED"),
    store: str | None = StoreOption,
    target: float | None = typer.Option(None, "--target", help="report rollouts to reach this held-out metric"),
    samples: int = typer.Option(8, "--samples", min=1, help="sampled answers a held-out problem: the metric is mean@k"),
    parallel: int = typer.Option(2, "--parallel", min=1, help="runs at a time (Dask workers or Ray CPUs)"),
    executor: str = typer.Option("threads", "--executor", help="threads (here), processes, dask or ray"),
    address: str | None = typer.Option(None, "--address", help="a Dask scheduler or Ray cluster to run on"),
    set_: list[str] = typer.Option([], "--set", help="override a config key for every run"),
    page: Path | None = typer.Option(None, "--page", help="write the HTML page here (default ./NAME.html)"),
    runs_file: Path | None = typer.Option(
        None,
        "--runs-file",
        help="a Parquet file of finished runs shared between stores: its runs are not run again, each run finished "
        "here is added to it",
    ),
    report_only: bool = typer.Option(
        False, "--report-only", help="start no run: the figures of the runs finished so far (in the store or file)"
    ),
) -> None:
    """Compare curricula and rollout budgets: each method on each seed is a real run (resumed where a run stopped);
    prints each method's figures with bootstrap 95% intervals, and stores them with an HTML page."""
    from rlvr.flows.compare import CompareSpec, check_configs

    spec = CompareSpec(
        name=name,
        config=None if config is None else str(config),
        methods=[m.strip() for m in methods.split(",") if m.strip()],
        seeds=list(range(seeds)),
        overrides=list(set_),
        target=target,
        samples=samples,
        parallel=parallel,
        executor=executor,
        address=address,
        runs_file=None if runs_file is None else str(runs_file),
        start_runs=not report_only,
    )
    spec.check()
    check_configs(spec)
    root = store_root(store)
    if report_only:
        _save_finished(root, spec)
    else:
        _run_all(root, spec)
    _report(root, spec, page or Path(f"{name}.html"))


def _save_finished(root: str, spec: CompareSpec) -> None:
    """`--report-only`: start no run; with `--runs-file`, add the store's finished runs to it."""
    from rlvr.flows.compare import save_finished
    from rlvr.storage.store import open_store

    open_store(root, create=True)
    if spec.runs_file is not None:
        out.print(f"{save_finished(root, spec)} run(s) of {root} added to {spec.runs_file}")


def _run_all(root: str, spec: CompareSpec) -> None:
    """Every run of the comparison to its end on the store's Prefect server; one line when any failed."""
    from rlvr.flows.compare import run_comparison
    from rlvr.flows.ui import point_prefect_at_store, ui_url_of
    from rlvr.storage.store import open_store

    target_server = point_prefect_at_store(open_store(root, create=True), need_server=True)
    server = target_server.start(started_by=f"rlvr compare {spec.name}")
    runs = len(spec.methods) * len(spec.seeds)
    out.print(f"{runs} runs in {root}; Prefect: {ui_url_of(target_server.api_url or '')}")
    try:
        ended = run_comparison(root, spec, out.print)
    finally:
        if server is not None:
            server.stop()
    failed = [e for e in ended if e["outcome"].startswith("failed")]
    for e in failed:
        out.print(f"[red]{e['run_id']} {e['outcome']}[/red]; its log: {e['log']}\n  " + "\n  ".join(e["tail"]))
    if failed:
        raise UserError(f"{len(failed)} run(s) failed; run the same command again to resume the comparison")


def _report(root: str, spec: CompareSpec, page_path: Path) -> None:
    from rlvr.flows.compare import commit_comparison, read_figures
    from rlvr.flows.compare_page import headers, render, table_rows

    metric, methods = read_figures(root, spec)
    notes = [f"{m.method}: {note}" for m in methods for note in m.notes]
    page = render(spec.name, spec.command(), metric, methods, notes)
    aid = commit_comparison(root, spec, metric, methods, page)
    page_path.write_text(page)
    seeds = sorted({len(m.runs) for m in methods})
    over = f"{seeds[0]}" if len(seeds) == 1 else f"{seeds[0]}-{seeds[-1]}"
    table = Table(title=f"{spec.name}: means over {over} seeds, bootstrap 95% intervals")
    for header in headers(metric):
        table.add_column(header)
    for row in table_rows(methods):
        table.add_row(*row)
    out.print(table)
    for note in notes:
        out.print(f"note: {note}")
    out.print(f"stored as {aid} (SELECT * FROM comparisons); page: {page_path}")
