"""A comparison's finished runs as a Parquet file of their own (`rlvr compare --runs-file`): a row a run with every
figure the comparison reads from it (the `comparison_runs` columns, the effective ratio step by step, the run's
config identity and the code it ran on). Runs in the file count as done, so one comparison can be spread over
stores, machines or days that share no store; every run the comparison finishes in its store is added to the file.

A row is taken for a job only when its config identity (flows/config.py, the same that names the run's artifacts)
is the job's: a file made under another config or `--set` is refused in one line, not mixed in.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlvr.errors import UserError
from rlvr.flows.compare_figures import RunFigures

if TYPE_CHECKING:
    from rlvr.storage.store import Store


def identity_of(config: str | None, overrides: list[str]) -> str:
    """The config identity of a run of this config and overrides, as canonical JSON: what the run's config artifact
    is named from."""
    from rlvr.flows.config import load_config

    return _identity_json(load_config(config, overrides))


def identity_in_store(store: Store, run_id: str) -> str:
    """The config identity of a run in the store, from its config artifact."""
    from rlvr.flows.config import config_from_json
    from rlvr.storage.views import query, sql_string

    found = query(store, f"SELECT config_json FROM config WHERE run_id = {sql_string(run_id)}").to_pylist()
    return _identity_json(config_from_json(found[0]["config_json"]))


def _identity_json(cfg: Any) -> str:
    from rlvr.flows.config import CONFIG
    from rlvr.storage.ids import canonical_json

    return canonical_json(CONFIG.identity(cfg, {}))


def made_with() -> str:
    """The commit of the code that read the run (`+changes` when its tree differs), or `unknown` outside git."""
    here = Path(__file__).resolve().parent
    head = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown"
    clean = subprocess.run(["git", "-C", str(here), "diff", "--quiet", "HEAD"], capture_output=True)
    return head.stdout.strip() + ("" if clean.returncode == 0 else "+changes")


def figures_row(run: RunFigures, comparison: str, identity: str) -> dict[str, Any]:
    """A run's row: the `comparison_runs` columns and what `figures_of_row` needs to give the run back whole."""
    return {
        "comparison": comparison,
        "method": run.method,
        "seed": run.seed,
        "run_id": run.run_id,
        "metric": run.metric,
        "rollouts": run.rollouts,
        "final": run.final,
        "effective_ratio": number_or_none(run.effective_ratio),
        "curve_steps": [p[0] for p in run.curve],
        "curve_rollouts": [p[1] for p in run.curve],
        "curve_values": [p[2] for p in run.curve],
        "effective_steps": [p[0] for p in run.effective],
        "effective_values": [p[1] for p in run.effective],
        "budget_bins": list(run.budget),
        "budget_rollouts": list(run.budget.values()),
        **{f"late_{outcome}": number_or_none(share) for outcome, share in run.late.items()},
        "config": identity,
        "origin": run.origin,
    }


def figures_of_row(row: dict[str, Any]) -> RunFigures:
    """The run's figures from its row, as `run_figures` read them from its store."""
    late = {k: math.nan if row[f"late_{k}"] is None else row[f"late_{k}"] for k in ("all_right", "all_wrong", "mixed")}
    return RunFigures(
        row["run_id"],
        row["method"],
        row["seed"],
        row["metric"],
        list(zip(row["curve_steps"], row["curve_rollouts"], row["curve_values"], strict=True)),
        row["rollouts"],
        list(zip(row["effective_steps"], row["effective_values"], strict=True)),
        dict(zip(row["budget_bins"], row["budget_rollouts"], strict=True)),
        late,
        row["origin"],
    )


def number_or_none(value: float) -> float | None:
    """None for nan (Parquet's null)."""
    return None if math.isnan(value) else value


def read_runs_file(path: Path | None) -> dict[str, dict[str, Any]]:
    """The file's rows by run id (none when there is no path or no file yet)."""
    if path is None or not path.exists():
        return {}
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (OSError, pa.ArrowException) as error:
        raise UserError(f"--runs-file {path}: not a comparison's runs file ({type(error).__name__}: {error})") from None
    return {row["run_id"]: row for row in rows}


def add_to_runs_file(path: Path, new: list[dict[str, Any]]) -> None:
    """Add (or replace, by run id) rows in the file, written whole to a temporary file and moved into place, so a
    kill leaves the old file or the new one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = read_runs_file(path)
    rows.update({row["run_id"]: row for row in new})
    ordered = [rows[run_id] for run_id in sorted(rows)]
    part = path.with_name(f".{path.name}.part")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(ordered), part)
    part.replace(path)
