"""`rlvr report RUN_ID [RUN_ID ...]`: one self-contained HTML page about a run, or about runs compared.

Every number on the page comes from SQL over the store's views, on one DuckDB connection; the figures
are drawn by `rlvr.flows.report_plots`. The page has no scripts and no external references, so it opens
anywhere, offline, and can be mailed or archived as one file.
"""

from __future__ import annotations

import html
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb

from rlvr.errors import UserError
from rlvr.flows.report_plots import (
    RUN_COLORS,
    Figure,
    RunData,
    all_figures,
    environment_of,
    is_number,
    run_colors,
)
from rlvr.flows.runs import existing_run, final_checkpoint, format_age, last_by_phase
from rlvr.storage.lineage import ancestors
from rlvr.storage.run_records import run_status
from rlvr.storage.store import Store
from rlvr.storage.views import connect

MAX_RUNS = len(RUN_COLORS)
# The views and catalog tables the report reads: given to `connect`, which then makes only these (on S3 a view costs
# a read of its parts).
VIEWS = (
    "allocations",
    "artifacts",
    "checkpoints",
    "curriculum_state",
    "difficulty",
    "evals",
    "problems",
    "rewards",
    "train_steps",
)
EPISODE_VIEWS = ("turns",)  # read only when a run has an environment (one-turn runs' turns say nothing new)


@dataclass(frozen=True)
class Lineage:
    """Where a run's results came from: its artifacts, the final checkpoint's ancestry, sources, verifiers."""

    kinds: list[dict[str, Any]]  # kind, artifacts, rows, bytes
    checkpoint: dict[str, Any] | None  # artifact_id, step
    ancestors: list[dict[str, Any]]  # kind, artifacts: everything the final checkpoint came from
    sources: list[dict[str, Any]]  # source, generator, generator_version, seed, problems
    verifiers: list[dict[str, Any]]  # verifier, verifier_version, labels, cached


@dataclass(frozen=True)
class RunPage:
    data: RunData
    record: dict[str, Any]
    lineage: Lineage


def write_report(store: Store, run_ids: Sequence[str], out: Path | None = None) -> str:
    """Write the report of `run_ids` (one run, or several on the same plots); return where it went.

    The default place is `<store>/reports/<RUN_ID>.html`, or `report-A-vs-B.html` for a comparison.
    """
    pages = load_runs(store, run_ids)
    page = render_page(store.root, pages, all_figures([p.data for p in pages]))
    if out is not None:
        if out.parent != Path() and not out.parent.is_dir():
            raise UserError(f"folder {str(out.parent)!r} of --out does not exist; create it or choose another path")
        out.write_text(page, encoding="utf-8")
        return str(out)
    path = store.path("reports", default_name(run_ids))
    store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    store.fs.pipe_file(path, page.encode("utf-8"))
    return path if store.is_local else store.fs.unstrip_protocol(path)


def default_name(run_ids: Sequence[str]) -> str:
    return f"{run_ids[0]}.html" if len(run_ids) == 1 else "report-" + "-vs-".join(run_ids) + ".html"


def load_runs(store: Store, run_ids: Sequence[str]) -> list[RunPage]:
    """Every run's data, read over one snapshot of the store; unknown or repeated ids are one-line errors."""
    if not run_ids:
        raise UserError("name at least one run: rlvr report RUN_ID [RUN_ID ...]")
    if len(set(run_ids)) != len(run_ids):
        raise UserError(f"a run is named twice in {' '.join(run_ids)}; name each run once")
    if len(run_ids) > MAX_RUNS:
        raise UserError(f"{len(run_ids)} runs named; one report compares at most {MAX_RUNS}")
    records = {run_id: existing_run(store, run_id) for run_id in run_ids}
    configs = [json.loads(record.get("config_json") or "{}") for record in records.values()]
    views = VIEWS + EPISODE_VIEWS if any(environment_of(config) for config in configs) else VIEWS
    con = connect(store, "; ".join(f"SELECT * FROM {view}" for view in views))
    try:
        return [load_run(store, con, run_id, records[run_id]) for run_id in run_ids]
    finally:
        con.close()


def _rows(con: duckdb.DuckDBPyConnection, sql: str, *params: Any) -> list[dict[str, Any]]:
    result = con.execute(sql, list(params))
    columns = [d[0] for d in result.description or []]
    return [dict(zip(columns, row)) for row in result.fetchall()]


def load_run(store: Store, con: duckdb.DuckDBPyConnection, run_id: str, record: dict[str, Any]) -> RunPage:
    """One run's figures' data and lineage summary, each a query over the views filtered by run id."""
    config = json.loads(record.get("config_json") or "{}")
    difficulty: dict[str, list[float]] = {}
    difficulty_rows = _rows(con, "SELECT policy_id, k, pass_rate FROM difficulty WHERE run_id = ?", run_id)
    for row in difficulty_rows:
        if row["pass_rate"] is None:  # no verdict on any of its samples (all failed), or difficulty from labels
            continue
        difficulty.setdefault(row["policy_id"] or "unknown policy", []).append(row["pass_rate"])
    data = RunData(
        run_id=run_id,
        kind=record.get("kind", "rl"),
        status=run_status(record),
        config=config,
        steps=_rows(
            con,
            "SELECT step, mean_reward, effective_ratio, rollouts, mismatch_mean, mismatch_max, corrected_share "
            "FROM train_steps WHERE run_id = ? ORDER BY step",
            run_id,
        ),
        evals=_rows(
            con,
            "SELECT step, phase, split, accuracy FROM evals WHERE run_id = ? ORDER BY step",
            run_id,
        ),
        curriculum=_rows(
            con,
            "SELECT step, arm, probability, q_after FROM curriculum_state WHERE run_id = ? ORDER BY step, arm",
            run_id,
        ),
        budgets=[
            r["n_rollouts"]
            for r in _rows(con, "SELECT n_rollouts FROM allocations WHERE run_id = ? ORDER BY step, slot", run_id)
        ],
        difficulty=difficulty,
        difficulty_k=max((r["k"] for r in difficulty_rows), default=None),
        statuses=_rows(
            con,
            "SELECT coalesce(p.domain, w.verifier) AS domain, w.status, count(*) AS n FROM rewards w "
            "LEFT JOIN (SELECT DISTINCT problem_id, domain FROM problems) p USING (problem_id) "
            "WHERE w.run_id = ? GROUP BY ALL ORDER BY ALL",
            run_id,
        ),
    )
    if data.environment is not None:
        data = with_episodes(con, data)
    if config.get("reward", {}).get("judge"):  # only such runs' rewards have the judge's columns
        data = replace(data, judge=judge_steps(con, run_id))
    return RunPage(data, record, load_lineage(store, con, run_id, config.get("data")))


def judge_steps(con: duckdb.DuckDBPyConnection, run_id: str) -> list[dict[str, Any]]:
    """Per step, the judge's verdicts, how many failed, and the mean seconds of its calls (cache misses)."""
    return _rows(
        con,
        "SELECT step, count(*) AS verdicts, count(*) FILTER (status = 'error') AS failed, "
        "avg(latency_s) FILTER (NOT cache_hit) AS seconds FROM rewards WHERE run_id = ? AND verifier = 'judge' "
        "GROUP BY step ORDER BY step",
        run_id,
    )


def with_episodes(con: duckdb.DuckDBPyConnection, data: RunData) -> RunData:
    """The run's data with, per step, from the turns table: trajectories and their assistant turns, stop reasons
    (on each trajectory's last turn) and tool calls (one entry of `tool_statuses` per call) with how many were ok."""
    run_id = data.run_id
    return replace(
        data,
        episodes=_rows(
            con,
            "SELECT step, count(DISTINCT rollout_id) AS trajectories, "
            "count(*) FILTER (role = 'assistant') AS assistant_turns FROM turns WHERE run_id = ? "
            "GROUP BY step ORDER BY step",
            run_id,
        ),
        stop_reasons=_rows(
            con,
            "SELECT step, stop_reason, count(*) AS n FROM turns WHERE run_id = ? AND stop_reason IS NOT NULL "
            "GROUP BY ALL ORDER BY ALL",
            run_id,
        ),
        tool_calls=_rows(
            con,
            "SELECT step, count(*) AS calls, count(*) FILTER (status = 'ok') AS ok "
            "FROM (SELECT step, unnest(tool_statuses) AS status FROM turns WHERE run_id = ?) "
            "GROUP BY step ORDER BY step",
            run_id,
        ),
    )


def load_lineage(store: Store, con: duckdb.DuckDBPyConnection, run_id: str, data_run: str | None) -> Lineage:
    """The run's artifacts by kind and, walking the lineage up from the final checkpoint, its ancestry."""
    checkpoint_id = final_checkpoint(store, run_id)
    checkpoint, came_from = None, []
    if checkpoint_id is not None:
        checkpoint = {"artifact_id": checkpoint_id, "step": store.manifest(checkpoint_id).step}
        kinds = Counter(m.kind for m in ancestors(store, checkpoint_id))
        came_from = [{"kind": kind, "artifacts": n} for kind, n in sorted(kinds.items())]
    return Lineage(
        kinds=_rows(
            con,
            "SELECT kind, count(*) AS artifacts, sum(rows) AS rows, sum(bytes) AS bytes FROM artifacts "
            "WHERE run_id = ? GROUP BY kind ORDER BY kind",
            run_id,
        ),
        checkpoint=checkpoint,
        ancestors=came_from,
        sources=_rows(
            con,
            "SELECT source, generator, generator_version, seed, count(*) AS problems FROM problems "
            "WHERE run_id IN (?, ?) GROUP BY ALL ORDER BY ALL",
            run_id,
            data_run or run_id,
        ),
        verifiers=_rows(
            con,
            "SELECT verifier, verifier_version, count(*) AS labels, sum(cache_hit::INT) AS cached FROM rewards "
            "WHERE run_id = ? GROUP BY ALL ORDER BY ALL",
            run_id,
        ),
    )


# ----- the page ---------------------------------------------------------------------------------------

STYLE = """
body { font-family: "DejaVu Sans", "Liberation Sans", Arial, sans-serif; color: #222; background: #fff;
       margin: 20px 28px; max-width: 1360px; }
h1 { font-size: 21px; margin: 0 0 10px; }
h2 { font-size: 15px; margin: 0 0 6px; }
h3 { font-size: 13px; margin: 10px 0 4px; }
table { border-collapse: collapse; font-size: 12.5px; }
th, td { padding: 3px 10px; border-bottom: 1px solid #e4e4e4; text-align: left; vertical-align: top; }
th { color: #555; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code { font-size: 12px; background: #f4f4f4; padding: 0 3px; border-radius: 3px; }
td.run { white-space: nowrap; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 6px; }
.meta { color: #666; font-size: 12px; margin: 6px 0 0; }
.plots { display: grid; grid-template-columns: repeat(2, minmax(0, 1fr)); gap: 16px; margin-top: 18px;
         align-items: start; }
figure.plot { margin: 0; border: 1px solid #ddd; border-radius: 6px; padding: 10px 12px; }
figure.wide { grid-column: 1 / -1; }
figure svg { display: block; width: 100%; height: auto; }
figcaption { font-size: 12px; color: #555; margin-top: 4px; }
p.no-data { border: 1px dashed #c9a227; background: #fffbea; color: #6b5300; padding: 18px; font-size: 13px;
            margin: 4px 0; }
ul.notes { font-size: 12px; color: #6b5300; margin: 4px 0 0; padding-left: 18px; }
section { margin-top: 22px; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(420px, 1fr)); gap: 16px; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 10px 12px; font-size: 12.5px; }
.config { columns: 3 340px; font-family: "DejaVu Sans Mono", monospace; font-size: 11.5px; }
.config div { break-inside: avoid; padding: 1px 0; }
.config .key { color: #555; }
tr.differs td { background: #fff6d6; }
details { margin-top: 8px; font-size: 12.5px; }
"""


def render_page(store_root: str, pages: Sequence[RunPage], figures: Sequence[Figure]) -> str:
    """The whole HTML document: header, one <figure> per plot, lineage, config."""
    runs = [p.data.run_id for p in pages]
    title = "rlvr report: " + " vs ".join(runs)
    body = [
        "<header>",
        f"<h1>{_e(title)}</h1>",
        _header_table(pages),
        f'<p class="meta">store <code>{_e(store_root)}</code> · '
        f"made by <code>rlvr report {_e(' '.join(runs))}</code> from the store's DuckDB views</p>",
        "</header>",
        '<main class="plots">',
        *(figure_html(f) for f in figures),
        "</main>",
        _lineage_html(store_root, pages),
        _config_html(pages),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{_e(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if is_number(value) else "n/a"


def run_summary(page: RunPage) -> dict[str, str]:
    """The header's row for one run: what it is and how it ended."""
    data = page.data
    by_phase = last_by_phase(data.evals)
    accuracy = " → ".join(_num(by_phase.get(phase)) for phase in ("init", "warmstart", "rl")) if by_phase else "n/a"
    rewards = [s["mean_reward"] for s in data.steps if is_number(s["mean_reward"])]
    tail = rewards[-max(1, len(rewards) // 10) :]
    ratios = [s["effective_ratio"] for s in data.steps if is_number(s["effective_ratio"])]
    last = max((s["step"] for s in data.steps), default=0)
    planned = data.setting("train.steps")
    rl = data.kind == "rl"
    steps = f"{last} / {planned}" if planned is not None else str(last)
    return {
        "status": data.status if rl else f"{data.status} (data run)",
        "steps": steps if rl else "-",
        "curriculum": f"{data.setting('select.type')} / {data.setting('allocate.type')}" if rl else "-",
        "accuracy": accuracy,
        "reward": _num(sum(tail) / len(tail)) if tail else "n/a",
        "ratio": _num(sum(ratios) / len(ratios)) if ratios else "n/a",
        "rollouts": f"{sum(s['rollouts'] or 0 for s in data.steps):,}",
        "wall": _wall_time(page.record),
    }


def _wall_time(record: dict[str, Any]) -> str:
    try:
        seconds = (
            datetime.fromisoformat(record["updated_at"]) - datetime.fromisoformat(record["created_at"])
        ).total_seconds()
    except (KeyError, TypeError, ValueError):
        return "n/a"
    return format_age(seconds)


HEADER_COLUMNS = (
    ("status", "status"),
    ("steps", "RL steps"),
    ("curriculum", "select / allocate"),
    ("accuracy", "held-out accuracy (start → warm start → final)"),
    ("reward", "reward (last 10% of steps)"),
    ("ratio", "effective-gradient ratio (mean)"),
    ("rollouts", "rollouts"),
    ("wall", "wall time"),
)


def _header_table(pages: Sequence[RunPage]) -> str:
    colors = run_colors([p.data for p in pages])
    head = "<tr><th>run</th>" + "".join(f"<th>{_e(label)}</th>" for _, label in HEADER_COLUMNS) + "</tr>"
    rows = []
    for page in pages:
        summary = run_summary(page)
        swatch = f'<span class="swatch" style="background:{colors[page.data.run_id]}"></span>'
        cells = "".join(f"<td>{_e(summary[key])}</td>" for key, _ in HEADER_COLUMNS)
        rows.append(f'<tr><td class="run">{swatch}<b>{_e(page.data.run_id)}</b></td>{cells}</tr>')
    return f'<table class="runs">{head}{"".join(rows)}</table>'


def figure_html(figure: Figure) -> str:
    classes = "plot wide" if figure.wide else "plot"
    if figure.svg is None:
        body = f'<p class="no-data">{"<br>".join(_e(n) for n in figure.notes)}</p>'
        notes = ""
    else:
        body = figure.svg
        notes = "".join(f"<li>{_e(n)}</li>" for n in figure.notes)
        notes = f'<ul class="notes">{notes}</ul>' if notes else ""
    return (
        f'<figure id="fig-{figure.id}" class="{classes}">\n<h2>{_e(figure.title)}</h2>\n{body}\n'
        f"<figcaption>{_e(figure.caption)}</figcaption>{notes}\n</figure>"
    )


def _size(n_bytes: Any) -> str:
    n = float(n_bytes or 0)
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _lineage_card(store_root: str, page: RunPage) -> str:
    lineage, run_id = page.lineage, page.data.run_id
    parts = [f"<h3>{_e(run_id)}</h3>"]
    if lineage.checkpoint:
        cid = lineage.checkpoint["artifact_id"]
        total = sum(a["artifacts"] for a in lineage.ancestors)
        kinds = ", ".join(f"{a['artifacts']} {a['kind']}" for a in lineage.ancestors)
        parts.append(
            f"<p>Final checkpoint <code>{_e(cid)}</code> (step {_e(lineage.checkpoint['step'])}) comes from "
            f"{total} artifacts: {_e(kinds)}.<br>Walk them: "
            f"<code>rlvr lineage {_e(cid)} --up --store {_e(store_root)}</code></p>"
        )
    else:
        parts.append("<p>No checkpoint committed.</p>")
    sources = "; ".join(
        f"{s['source']} ({s['generator'] or 'no generator'} v{s['generator_version'] or '-'}, seed {s['seed']}): "
        f"{s['problems']}"
        for s in lineage.sources
    )
    verifiers = "; ".join(
        f"{v['verifier']} v{v['verifier_version']}: {v['labels']:,} labels ({v['cached'] or 0:,} from the cache)"
        for v in lineage.verifiers
    )
    parts.append(f"<p>Problems by source: {_e(sources or 'none')}<br>Verifiers: {_e(verifiers or 'none')}</p>")
    rows = "".join(
        f'<tr><td>{_e(k["kind"])}</td><td class="num">{k["artifacts"]:,}</td><td class="num">{k["rows"] or 0:,}</td>'
        f'<td class="num">{_size(k["bytes"])}</td></tr>'
        for k in lineage.kinds
    )
    parts.append(f"<table><tr><th>kind</th><th>artifacts</th><th>rows</th><th>size</th></tr>{rows}</table>")
    return f'<div class="card">{"".join(parts)}</div>'


def _lineage_html(store_root: str, pages: Sequence[RunPage]) -> str:
    cards = "".join(_lineage_card(store_root, page) for page in pages)
    return f'<section id="lineage">\n<h2>Lineage</h2>\n<div class="cards">{cards}</div>\n</section>'


def flatten(config: Any, prefix: str = "") -> dict[str, str]:
    """A config as `--set` keys (`train.grpo.lr`) and JSON values; list items are indexed (`sources[0].type`)."""
    if isinstance(config, dict):
        flat: dict[str, str] = {}
        for key, value in config.items():
            flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    if isinstance(config, list) and any(isinstance(item, dict) for item in config):
        flat = {}
        for index, item in enumerate(config):
            flat.update(flatten(item, f"{prefix}[{index}]"))
        return flat
    return {prefix: json.dumps(config)}


def _config_list(config: dict[str, Any]) -> str:
    lines = "".join(
        f'<div><span class="key">{_e(k)}</span> = {_e(v)}</div>' for k, v in sorted(flatten(config).items())
    )
    return f'<div class="config">{lines}</div>'


def _config_html(pages: Sequence[RunPage]) -> str:
    parts = ['<section id="config">', "<h2>Config</h2>"]
    if len(pages) == 1:
        parts.append(_config_list(pages[0].data.config))
    else:
        flats = [flatten(p.data.config) for p in pages]
        keys = sorted(set().union(*flats) - {"run_id"})
        differing = [k for k in keys if len({f.get(k) for f in flats}) > 1]
        head = "<tr><th>key</th>" + "".join(f"<th>{_e(p.data.run_id)}</th>" for p in pages) + "</tr>"
        rows = "".join(
            f'<tr class="differs"><td>{_e(k)}</td>'
            + "".join(f"<td>{_e(f.get(k, '(absent)'))}</td>" for f in flats)
            + "</tr>"
            for k in differing
        )
        summary = f"{len(differing)} of {len(keys)} keys differ" if differing else f"all {len(keys)} keys are equal"
        parts.append(f"<p>{_e(summary)}</p><table>{head}{rows}</table>" if differing else f"<p>{_e(summary)}</p>")
        for page in pages:
            parts.append(
                f"<details><summary>full config of {_e(page.data.run_id)}</summary>"
                f"{_config_list(page.data.config)}</details>"
            )
    parts.append("</section>")
    return "\n".join(parts)
