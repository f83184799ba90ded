"""`rlvr check`: verify a whole store (local or on object storage) and say what a resume would rebuild; with
`--semantics`, check instead what the runs' rows say of each other (flows/semantics.py).

Registered in flows/cli/commands.py. Exit status 0 when nothing is damaged (no invariant broken), 1 when something
is.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from rlvr.errors import UserError

if TYPE_CHECKING:  # the store's modules load pyarrow, DuckDB and fsspec: not for every `rlvr` command's start
    from rlvr.storage.integrity import Damage, Leftovers
    from rlvr.storage.manifest import Manifest
    from rlvr.storage.store import Store

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def check(
    run_ids: list[str] = typer.Argument(None, metavar="[RUN_ID ...]", help="only these runs (default: all)"),
    store: str | None = typer.Option(None, "--store", help="store root (default $RLVR_STORE or ./rlvr-store)"),
    clean: bool = typer.Option(
        False, "--clean", help="also remove what killed writers left (never a live run's work in flight)"
    ),
    semantics: bool = typer.Option(
        False,
        "--semantics",
        help="check the runs' invariants instead (statuses agree with scores, no error row trained on, loss masks "
        "match turns, kept groups have signal, rows in equal rows out): one line per violation",
    ),
) -> None:
    """Verify every committed file against its manifest (size, sha256, Parquet footer), find unreadable
    manifests, run records and Prefect database, and say what `rlvr resume` would rebuild."""
    from rlvr.flows.cli.common import open_existing, store_root
    from rlvr.flows.prefect_env import prefect_database_problem
    from rlvr.storage.integrity import clean_leftovers, find_leftovers

    found = open_existing(store)
    if semantics:
        if clean:
            raise UserError("--clean cleans files, --semantics checks rows: give one of them")
        _check_semantics(found, run_ids or sorted(str(r.get("run_id")) for r in found.list_runs()))
        return
    started = time.monotonic()
    damage, manifests = _verify(found, run_ids or None)
    found.list_runs()  # fills `unreadable` with run records that cannot be read
    records = sorted({path: why for path, why in found.unreadable.items() if _is_run_record(found, path)}.items())
    prefect = prefect_database_problem(found)
    size = sum(entry["bytes"] for m in manifests for entry in m.files)
    out.print(
        f"checked {len(manifests)} artifacts ({size / 1e6:.1f} MB) in {time.monotonic() - started:.1f} s: "
        f"{len(damage)} damaged, {len(records)} unreadable run records"
        + ("" if prefect is None else ", Prefect's database damaged")
    )
    _print_damage(damage, store_root(store))
    for _path, why in records:
        out.print(why, markup=False, highlight=False)
    if prefect is not None:
        out.print(prefect, markup=False, highlight=False)
    _print_leftovers(find_leftovers(found), clean)
    if clean:
        removed = clean_leftovers(found)
        out.print(f"removed {len(removed)} leftover paths of killed writers")
    if damage or records or prefect is not None:
        raise typer.Exit(1)


def _check_semantics(store: Store, run_ids: list[str]) -> None:
    """Each run's violations, one line each, or its one-line summary when it has none; exit 1 on any violation."""
    from rlvr.flows.semantics import check_run

    if not run_ids:
        raise UserError(f"store {store.root} has no runs to check")
    broken = False
    for run_id in run_ids:
        report = check_run(store, run_id)
        for note in report.notes:
            out.print(f"run {run_id}: {note}", markup=False, highlight=False)
        for violation in report.violations:
            out.print(f"run {run_id}: {violation.line()}", markup=False, highlight=False)
        if not report.violations:
            out.print(report.summary(), markup=False, highlight=False)
        broken = broken or bool(report.violations)
    if broken:
        raise typer.Exit(1)


def _verify(store: Store, run_ids: list[str] | None) -> tuple[list[Damage], list[Manifest]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rlvr.storage.integrity import find_damage

    manifests = [m for m in store.manifests() if run_ids is None or m.run_id in run_ids]
    bar = Progress(TextColumn("verifying"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err)
    with bar:
        task = bar.add_task("verify", total=len(manifests))
        damage = find_damage(store, run_ids, checked=lambda _: bar.advance(task))
    return damage, manifests


def _is_run_record(store: Store, path: str) -> bool:
    runs_dir = store.fs._strip_protocol(store.path("runs")).rstrip("/")
    return str(store.fs._strip_protocol(path)).startswith(runs_dir + "/")


def _print_damage(damage: list[Damage], root: str) -> None:
    """A block per damaged artifact: long ids and paths do not fit a table's cells."""
    for d in damage:
        step = "" if d.step is None else f", step {d.step}"
        out.print(f"\ndamaged: {d.kind} {d.artifact_id} (run {d.run_id or '?'}{step})", markup=False, highlight=False)
        out.print(f"  file:    {d.path}", markup=False, highlight=False)
        out.print(f"  problem: {d.problem}", markup=False, highlight=False)
        action = (
            f"rebuilds it: rlvr resume {d.run_id} --store {root}"
            if d.rebuildable
            else f"cannot rebuild it: {d.blocker}"
        )
        out.print(f"  resume:  {action}", markup=False, highlight=False)


def _print_leftovers(groups: list[Leftovers], clean: bool) -> None:
    if not groups:
        return
    table = Table("run", "uncommitted folders", "state")
    for g in sorted(groups, key=lambda g: not g.live):
        state = "in flight (a live process owns the run)" if g.live else "left by a killed writer"
        table.add_row(g.run_id or "(names no run)", str(len(g.folders)), state)
    out.print(table)
    dead = [g for g in groups if not g.live]
    if dead and not clean:
        out.print("`rlvr check --clean` removes what killed writers left; `rlvr resume RUN` of such a run does too")
