"""The data commands of the CLI: `rlvr data`, `rlvr difficulty`, `rlvr export` (registered in flows/cli/commands.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from rlvr.errors import UserError

out = Console(soft_wrap=True, width=max(120, Console().width))  # the summary table needs the room
err = Console(stderr=True, soft_wrap=True)


def input_source(path: Path, verifier: str | None) -> dict[str, Any]:
    """The source config of `rlvr data --input PATH`: a file, or a folder `datasets` can load."""
    if not path.exists():
        raise UserError(f"input {str(path)!r} does not exist")
    if not (path.is_file() or path.is_dir()):  # /dev/null, a pipe: refused now, not once the flow has started
        kinds = ".jsonl, .json, .csv or .parquet"
        raise UserError(f"input {str(path)!r} is neither a file nor a folder; give a {kinds} file")
    if path.is_file() and path.stat().st_size == 0:
        raise UserError(f"input {str(path)!r} is empty: there is nothing to read")
    source: dict[str, Any] = {"type": "dataset" if path.is_dir() else "file", "path": str(path), "name": path.stem}
    if verifier:
        source["verifier"] = verifier
    return source


def data_config(input: Path | None, config: Path | None, verifier: str | None, overrides: list[str]) -> Any:
    """The run config of a data run: the full form from --config, or one source from --input."""
    from rlvr.flows.config import load_config

    if (input is None) == (config is None):
        raise UserError("give exactly one of --input FILE or --config FILE.yaml")
    if verifier and input is None:
        raise UserError("--verifier goes with --input; in a config, set it on each source")
    if input is None:
        return load_config(config, overrides)
    return load_config(None, [*overrides, f"synthesize.sources=[{json.dumps(input_source(input, verifier))}]"])


def data(
    input: Path | None = typer.Option(
        None, "--input", help="one JSONL, JSON, CSV or Parquet file, or a datasets folder"
    ),
    config: Path | None = typer.Option(None, "--config", help="YAML with a synthesize section (sources, ...)"),
    verifier: str | None = typer.Option(None, "--verifier", help="the verifier of --input rows without one"),
    policy: str | None = typer.Option(None, "--policy", help='estimate difficulty with a checkpoint id, or "init"'),
    store: str | None = typer.Option(None, "--store", help="store root (default $RLVR_STORE or ./rlvr-store)"),
    run_id: str | None = typer.Option(None, "--run-id", help="name the data run (default: a new timestamped id)"),
    set_: list[str] = typer.Option([], "--set", help="override a config key, e.g. --set synthesize.size=5000"),
) -> None:
    """Run the data stages alone: read the sources, validate, deduplicate, decontaminate, split (+ difficulty)."""
    from rlvr.flows.cli.common import flow_store, open_existing

    root = flow_store(store)
    from rlvr.flows.config import require_problems
    from rlvr.flows.runs import execute_data, new_run_id

    cfg = data_config(input, config, verifier, [*set_, *([f"run_id={run_id}"] if run_id else [])])
    if cfg.run_id is None:
        cfg = cfg.model_copy(update={"run_id": new_run_id().replace("run-", "data-", 1)})
    summary = _with_status(lambda: execute_data(root, cfg, policy, new=True))
    found = open_existing(root)
    print_data_summary(found, summary)
    require_problems(found, summary["problems_id"], cfg.run_id)  # nothing accepted: one line, exit status 2


def _with_status(start: Any) -> Any:
    """Run `start` under a progress bar: the data phase running, and shards done of a sharded stage."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rlvr.flows.cli.common import with_progress

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    bar = Progress(*columns, console=err)
    task = bar.add_task("starting", total=None)

    def update(event: str, fields: dict[str, Any]) -> None:
        if event == "stage":
            bar.update(task, description=fields["name"], total=None, completed=0)
        elif event == "data":
            where = fields.get("source") or f"{fields.get('rows', 0)} rows"
            bar.update(task, description=f"synthesize: {fields['phase']} ({where})")
        elif event == "shard":
            bar.update(task, description=f"{fields['stage']} shards", total=fields["total"], completed=fields["done"])

    return with_progress(start, bar, update)


def source_table(counts: dict[str, dict[str, Any]]) -> Table:
    table = Table("source", "read", "accepted", "quarantined", "by check", "duplicates", "contaminated", expand=False)
    for name, c in counts.items():
        checks = ", ".join(f"{k} {v}" for k, v in c["by_check"].items()) or "-"
        row = [c["read"], c["accepted"], c["quarantined"], checks, c["duplicates"], c["contaminated"]]
        table.add_row(name, *(str(v) for v in row))
    return table


def _histogram_rows(store: Any, difficulty_id: str) -> list[dict[str, Any]]:
    """(source, bin, problems, mean posterior) of a difficulty artifact, sources from its problems input."""
    manifest = store.manifest(difficulty_id)
    problems_id = manifest.extra["stage_run"]["inputs"]["problems"][0]
    source_of = dict(zip(*store.read_table(problems_id, columns=["problem_id", "source"]).to_pydict().values()))
    groups: dict[tuple[str, int], list[float]] = {}
    for row in store.read_table(difficulty_id, columns=["problem_id", "bin", "posterior_mean"]).to_pylist():
        groups.setdefault((source_of[row["problem_id"]], row["bin"]), []).append(row["posterior_mean"])
    return [
        {"source": source, "bin": b, "n": len(values), "mean": sum(values) / len(values)}
        for (source, b), values in sorted(groups.items())
    ]


def difficulty_histogram(store: Any, difficulty_id: str) -> Table:
    """Problems per difficulty bin (of the posterior mean pass rate) per source, and each source's mean."""
    rows = _histogram_rows(store, difficulty_id)
    width = max((r["bin"] for r in rows), default=0) + 1
    table = Table("source", *(f"bin {b}" for b in range(width)), "mean pass rate (posterior)")
    for source in sorted({r["source"] for r in rows}):
        mine = {r["bin"]: r for r in rows if r["source"] == source}
        total = sum(r["n"] for r in mine.values())
        mean = sum(r["mean"] * r["n"] for r in mine.values()) / total
        table.add_row(source, *(str(mine[b]["n"]) if b in mine else "0" for b in range(width)), f"{mean:.2f}")
    return table


SUMMED = ("read", "accepted", "quarantined", "duplicates")


def print_data_summary(store: Any, summary: dict[str, Any]) -> None:
    """Per source counts (the invariant holds: read = accepted + quarantined + duplicates), then difficulty."""
    counts = store.manifest(summary["problems_id"]).extra["counts"]
    read, kept, quarantined, duplicates = (sum(c[k] for c in counts.values()) for k in SUMMED)
    out.print(f"\n[bold]data run {summary['run_id']} completed[/bold] in {summary['seconds']:.0f} s")
    out.print(source_table(counts))
    out.print(
        f"rows read {read} = accepted {kept} + quarantined {quarantined} + duplicates {duplicates} (checked per source)"
    )
    if summary.get("difficulty_id"):
        out.print(difficulty_histogram(store, summary["difficulty_id"]))
    root, run = store.root, summary["run_id"]
    sql = f"SELECT source, failed_check, reason FROM quarantine WHERE run_id = '{run}'"
    out.print(f'quarantine: rlvr query "{sql}" --store {root}')
    if kept:
        out.print(f"train on it: rlvr run --data {run} --store {root}")


def difficulty(
    run_id: str = typer.Argument(..., help="the run whose problems to score (a data run or an RL run)"),
    policy: str | None = typer.Option(None, "--policy", help="a checkpoint id (checkpoints or train_steps artifact)"),
    labels: bool = typer.Option(False, "--labels", help="from the problems' difficulty labels (e.g. MATH levels)"),
    store: str | None = typer.Option(None, "--store", help="store root (default $RLVR_STORE or ./rlvr-store)"),
    set_: list[str] = typer.Option([], "--set", help="override a difficulty key, e.g. --set difficulty.k=16"),
) -> None:
    """Re-estimate a run's difficulty with another checkpoint: a new artifact; the old one stays queryable."""
    from rlvr.flows.cli.common import open_existing
    from rlvr.flows.prefect_env import configure_prefect

    found = open_existing(store)
    configure_prefect(found)
    from rlvr.flows.config import config_from_json, data_run_problems, load_config
    from rlvr.flows.data_run import difficulty_run
    from rlvr.storage.leases import owning

    if (policy is None) == (not labels):
        raise UserError("give exactly one of --policy CHECKPOINT_ID or --labels")
    record = found.read_run(run_id)
    if record is None:
        raise UserError(f"unknown run id {run_id!r} in store {found.root}")
    cfg = config_from_json(record["config_json"])
    if set_:
        section = load_config(None, set_).difficulty
        cfg = cfg.model_copy(update={"difficulty": section})
    problems = data_run_problems(found, run_id)
    with owning(found, run_id, purpose="rlvr difficulty"):  # it writes under the run's id: no one else may
        difficulty_id = str(_with_status(lambda: difficulty_run(found.root, cfg, problems, policy)))
    out.print(f"difficulty {difficulty_id} of run {run_id} " + (f"under policy {policy}" if policy else "from labels"))
    out.print(difficulty_histogram(found, difficulty_id))
    out.print(f"rlvr query \"SELECT policy_id, bin, count(*) FROM difficulty WHERE run_id = '{run_id}' GROUP BY ALL\"")


def export(
    run_id: str = typer.Argument(..., help="the run whose synthesized problems to export"),
    format: str = typer.Option(..., "--format", help="verl, trl or jsonl"),
    out_dir: Path = typer.Option(..., "--out", help="folder for the files (one per split)"),
    split: str | None = typer.Option(None, "--split", help="only this split (train, warmup or test)"),
    store: str | None = typer.Option(None, "--store", help="store root (default $RLVR_STORE or ./rlvr-store)"),
) -> None:
    """Write a run's problems for another trainer: verl's Parquet layout, a TRL dataset, or plain JSONL."""
    from rlvr.data.export import export_problems
    from rlvr.flows.cli.common import open_existing
    from rlvr.flows.config import data_run_problems

    found = open_existing(store)
    problems = found.read_table(data_run_problems(found, run_id))
    for path in export_problems(problems, format, out_dir, split):
        out.print(f"wrote {path}")
