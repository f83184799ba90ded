"""The `rlvr` command line (usage: README, docs/, `rlvr --help`). Expected failures print one line, exit non-zero."""

from __future__ import annotations

import csv
import itertools
import json
import os
import re
import sys
from collections.abc import Callable, Collection, Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from rlvr.errors import RunTakenOver, Stopped, UserError, environment_failure
from rlvr.flows.cli.common import StoreOption, flow_store, open_existing, store_root, with_progress

if TYPE_CHECKING:
    from rlvr.storage.store import Store
    from rlvr.verifiers.model_rewards import RewardConfig

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="rlvr: RL with verifiable rewards, every artifact Parquet, every question a DuckDB query.",
)
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

QUERY_CHUNK_ROWS = 10_000  # `rlvr query` holds one chunk of its result at a time
DEFAULT_UI_PORT = 4200  # Prefect's own default; here, not in flows/ui.py, which imports too much for every command


def warn_unreadable(found: Any) -> None:
    """One warning line per damaged manifest or run record that a listing of the store skipped."""
    for reason in found.unreadable.values():
        err.print(f"warning: skipped: {reason}", markup=False, highlight=False)


@app.command()
def run(
    config: Path | None = typer.Option(None, "--config", help="YAML file with config sections"),
    store: str | None = StoreOption,
    run_id: str | None = typer.Option(None, "--run-id", help="name the run (default: a new timestamped id)"),
    data: str | None = typer.Option(None, "--data", help="train on the problems of this data run (`rlvr data`)"),
    set_: list[str] = typer.Option([], "--set", help="override a config key, e.g. --set train.steps=200"),
) -> None:
    """Run the RL pipeline end to end: synthesize, warm start, difficulty, RL steps, evaluate, checkpoint."""
    root = flow_store(store)
    from rlvr.flows.config import data_run_problems, load_config

    if data:  # an unknown or empty data run is one line at once, not after the config's imports (torch: ~7 CPU-s)
        data_run_problems(open_existing(root), data)
    from rlvr.flows.runs import execute, new_run_id
    from rlvr.trainer.devices import resolve_device
    from rlvr.trainer.policy import check_policy_source

    extra = [*([f"run_id={run_id}"] if run_id else []), *([f"data={data}"] if data else [])]
    cfg = load_config(config, [*set_, *extra])
    if _serves_rank_zero(cfg):
        return
    if cfg.data is not None and not data:  # a data run the config names fails here, as one line
        data_run_problems(open_existing(root), cfg.data)
    if cfg.run_id is None:
        cfg = cfg.model_copy(update={"run_id": new_run_id()})
    check_policy_source(cfg.policy)  # a missing model is one line now, not a traceback after synthesis
    resolve_device(cfg.policy.device)  # so is a GPU this machine does not have
    _run_with_progress(lambda: execute(root, cfg, new=True), cfg)


@app.command()
def resume(
    run_id: str = typer.Argument(..., help="the run to finish"),
    store: str | None = StoreOption,
    set_: list[str] = typer.Option(
        [], "--set", help="change where it works, e.g. --set train.data_parallel=4 (placement keys only)"
    ),
) -> None:
    """Finish a failed or killed run from its last committed work (same results as an uninterrupted run)."""
    from rlvr.flows.prefect_env import configure_prefect

    found = open_existing(store)
    configure_prefect(found)
    from rlvr.flows.config import config_from_json, with_placement
    from rlvr.flows.runs import resumable_run
    from rlvr.flows.runs import resume as resume_run

    cfg = with_placement(config_from_json(resumable_run(found, run_id)["config_json"]), set_)
    if _serves_rank_zero(cfg):
        return
    _run_with_progress(lambda: resume_run(store_root(store), run_id, set_), cfg)


def _serves_rank_zero(cfg: Any) -> bool:
    """Under torchrun, every rank but 0 serves rank 0's operations (trainer/ranks/serve.py) instead of running the
    flow, then returns True; rank 0, and a run without torchrun, return False."""
    from rlvr.trainer.ranks.launch import serve_torchrun, torchrun_rank

    if (torchrun_rank() or 0) == 0:
        return False
    serve_torchrun(cfg.policy.device, cfg.policy.threads)
    return True


def _run_with_progress(start: Callable[[], dict[str, Any]], cfg: Any) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    steps = cfg.train.steps if cfg is not None else 0
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]:.2f}  held-out acc {task.fields[accuracy]:.2f}"),
        TimeElapsedColumn(),
        console=err,
        transient=False,
    )
    task_id = bar.add_task("starting", total=steps, reward=float("nan"), accuracy=float("nan"))

    def update(event: str, fields: dict[str, Any]) -> None:
        if event == "stage":
            bar.update(task_id, description=fields["name"])
        elif event == "step":
            bar.update(task_id, completed=fields["step"], reward=fields["reward"], description="rl step")
        elif event == "eval":
            bar.update(task_id, accuracy=fields["accuracy"])

    _freeze_the_runs_imports()
    summary = with_progress(start, bar, update, steps=steps)
    _print_summary(summary)


def _freeze_the_runs_imports() -> None:
    """In a process started as `rlvr` for a run: import what a run imports as it starts, then freeze it all."""
    if _started_as_rlvr:
        from rlvr.startup_objects import freeze_after_run_imports

        freeze_after_run_imports()


def _freeze_this_process() -> None:
    """Keep what the imports made out of every later garbage collection, those at exit included
    (rlvr/startup_objects.py), when this process was started as `rlvr` for one job (a run, a schedule's serving):
    a command invoked in a program's own process (typer's CliRunner, a test) leaves it as it is."""
    if _started_as_rlvr:
        from rlvr.startup_objects import freeze_startup_objects

        freeze_startup_objects()


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _print_summary(s: dict[str, Any]) -> None:
    run_id, root = s["run_id"], s["store"]
    out.print(f"\n[bold]run {run_id} completed[/bold] in {s['seconds']:.0f} s")
    out.print(
        f"held-out greedy accuracy (test split): before {_fmt(s['accuracy_init'])}"
        f" -> after warm start {_fmt(s['accuracy_warmstart'])} -> after RL {_fmt(s['accuracy_final'])}"
    )
    if (sampled := s.get("sampled_final")) is not None:
        out.print(
            f"held-out mean@{sampled['samples']} (sampled answers, last evaluation): {sampled['mean_at_k']:.3f}"
            f" (95% interval {sampled['mean_at_k_low']:.3f}-{sampled['mean_at_k_high']:.3f})"
        )
    out.print(f"run id: {run_id}\nstore:  {root}")
    out.print("query it, e.g.:")
    out.print(
        f"  rlvr query \"SELECT step, phase, accuracy FROM evals WHERE run_id = '{run_id}' ORDER BY step\""
        f" --store {root}"
    )
    out.print(f"  rlvr lineage {s['final_checkpoint']} --up --store {root}")


@app.command()
def runs(
    store: str | None = StoreOption,
    format: str = typer.Option("table", "--format", help="table or json (one object per run, every field)"),
) -> None:
    """List the runs: status, progress, last held-out accuracy, heartbeat; why and where failed runs failed,
    and the command that resumes them. A run whose process died shows as failed."""
    from rlvr.flows.runs import describe_run

    if format not in ("table", "json"):
        raise UserError(f"unknown format {format!r}; use table or json")
    found = open_existing(store)
    root = store_root(store)
    records = sorted(found.list_runs(), key=lambda r: r.get("created_at", ""))
    rows = [describe_run(r, root, found) for r in records]
    warn_unreadable(found)
    if format == "json":
        _print_rows(rows, [], "json")
        return
    shown = [
        {
            "run_id": r["run_id"],
            "status": r["status"],
            "progress": r["progress"],
            "accuracy": None if r["accuracy"] is None else f"{r['accuracy']:.2f}",
            "heartbeat": r["heartbeat"],
            "started": str(r["created_at"] or "")[5:16].replace("T", " "),  # month-day hour:minute, UTC
        }
        for r in rows
    ]
    columns = ["run_id", "status", "progress", "accuracy", "heartbeat", "started"]
    _print_rows(shown, columns, "table", whole=["run_id"])  # an id is copied from here: never cut
    for r in rows:
        if r["status"] == "failed":
            out.print(f"{r['run_id']} failed in {r['failed_stage']}: {r['reason']}", markup=False, highlight=False)
            out.print(f"  resume: {r['resume']}", markup=False, highlight=False)


@app.command()
def query(
    sql: str = typer.Argument(..., help="SQL over the views: artifacts, lineage, runs, problems, rollouts, ..."),
    store: str | None = StoreOption,
    format: str = typer.Option("table", "--format", help="table, csv or json"),
) -> None:
    """Run one read-only DuckDB query (a SELECT) over the store's committed artifacts."""
    import duckdb

    from rlvr.storage.views import check_read_only, connect, refusal

    if format not in ("table", "csv", "json"):
        raise UserError(f"unknown format {format!r}; use table, csv or json")
    found = open_existing(store)
    con = None
    try:
        check_read_only(sql)  # before the views are made: a refused statement reads no manifest
        for attempt in (1, 2):  # over a live run a replaced transient artifact's file can go: ask once more
            con = connect(found, sql)
            try:
                result = con.execute(sql)
                first = result.fetchmany(QUERY_CHUNK_ROWS)
                break
            except duckdb.IOException:
                con.close()
                if attempt == 2:
                    raise
        columns = [d[0] for d in result.description] if result.description else []
        warn_unreadable(found)
        more = iter(lambda: result.fetchmany(QUERY_CHUNK_ROWS), [])
        _print_chunks(itertools.chain([first], more), columns, format)
    except duckdb.PermissionException as exc:
        raise refusal(exc) from None
    except duckdb.Error as exc:
        raise UserError(f"query failed: {str(exc).splitlines()[0]}") from None
    finally:
        if con is not None:
            con.close()


@app.command()
def lineage(
    artifact_or_row_id: str = typer.Argument(..., help="an artifact id, or a problem/rollout id"),
    store: str | None = StoreOption,
    up: bool = typer.Option(False, "--up", help="everything it came from (default)"),
    down: bool = typer.Option(False, "--down", help="everything made from it"),
    format: str = typer.Option("table", "--format", help="table, csv or json"),
) -> None:
    """Walk the lineage of an artifact (or of the artifact holding a row id)."""
    from rlvr.storage.lineage import ancestors, descendants, resolve_id

    if up and down:
        raise UserError("choose one of --up or --down")
    found = open_existing(store)
    aid = resolve_id(found, artifact_or_row_id)
    manifests = descendants(found, aid) if down else ancestors(found, aid)
    warn_unreadable(found)
    rows = [
        {
            "artifact_id": m.artifact_id,
            "kind": m.kind,
            "stage": m.stage,
            "step": m.step,
            "rows": m.rows,
            "run_id": m.run_id,
        }
        for m in manifests
    ]
    if format == "table":
        out.print(f"{'descendants' if down else 'ancestors'} of {aid}: {len(rows)} artifacts")
    _print_rows(rows, ["artifact_id", "kind", "stage", "step", "rows", "run_id"], format)


@app.command()
def relabel(
    target: str = typer.Argument(..., help="a rewards artifact id, or a run id (all its rewards)"),
    store: str | None = StoreOption,
    verifier: str | None = typer.Option(
        None, "--verifier", help="score every problem with this verifier (default: each problem's own)"
    ),
    workers: int = typer.Option(2, "--workers", min=0, help="verifier worker processes"),
    timeout: float = typer.Option(5.0, "--timeout", help="hard wall-clock limit per answer, seconds"),
) -> None:
    """Re-score rewards with the current verifier versions; write new artifacts and a flip report."""
    from rlvr.flows.prefect_env import configure_prefect, quiet_run_failure_logs
    from rlvr.storage.leases import owning
    from rlvr.verifiers.registry import verifier_class

    found = open_existing(store)
    configure_prefect(found)
    from rlvr.flows.relabel import relabel_rewards
    from rlvr.verifiers.cache import VerifierConfig

    quiet_run_failure_logs()  # after Prefect's import: a failure is said once, below, as a run says it

    if found.exists(target):
        targets = [found.manifest(target)]
    else:
        targets = found.manifests(kind="rewards", run_id=target)
        if not targets:
            raise UserError(f"{target!r} is neither a rewards artifact nor a run with rewards in {found.root}")
    if verifier:
        verifier_class(verifier)  # an unknown name fails here, as one line
    reward = run_reward_section(found, targets[0].run_id)  # a run id, or one artifact: one run's rewards
    cfg = VerifierConfig(
        verifier=verifier, workers=workers, timeout_s=timeout, judge=reward.judge, reward_model=reward.model
    )
    with ExitStack() as owned:  # it writes under each rewards' run id: no one else may meanwhile
        for owner in sorted({m.run_id for m in targets}):
            owned.enter_context(owning(found, owner, purpose="rlvr relabel"))
        results = relabel_rewards(found.root, [m.artifact_id for m in targets], cfg)
    flips = [r for _, flips_id in results for r in found.read_table(flips_id).to_pylist()]
    up = sum(r["new_score"] > r["old_score"] for r in flips)
    down = sum(r["new_score"] < r["old_score"] for r in flips)
    using = f"{verifier} v{verifier_class(verifier).version}" if verifier else "each problem's verifier"
    out.print(
        f"relabelled {len(results)} rewards artifacts with {using} (current versions): "
        f"{len(flips)} verdicts flipped ({up} up, {down} down)"
    )
    _print_rows(flips[:20], ["rollout_id", "step", "old_score", "new_score", "old_status", "new_status"], "table")
    out.print(f'flip report: rlvr query "SELECT * FROM relabel_flips ORDER BY step" --store {found.root}')


def run_reward_section(store: Store, run_id: str | None) -> RewardConfig:
    """The `reward` section a run was started with (its judge's and reward model's endpoints): relabelling asks
    them again, as the run's label stage did. Only that section of the stored config is validated: the whole
    config's type is assembled from every stage module, which imports torch (7 CPU-seconds a relabel)."""
    from rlvr.flows.runs import recovered_record
    from rlvr.verifiers.model_rewards import RewardConfig

    record = (store.read_run(run_id) or recovered_record(store, run_id)) if run_id is not None else None
    if record is None:
        return RewardConfig()
    return RewardConfig.model_validate(json.loads(record["config_json"]).get("reward", {}))


@app.command()
def verifiers() -> None:
    """List the registered verifiers (built-in and `rlvr.verifiers` plugins) with their versions."""
    from rlvr.verifiers.registry import plugin_errors, registered

    rows = [
        {"name": name, "domain": cls.domain, "version": cls.version, "class": f"{cls.__module__}.{cls.__qualname__}"}
        for name, cls in registered().items()
    ]
    _print_rows(rows, ["name", "domain", "version", "class"], "table")
    for problem in plugin_errors():
        err.print(f"warning: {problem}", markup=False)


@app.command()
def verify(
    verifier: str = typer.Option(..., "--verifier", help="a registered verifier name (see `rlvr verifiers`)"),
    input: Path = typer.Option(..., "--input", help='JSONL file, one {"response": ..., "reference": ...} per line'),
    workers: int = typer.Option(2, "--workers", min=1, help="verifier worker processes"),
    timeout: float = typer.Option(5.0, "--timeout", help="hard wall-clock limit per answer, seconds"),
) -> None:
    """Score each input line; print one JSON line per input line, in order (score, status, ...)."""
    from rlvr.verifiers.registry import verifier_class
    from rlvr.verifiers.verify_jsonl import verify_lines

    verifier_class(verifier)  # an unknown name fails here, as one line
    if not input.is_file():
        raise UserError(f"input file {str(input)!r} does not exist")
    with input.open(encoding="utf-8", errors="surrogateescape") as lines:
        for row in verify_lines(verifier, lines, workers=workers, timeout_s=timeout):
            print(json.dumps(row, default=str), flush=True)


@app.command()
def schedule(
    name: str | None = typer.Argument(None, help="the pipeline's name; its runs are NAME-<UTC timestamp>"),
    cron: str | None = typer.Option(None, "--cron", help="fire on this cron expression, in UTC ('0 3 * * *')"),
    interval: float | None = typer.Option(None, "--interval", min=1, help="fire every SECONDS"),
    config: Path | None = typer.Option(None, "--config", help="YAML file with the pipeline's config sections"),
    set_: list[str] = typer.Option([], "--set", help="override a config key, e.g. --set train.steps=200"),
    store: str | None = StoreOption,
    list_: bool = typer.Option(False, "--list", help="list the store's schedules"),
    pause: bool = typer.Option(False, "--pause", help="pause schedule NAME"),
    resume_: bool = typer.Option(False, "--resume", help="resume schedule NAME"),
    delete: bool = typer.Option(False, "--delete", help="delete schedule NAME (its runs stay in the store)"),
) -> None:
    """Run a pipeline on a schedule through Prefect: each firing continues from the newest checkpoint.

    Serving runs until Ctrl-C. Without PREFECT_API_URL it starts a Prefect server on the store's database.
    """
    modes = _schedule_modes(
        name, cron, interval, config, set_, list_=list_, pause=pause, resume_=resume_, delete=delete
    )
    serving = not modes
    from rlvr.flows.ui import point_prefect_at_store, ui_url_of  # after the arguments' checks: they import a lot
    from rlvr.storage.store import open_store

    root = _absolute_root(store_root(store))
    found = open_store(root, create=serving)
    config_json = _schedule_config(config, set_) if serving else ""
    target = point_prefect_at_store(found, need_server=serving)
    from rlvr.flows import schedule as schedules  # imports Prefect, now pointed at the right server

    if list_:
        rows = schedules.schedule_rows(root)
        if not rows:
            _say(f"no schedules for store {root} on {ui_url_of(target.api_url) if target.api_url else target.origin}")
        columns = ["schedule", "trigger", "state", "served", "completed", "failed", "running", "skipped"]
        _print_rows(rows, [*columns, "last_run", "newest_checkpoint"], "table")
        return
    assert name is not None
    if delete:
        _say(schedules.delete_schedule(root, name))
        return
    if not serving:
        out.print(schedules.set_paused(root, name, paused=pause))
        return
    schedules.schedule_deployment(root, name, config_json, interval=interval, cron=cron)  # a bad cron fails here
    _freeze_this_process()  # serving is this process's one job, as a run is (Ctrl-C: 5-7 s of collections, 1.5 frozen)
    server = target.start(started_by=f"rlvr schedule {name}")
    _say(f"Prefect server: {ui_url_of(target.api_url or '')} ({target.origin})")
    try:
        schedules.serve_schedule(root, name, config_json, interval=interval, cron=cron, say=_say)
    finally:
        if server is not None:
            server.stop()


def _schedule_modes(
    name: str | None,
    cron: str | None,
    interval: float | None,
    config: Path | None,
    set_: list[str],
    *,
    list_: bool,
    pause: bool,
    resume_: bool,
    delete: bool,
) -> list[str]:
    """The one mode flag given (none: serve), after refusing, in one line, arguments that do not go together."""
    flags = (("--list", list_), ("--pause", pause), ("--resume", resume_), ("--delete", delete))
    modes = [flag for flag, on in flags if on]
    if len(modes) > 1:
        raise UserError(f"choose one of {', '.join(modes)}")
    if (interval is None) == (cron is None) and not modes:
        raise UserError(
            "give one of --interval SECONDS or --cron EXPR (or --list, --pause NAME, --resume NAME, --delete NAME)"
        )
    if modes and (interval is not None or cron is not None or config is not None or set_):
        raise UserError(f"{modes[0]} takes no --interval, --cron, --config or --set")
    if name is None and not list_:
        raise UserError(f"name the schedule: rlvr schedule NAME {modes[0] if modes else '--interval SECONDS'} ...")
    if name is not None:
        check_schedule_name(name)
    return modes


SCHEDULE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,47}")  # NAME-YYYYmmdd-HHMMSS must be a run id


def check_schedule_name(name: str) -> str:
    if not SCHEDULE_NAME.fullmatch(name):
        raise UserError(
            f"bad schedule name {name!r}: use up to 48 letters, digits, '_', '.', '-' "
            "(its runs are named NAME-<timestamp>)"
        )
    return name


def _absolute_root(root: str) -> str:
    """A local store as an absolute path: the served flow runs in other processes (and other directories)."""
    return root if "://" in root else os.path.abspath(root)


def _schedule_config(config: Path | None, overrides: list[str]) -> str:
    from rlvr.flows.config import load_config

    cfg = load_config(config, overrides)
    if cfg.run_id is not None:
        raise UserError("a schedule names its runs NAME-<timestamp>; remove run_id from the config")
    return str(cfg.model_dump_json())


@app.command()
def ui(
    store: str | None = StoreOption,
    port: int = typer.Option(DEFAULT_UI_PORT, "--port", help="port of the server (default: Prefect's own)"),
    host: str = typer.Option("127.0.0.1", "--host", help="interface to listen on (0.0.0.0: every interface)"),
) -> None:
    """Open Prefect's UI over the store's run history: a Prefect server on the store's Prefect database."""
    from rlvr.flows.ui import serve_ui

    serve_ui(open_existing(store), host=host, port=port, say=_say)


def _say(text: str) -> None:
    out.print(text, markup=False, highlight=False)


@app.command()
def report(
    run_ids: list[str] = typer.Argument(
        ..., metavar="RUN_ID [RUN_ID ...]", help="a run id, or several to compare on the same plots"
    ),
    out_file: Path | None = typer.Option(
        None, "--out", help="the HTML file to write (default <store>/reports/RUN_ID.html or report-A-vs-B.html)"
    ),
    store: str | None = StoreOption,
) -> None:
    """Write a self-contained HTML report: reward, accuracy, curriculum, budgets, difficulty, lineage, config."""
    from rlvr.flows.report import write_report

    print(write_report(open_existing(store), run_ids, out_file))


def _register_module_commands() -> None:
    """The commands that live in modules of their own."""
    import rlvr.flows.cli.check_command as check_command  # not through the package's face, which imports this
    import rlvr.flows.cli.compare_command as compare_command
    import rlvr.flows.cli.data_commands as data_commands
    import rlvr.flows.cli.plan_command as plan_command
    import rlvr.flows.cli.serve_command as serve_command

    app.command()(data_commands.data)
    app.command()(data_commands.difficulty)
    app.command()(data_commands.export)
    app.command()(check_command.check)
    app.command(name="serve-rm")(serve_command.serve_rm)
    app.command()(plan_command.plan)
    app.command()(compare_command.compare)


_register_module_commands()


def _print_chunks(chunks: Iterable[list[tuple[Any, ...]]], columns: list[str], format: str) -> None:
    """Print a query's result as its chunks come, so memory holds one chunk (`QUERY_CHUNK_ROWS` rows), never
    the whole result: csv and json row by row, a table per chunk (each with its header: a result of one
    chunk prints as one table, as it always did)."""
    printed = False
    writer = csv.writer(sys.stdout)
    for chunk in chunks:
        if not chunk:
            continue
        if format == "json":
            for row in chunk:
                print(json.dumps(dict(zip(columns, row)), default=str))
        elif format == "csv":
            if not printed:
                writer.writerow(columns)
            writer.writerows(chunk)
        else:
            _print_table([["" if value is None else str(value) for value in row] for row in chunk], columns)
        printed = True
        sys.stdout.flush()
    if not printed and format == "csv":
        writer.writerow(columns)
    elif not printed and format == "table":
        _print_table([], columns)


def _print_rows(rows: list[dict[str, Any]], columns: list[str], format: str, whole: Collection[str] = ()) -> None:
    """Rows as json, csv or a table; in a table the `whole` columns (ids to copy) are never cut or wrapped."""
    if format == "json":
        for row in rows:
            print(json.dumps(row, default=str))
        return
    if format == "csv":
        writer = csv.DictWriter(sys.stdout, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
        return
    cells = [["" if row.get(c) is None else str(row.get(c)) for c in columns] for row in rows]
    _print_table(cells, columns, whole=whole)


def _print_table(cells: list[list[str]], columns: list[str], whole: Collection[str] = ()) -> None:
    table = Table(*columns)
    for index, column in enumerate(table.columns):
        texts = [columns[index], *(row[index] for row in cells)]
        if columns[index] in whole:  # fixed: rich shrinks the other columns first, and never this one below its width
            column.width, column.no_wrap = max(cell_len(text) for text in texts), True
        else:  # rich's shrinking ignores the longest word; this keeps it
            column.min_width = max((cell_len(word) for text in texts for word in text.split()), default=1)
    for row in cells:
        table.add_row(*row)
    # Wider than the terminal: long cells wrap at spaces, but never below the longest word of each column, where
    # rich would drop whole columns instead (the table then runs past the terminal's edge); the `whole` columns
    # keep their full width.
    measured = Measurement.get(out, out.options.update_width(100_000), table)
    if measured.maximum > out.width:
        table.width = max(out.width, measured.minimum)
    out.print(table)


_started_as_rlvr = False  # set by main(): the process is the `rlvr` command's own


def main() -> None:
    """Entry point: a UserError becomes one line on stderr and exit status 2; bugs keep their traceback."""
    global _started_as_rlvr
    _started_as_rlvr = True
    try:
        app()
    except UserError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        sys.exit(2)
    except Exception as exc:
        line = environment_failure(exc)
        if line is None:
            raise
        err.print(f"error: {line}: fix that and run the command again", markup=False, highlight=False)
        sys.exit(2)
    except Stopped as exc:  # a run stopped by a signal, which has said how to resume it
        if isinstance(exc, RunTakenOver):  # or by losing its run to another process: that one goes on
            err.print(f"error: {exc}", markup=False, highlight=False)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exc.status)
