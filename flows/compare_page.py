"""The page and the terminal tables of `rlvr compare` (flows/compare.py): its figures (compare_figures.py) as three
plots (the metric against rollouts, the effective-gradient ratio against step, the budget over difficulty) and the
method table, in one self-contained HTML file drawn as `rlvr report` draws (inline SVG, no script)."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence

import matplotlib as mpl
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure as MplFigure
from matplotlib.ticker import MaxNLocator

from rlvr.flows.compare_figures import DIFFICULTY_BINS, Estimate, MethodFigures
from rlvr.flows.report import STYLE, figure_html
from rlvr.flows.report_plots import HALF, RUN_COLORS, Figure, to_svg
from rlvr.flows.report_plots import STYLE as PLOT_STYLE

COLUMNS = (
    "method",
    "seeds",
    "final {metric}",
    "{metric} at uniform's budget",
    "rollouts to target",
    "effective ratio",
    "compute equivalence",
    "late groups all right / all wrong",
)


def table_rows(methods: Sequence[MethodFigures]) -> list[list[str]]:
    """The method table, one row a method, each figure with its bootstrap 95% interval over seeds."""
    return [
        [
            m.method,
            str(len(m.runs)),
            m.final.text(),
            "-" if m.at_uniform_budget is None else m.at_uniform_budget.text(),
            _to_target(m),
            m.effective_ratio.text(),
            "-" if m.compute_equivalence is None else ratio_text(m.compute_equivalence),
            f"{m.late_all_right.mean:.2f} / {m.late_all_wrong.mean:.2f}",
        ]
        for m in methods
    ]


def ratio_text(ratio: Estimate) -> str:
    """A ratio to uniform's as "0.69x [0.42, 0.91]" (n/a when no seed gave one)."""
    if math.isnan(ratio.mean):
        return "n/a"
    interval = "" if math.isnan(ratio.low) else f" [{ratio.low:.2f}, {ratio.high:.2f}]"
    return f"{ratio.mean:.2f}x{interval}"


def _to_target(m: MethodFigures) -> str:
    found = m.rollouts_to_target
    if found is None:
        return "-"
    if found.seeds < len(m.runs):
        return f"reached on {found.seeds}/{len(m.runs)} seeds"
    return found.text(0)


def headers(metric: str) -> list[str]:
    return [column.format(metric=metric) for column in COLUMNS]


def _drawn(fig_id: str, title: str, draw: Callable[[Axes], None]) -> str:
    """A figure of one axis drawn by `draw`, with its legend, as inline SVG in the report's style."""
    with mpl.rc_context(PLOT_STYLE):
        fig = MplFigure(figsize=HALF, layout="constrained")
        ax = fig.add_subplot()
        draw(ax)
        ax.legend(loc="best")
        return to_svg(fig, fig_id, title)


def accuracy_figure(methods: Sequence[MethodFigures], metric: str) -> Figure:
    """Each method's metric against cumulative rollouts: the mean over seeds (evaluation by evaluation) as a line,
    every seed's curve faint behind it."""
    fig_id, title = "compare-accuracy", f"Held-out {metric} against rollouts"

    def draw(ax: Axes) -> None:
        for i, m in enumerate(methods):
            color = RUN_COLORS[i % len(RUN_COLORS)]
            for run in m.runs:
                ax.plot([p[1] for p in run.curve], [p[2] for p in run.curve], color=color, alpha=0.25, lw=0.8)
            length = min(len(run.curve) for run in m.runs)
            xs = np.mean([[p[1] for p in run.curve[:length]] for run in m.runs], axis=0)
            ys = np.mean([[p[2] for p in run.curve[:length]] for run in m.runs], axis=0)
            ax.plot(xs, ys, color=color, lw=1.8, marker="o", markersize=3, label=m.method)
        ax.set_xlabel("rollouts sampled (cumulative)")
        ax.set_ylabel(f"held-out {metric}")

    caption = f"Mean over seeds (thick) and each seed (faint) of the held-out {metric} at every evaluation."
    return Figure(fig_id, title, caption, _drawn(fig_id, title, draw))


def effective_figure(methods: Sequence[MethodFigures]) -> Figure:
    fig_id, title = "compare-effective", "Effective-gradient ratio against step"

    def draw(ax: Axes) -> None:
        for i, m in enumerate(methods):
            steps = sorted({step for run in m.runs for step, _ in run.effective})
            means = [np.mean([r for run in m.runs for s, r in run.effective if s == step]) for step in steps]
            ax.plot(steps, means, color=RUN_COLORS[i % len(RUN_COLORS)], lw=1.5, label=m.method)
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("share of groups with reward variance")
        ax.set_ylim(-0.02, 1.02)

    caption = "Mean over seeds of each step's share of groups whose rewards are not all equal."
    return Figure(fig_id, title, caption, _drawn(fig_id, title, draw))


def budget_figure(methods: Sequence[MethodFigures]) -> Figure:
    fig_id, title = "compare-budget", "Where the rollouts went, by difficulty"
    width = 0.8 / max(len(methods), 1)

    def draw(ax: Axes) -> None:
        for i, m in enumerate(methods):
            totals = np.array([sum(run.budget[b] for run in m.runs) for b in DIFFICULTY_BINS], dtype=float)
            shares = totals / totals.sum() if totals.sum() else totals
            xs = np.arange(len(DIFFICULTY_BINS)) + i * width
            ax.bar(xs, shares, width, color=RUN_COLORS[i % len(RUN_COLORS)], label=m.method)
        ax.set_xticks(np.arange(len(DIFFICULTY_BINS)) + 0.4 - width / 2, DIFFICULTY_BINS, rotation=20, ha="right")
        ax.set_ylabel("share of the method's rollouts")

    caption = "Rollouts allotted by the estimate p̂ the allocator decided on (allocations.p_hat), all seeds together."
    return Figure(fig_id, title, caption, _drawn(fig_id, title, draw))


def render(name: str, command: str, metric: str, methods: Sequence[MethodFigures], notes: Sequence[str]) -> str:
    """The comparison's whole HTML page."""
    figures = [accuracy_figure(methods, metric), effective_figure(methods), budget_figure(methods)]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers(metric))
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in table_rows(methods))
    listed = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    title = f"rlvr compare: {name}"
    parts = [
        f"<header><h1>{html.escape(title)}</h1>",
        f'<p class="meta">made by <code>{html.escape(command)}</code>; means over seeds, bootstrap 95% intervals</p>',
        f'<table class="runs"><tr>{head}</tr>{body}</table>',
        f'<ul class="notes">{listed}</ul>' if listed else "",
        "</header>",
        '<main class="plots">',
        *(figure_html(f) for f in figures),
        "</main>",
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        + "\n".join(parts)
        + "\n</body>\n</html>\n"
    )
