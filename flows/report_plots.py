"""The figures of `rlvr report`: each one a plain function of the runs' data, drawn by matplotlib as inline SVG.

SVG keeps the page self-contained (no JavaScript, no network, text stays selectable text) and the output
byte-for-byte reproducible. A figure never draws an empty axis: a run without data for it is listed with
the reason ("no data: ...") and a figure where no run has data shows only that note. The figures about
episodes (turns, stop reasons, tool calls) are left out of a page on which no run has an environment.
"""

from __future__ import annotations

import io
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import matplotlib as mpl
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure as MplFigure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

RUN_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
STATUS_COLORS = {
    "ok": "#2ca02c",
    "wrong": "#d62728",
    "unparseable": "#ff7f0e",
    "timeout": "#9467bd",
    "error": "#7f7f7f",
}
STOP_COLORS = {
    "done": "#2ca02c",
    "max_turns": "#ff7f0e",
    "token_budget": "#9467bd",
    "tool_timeout": "#d62728",
    "error": "#7f7f7f",
}
LABELLED_POINTS = 12  # steps; a curve of at most this many steps carries each point's value as text
MAX_LABELLED_ARMS = 12  # more arms than this (e.g. category x bin) label only the most probable
SMOOTH_ARMS_AFTER = 50  # steps; longer arm curves are drawn as trailing means
HALF, WIDE = (6.4, 3.4), 12.8
STYLE: dict[RcKeyType, Any] = {
    "svg.fonttype": "none",  # text as <text>: small, selectable, and findable by the tests
    "font.size": 9,
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans"],  # ships with matplotlib, so sizes are measured with the font drawn
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.6,
    "legend.frameon": False,
    "legend.fontsize": 8,
}


@dataclass(frozen=True)
class RunData:
    """What the figures draw of one run, read from the store's views by `rlvr.flows.report`."""

    run_id: str
    kind: str  # "rl" or "data"
    status: str
    config: dict[str, Any]
    # train_steps: step, mean_reward, effective_ratio, rollouts, mismatch_mean, mismatch_max, corrected_share
    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)  # step, phase, split, accuracy
    curriculum: list[dict[str, Any]] = field(default_factory=list)  # step, arm, probability, q_after
    budgets: list[int] = field(default_factory=list)  # rollouts per prompt, every step's allocations
    difficulty: dict[str, list[float]] = field(default_factory=dict)  # pass rates per estimating policy
    difficulty_k: int | None = None
    statuses: list[dict[str, Any]] = field(default_factory=list)  # domain, status, n
    # Episodes of an environment (read only for runs that have one): per step, from the turns table
    episodes: list[dict[str, Any]] = field(default_factory=list)  # step, trajectories, assistant_turns
    # Judge verdicts (rewards.verifier = 'judge'), per step: step, verdicts, failed, seconds (mean of the calls)
    judge: list[dict[str, Any]] = field(default_factory=list)
    stop_reasons: list[dict[str, Any]] = field(default_factory=list)  # step, stop_reason, n
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # step, calls, ok

    @property
    def environment(self) -> str | None:
        return environment_of(self.config)

    def setting(self, dotted: str) -> Any:
        """A config value by its `--set` key (`select.type`), None when the run's config has no such key."""
        value: Any = self.config
        for part in dotted.split("."):
            if not isinstance(value, dict) or part not in value:
                return None
            value = value[part]
        return value


def environment_of(config: dict[str, Any]) -> str | None:
    """A run config's `env.type` when its rollouts are episodes of an environment; None for one-turn runs."""
    env = config.get("env")
    env_type = env.get("type") if isinstance(env, dict) else None
    return None if env_type in (None, "one_turn") else str(env_type)


@dataclass(frozen=True)
class Figure:
    """One figure of the page: an SVG, or (when no run has data for it) none and the notes saying why."""

    id: str
    title: str
    caption: str
    svg: str | None
    notes: list[str] = field(default_factory=list)
    wide: bool = False


def run_colors(runs: Sequence[RunData]) -> dict[str, str]:
    return {run.run_id: RUN_COLORS[i % len(RUN_COLORS)] for i, run in enumerate(runs)}


def to_svg(fig: MplFigure, fig_id: str, title: str) -> str:
    """The figure as an inline <svg> element; the hash salt keeps ids unique between figures of one page."""
    buffer = io.StringIO()
    with mpl.rc_context({"svg.hashsalt": f"rlvr-report-{fig_id}"}):
        fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buffer.getvalue()
    text = text[text.index("<svg") :]
    label = title.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;")
    return text.replace("<svg", f'<svg role="img" aria-label="{label}"', 1)


def _new_figure(size: tuple[float, float]) -> MplFigure:
    return MplFigure(figsize=size, layout="constrained")


def _no_step_reason(run: RunData) -> str:
    if run.kind == "data":
        return "a data run has no RL steps"
    return f"no RL step committed (run status: {run.status})"


def _split(
    runs: Sequence[RunData], has_data: Callable[[RunData], bool], reason: Callable[[RunData], str]
) -> tuple[list[RunData], list[str]]:
    """The runs that have data for a figure, and one "run: no data: why" note for each that has not."""
    present = [run for run in runs if has_data(run)]
    notes = [f"{run.run_id}: no data: {reason(run)}" for run in runs if not has_data(run)]
    return present, notes


def smoothing_window(n: int) -> int:
    """A trailing-mean window of about 1/25 of the curve: none on a few steps, about 24 steps on 600."""
    return max(1, round(n / 25))


def trailing_mean(values: Sequence[float], window: int) -> np.ndarray:
    """Mean of each value and the `window - 1` before it (defined from the window-th value on)."""
    array = np.asarray(values, dtype=float)
    if window <= 1:
        return array
    return np.convolve(array, np.ones(window) / window, mode="valid")


def _step_curve_figure(
    runs: Sequence[RunData], fig_id: str, title: str, column: str, ylabel: str, caption: str
) -> Figure:
    points = {run.run_id: [(s["step"], s[column]) for s in run.steps if is_number(s.get(column))] for run in runs}
    present, notes = _split(runs, lambda r: bool(points[r.run_id]), _no_step_reason)
    if not present:
        return Figure(fig_id, title, caption, None, notes)
    colors = run_colors(runs)
    fig = _new_figure(HALF)
    ax = fig.add_subplot()
    smoothed = []
    for run in present:
        steps, values = [p[0] for p in points[run.run_id]], [p[1] for p in points[run.run_id]]
        window = smoothing_window(len(values))
        if window == 1:
            ax.plot(steps, values, color=colors[run.run_id], marker="o", markersize=3, lw=1.5, label=run.run_id)
            continue
        ax.plot(steps, values, color=colors[run.run_id], lw=0.7, alpha=0.3)
        ax.plot(steps[window - 1 :], trailing_mean(values, window), color=colors[run.run_id], lw=1.8, label=run.run_id)
        smoothed.append(f"{run.run_id}: mean of the last {window} steps")
    ax.set_xlabel("RL step")
    ax.set_ylabel(ylabel)
    drawn = [value for run in present for _, value in points[run.run_id]]
    low, high = min(drawn), max(drawn)
    ax.set_ylim(min(0.0, low) - 0.02, max(1.0, high) + 0.02)  # rewards are in [0, 1] unless a penalty says else
    ax.legend(loc="best")
    if smoothed:
        caption += " Thin lines: every step; thick lines: " + "; ".join(smoothed) + "."
    return Figure(fig_id, title, caption, to_svg(fig, fig_id, title), notes)


def reward_figure(runs: Sequence[RunData]) -> Figure:
    return _step_curve_figure(
        runs,
        "reward",
        "Training reward",
        "mean_reward",
        "mean reward of the step's rollouts",
        "Mean verifier score of each RL step's rollouts (train_steps.mean_reward).",
    )


def effective_ratio_figure(runs: Sequence[RunData]) -> Figure:
    return _step_curve_figure(
        runs,
        "effective-ratio",
        "Effective-gradient ratio",
        "effective_ratio",
        "share of groups with reward variance",
        "Share of each step's groups whose rewards are not all equal, the groups GRPO can learn from "
        "(train_steps.effective_ratio).",
    )


def accuracy_figure(runs: Sequence[RunData]) -> Figure:
    fig_id, title = "accuracy", "Held-out accuracy"
    caption = (
        "Greedy accuracy on the held-out split (evals): the line starts after the warm start (step 0) and "
        "follows every RL evaluation; the hollow marker is the untrained model."
    )
    present, notes = _split(runs, lambda r: bool(r.evals), lambda r: "no evaluation committed")
    if not present:
        return Figure(fig_id, title, caption, None, notes)
    colors = run_colors(runs)
    fig = _new_figure(HALF)
    ax = fig.add_subplot()
    for run in present:
        color = colors[run.run_id]
        by_phase: dict[str, list[dict[str, Any]]] = {}
        for row in run.evals:
            by_phase.setdefault(row["phase"], []).append(row)
        start = by_phase.get("warmstart") or by_phase.get("init") or []
        line = start[-1:] + by_phase.get("rl", [])
        xs, ys = [r["step"] for r in line], [r["accuracy"] for r in line]
        ax.plot(xs, ys, color=color, marker="o", markersize=3.5, lw=1.5, label=run.run_id)
        if ys:
            ax.annotate(f"{ys[-1]:.2f}", (xs[-1], ys[-1]), textcoords="offset points", xytext=(4, 4), color=color)
        for row in by_phase.get("init", []):
            ax.plot([row["step"]], [row["accuracy"]], marker="o", markersize=6, mfc="white", color=color, lw=0)
    splits = sorted({row["split"] for run in present for row in run.evals if row.get("split")})
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"greedy accuracy ({', '.join(splits) or 'held-out'} split)")
    ax.set_ylim(-0.02, 1.02)
    handles, labels = ax.get_legend_handles_labels()
    hollow = Line2D([], [], marker="o", mfc="white", color="#555555", lw=0, markersize=6)
    ax.legend([*handles, hollow], [*labels, "before warm start"], loc="best")
    return Figure(fig_id, title, caption, to_svg(fig, fig_id, title), notes)


def _curriculum_reason(run: RunData) -> str:
    if run.curriculum:
        return f"select.type={run.setting('select.type')} records no arm probabilities or values (Q)"
    return _no_step_reason(run)


def _has_arm_values(run: RunData) -> bool:
    return any(r.get("probability") is not None or r.get("q_after") is not None for r in run.curriculum)


def _arm_series(run: RunData, column: str) -> dict[str, tuple[list[int], list[float]]]:
    series: dict[str, tuple[list[int], list[float]]] = {}
    for row in run.curriculum:
        if row.get(column) is not None:
            steps, values = series.setdefault(row["arm"], ([], []))
            steps.append(row["step"])
            values.append(row[column])
    return series


def _labelled_arms(runs: Sequence[RunData]) -> tuple[list[str], set[str]]:
    """All arms (sorted) and those that get a color and a legend entry: every arm, or the most probable."""
    totals: dict[str, float] = {}
    for run in runs:
        for row in run.curriculum:
            totals[row["arm"]] = totals.get(row["arm"], 0.0) + (row.get("probability") or 0.0)
    arms = sorted(totals)
    ranked = sorted(arms, key=lambda arm: (-totals[arm], arm))
    return arms, set(ranked[:MAX_LABELLED_ARMS])


def _draw_arms(ax: Axes, series: dict[str, tuple[list[int], list[float]]], colors: dict[str, Any]) -> None:
    """One line per arm; over long runs a trailing mean, since per-step values of many arms overlap into noise."""
    for arm, (steps, values) in sorted(series.items()):
        window = smoothing_window(len(values)) if len(values) > SMOOTH_ARMS_AFTER else 1
        xs, ys = steps[window - 1 :], trailing_mean(values, window)
        if arm in colors:
            ax.plot(xs, ys, color=colors[arm], lw=1.4, marker="o" if len(xs) < 20 else None, markersize=2.5)
        else:
            ax.plot(xs, ys, color="#bbbbbb", lw=0.7)


def curriculum_figure(runs: Sequence[RunData]) -> Figure:
    fig_id, title = "curriculum", "Curriculum: arm probabilities and values"
    caption = (
        "Per selection arm and step (curriculum_state): the probability of drawing from the arm (top; dashed: "
        "uniform over the arms) and the arm's value Q after the step's update (bottom)."
    )
    present, notes = _split(runs, _has_arm_values, _curriculum_reason)
    if not present:
        return Figure(fig_id, title, caption, None, notes, wide=True)
    longest = max(len({r["step"] for r in run.curriculum}) for run in present)
    if longest > SMOOTH_ARMS_AFTER:
        caption += f" Runs over {SMOOTH_ARMS_AFTER} steps are drawn as trailing means of about 1/25 of the run."
    arms, labelled = _labelled_arms(present)
    palette = mpl.colormaps["tab20" if len(labelled) > 10 else "tab10"]
    colors = {arm: palette(i) for i, arm in enumerate(a for a in arms if a in labelled)}
    fig = _new_figure((WIDE, 5.2))
    axes = fig.subplots(2, len(present), sharex="col", sharey="row", squeeze=False)
    for col, run in enumerate(present):
        top, bottom = axes[0][col], axes[1][col]
        probabilities, values = _arm_series(run, "probability"), _arm_series(run, "q_after")
        _draw_arms(top, probabilities, colors)
        _draw_arms(bottom, values, colors)
        if probabilities:
            top.axhline(1 / len(probabilities), color="#777777", ls="--", lw=0.8)
        for ax, series, what in ((top, probabilities, "probabilities"), (bottom, values, "values")):
            if not series:
                ax.text(0.5, 0.5, f"no arm {what} recorded", transform=ax.transAxes, ha="center", color="#777777")
        if len(present) > 1 or len(runs) > 1:
            top.set_title(f"{run.run_id} (select.type={run.setting('select.type')})", fontsize=9)
        bottom.set_xlabel("RL step")
    axes[0][0].set_ylabel("P(draw from arm)")
    axes[1][0].set_ylabel("Q after the step")
    handles = [Line2D([], [], color=colors[arm], lw=2) for arm in colors]
    legend_title = "arm" if len(labelled) == len(arms) else f"arm (top {len(labelled)} of {len(arms)})"
    fig.legend(handles, list(colors), loc="outside right upper", title=legend_title)
    return Figure(fig_id, title, caption, to_svg(fig, fig_id, title), notes, wide=True)


def histogram_edges(values: Sequence[float], max_bins: int = 40) -> np.ndarray:
    """Bin edges for integer values: one bin per integer when they span fewer than `max_bins`, else
    `max_bins // 2` equal bins."""
    lo, hi = float(min(values)), float(max(values))
    if hi - lo < max_bins:
        return np.arange(lo - 0.5, hi + 1.5)
    return np.linspace(lo, hi, max_bins // 2 + 1)


def _share_histogram(ax: Axes, samples: list[tuple[str, list[float], str]], edges: np.ndarray) -> None:
    """Histograms in shares of each sample's size (runs of different lengths compare), bars side by side."""
    widths = np.diff(edges)
    slot = widths * 0.84 / len(samples)
    for i, (label, values, color) in enumerate(samples):
        counts, _ = np.histogram(values, bins=edges)
        left = edges[:-1] + widths * 0.08 + i * slot
        ax.bar(left, counts / len(values), width=slot, align="edge", color=color, alpha=0.85, label=label)


def budget_figure(runs: Sequence[RunData]) -> Figure:
    fig_id, title = "budgets", "Rollout budgets"
    caption = "How many rollouts each selected prompt got, over every step (allocations.n_rollouts)."
    present, notes = _split(runs, lambda r: bool(r.budgets), _no_step_reason)
    if not present:
        return Figure(fig_id, title, caption, None, notes)
    colors = run_colors(runs)
    samples = [
        (
            f"{run.run_id} ({run.setting('allocate.type')}; mean {np.mean(run.budgets):.1f}, "
            f"{len(run.budgets)} prompt-steps)",
            [float(v) for v in run.budgets],
            colors[run.run_id],
        )
        for run in present
    ]
    fig = _new_figure(HALF)
    ax = fig.add_subplot()
    _share_histogram(ax, samples, histogram_edges([v for s in samples for v in s[1]]))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("rollouts allocated to a prompt in a step")
    ax.set_ylabel("share of prompt-steps")
    ax.legend(loc="best")
    return Figure(fig_id, title, caption, to_svg(fig, fig_id, title), notes)


def _difficulty_reason(run: RunData) -> str:
    if run.kind == "data":
        return "no difficulty estimate (give `rlvr data --policy` or run `rlvr difficulty`)"
    return f"no difficulty estimate committed (run status: {run.status})"


def difficulty_figure(runs: Sequence[RunData]) -> Figure:
    fig_id, title = "difficulty", "Problem difficulty"
    caption = (
        "Pass rate of each pool problem under the reference policy: k sampled rollouts per problem, verified "
        "(difficulty.pass_rate); 0 is never solved."
    )
    present, notes = _split(runs, lambda r: bool(r.difficulty), _difficulty_reason)
    if not present:
        return Figure(fig_id, title, caption, None, notes)
    colors = run_colors(runs)
    samples = []
    for run in present:
        for policy, rates in sorted(run.difficulty.items()):
            label = run.run_id if len(run.difficulty) == 1 else f"{run.run_id} ({policy})"
            samples.append((f"{label}: {len(rates)} problems, k={run.difficulty_k}", rates, colors[run.run_id]))
    ks = {run.difficulty_k for run in present}
    k = next(iter(ks)) if len(ks) == 1 else None
    bins = k if k and k <= 32 else 10  # one bar per possible pass rate j/k, else tenths (runs with other k)
    edges = (np.arange(bins + 2) - 0.5) / bins
    fig = _new_figure(HALF)
    ax = fig.add_subplot()
    _share_histogram(ax, samples, edges)
    ax.set_xticks(np.linspace(0, 1, 6))
    ax.set_xlabel("pass rate under the reference policy")
    ax.set_ylabel("share of problems")
    ax.legend(loc="best")
    return Figure(fig_id, title, caption, to_svg(fig, fig_id, title), notes)


def _no_rewards_reason(run: RunData) -> str:
    return "no rewards committed" if run.steps else _no_step_reason(run)


def status_figure(runs: Sequence[RunData]) -> Figure:
    fig_id, title = "verifier-status", "Verifier status by domain"
    caption = "Share of each domain's labelled rollouts by verifier status (rewards.status, problems.domain)."
    present, notes = _split(runs, lambda r: bool(r.statuses), _no_rewards_reason)
    if not present:
        return Figure(fig_id, title, caption, None, notes)
    statuses = [s for s in STATUS_COLORS if any(r["status"] == s for run in present for r in run.statuses)]
    statuses += sorted({r["status"] for run in present for r in run.statuses} - set(statuses))
    bars: list[tuple[str, dict[str, int]]] = []
    for run in present:
        counts: dict[str, dict[str, int]] = {}
        for row in run.statuses:
            counts.setdefault(row["domain"], {})[row["status"]] = row["n"]
        for domain, by_status in sorted(counts.items()):
            bars.append((domain if len(runs) == 1 else f"{run.run_id} · {domain}", by_status))
    fig = _new_figure((HALF[0], max(2.4, 1.3 + 0.42 * len(bars))))
    ax = fig.add_subplot()
    rows = np.arange(len(bars))[::-1]
    left = np.zeros(len(bars))
    for status in statuses:
        totals = np.array([sum(c.values()) for _, c in bars], dtype=float)
        shares = np.array([c.get(status, 0) for _, c in bars]) / totals
        color = STATUS_COLORS.get(status, "#bcbd22")
        ax.barh(rows, shares, left=left, color=color, label=status, height=0.6)
        for row, share, start in zip(rows, shares, left):
            if share >= 0.07:
                ax.text(start + share / 2, row, f"{share:.0%}", ha="center", va="center", color="white", fontsize=8)
        left += shares
    for row, (_, by_status) in zip(rows, bars):
        ax.text(1.01, row, f"n={sum(by_status.values()):,}", va="center", fontsize=8)
    ax.set_yticks(rows, [label for label, _ in bars])
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of labelled rollouts")
    ax.grid(False)
    fig.legend(loc="outside upper center", ncol=len(statuses))
    return Figure(fig_id, title, caption, to_svg(fig, fig_id, title), notes)


def _no_episodes_reason(run: RunData) -> str:
    if run.kind == "data" or run.environment is not None:
        return _no_step_reason(run)
    return f"no environment (env.type={run.setting('env.type') or 'one_turn'}): one turn per rollout"


def _label_points(ax: Axes, xs: Sequence[int], ys: Sequence[float], labels: Sequence[str], color: str) -> None:
    """Each point's value as text above it, on curves short enough for the labels not to overlap."""
    if len(xs) > LABELLED_POINTS:
        return
    for x, y, label in zip(xs, ys, labels):
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(0, 5), ha="center", color=color, fontsize=7.5)


def turns_figure(runs: Sequence[RunData]) -> Figure | None:
    """Mean assistant turns per trajectory at each step; None when no run has an environment."""
    if not any(run.environment for run in runs):
        return None
    fig_id, title = "turns", "Turns per trajectory"
    caption = (
        "Mean number of assistant turns per trajectory at each RL step (turns: assistant rows per rollout); "
        "dashed: the run's env.max_turns."
    )
    present, notes = _split(runs, lambda r: bool(r.episodes), _no_episodes_reason)
    if not present:
        return Figure(fig_id, title, caption, None, notes)
    colors = run_colors(runs)
    fig = _new_figure(HALF)
    ax = fig.add_subplot()
    top = 1.0
    for run in present:
        color = colors[run.run_id]
        steps = [e["step"] for e in run.episodes]
        means = [e["assistant_turns"] / e["trajectories"] for e in run.episodes]
        trajectories = sum(e["trajectories"] for e in run.episodes)
        overall = sum(e["assistant_turns"] for e in run.episodes) / trajectories
        label = f"{run.run_id} ({run.environment}): {overall:.2f} over {trajectories:,} trajectories"
        ax.plot(steps, means, color=color, marker="o", markersize=3.5, lw=1.5, label=label)
        _label_points(ax, steps, means, [f"{m:.2f}" for m in means], color)
        max_turns = run.setting("env.max_turns")
        if is_number(max_turns):
            ax.axhline(max_turns, color=color, ls="--", lw=0.8)
            top = max(top, float(max_turns))
        top = max(top, *means)
    ax.set_ylim(0, top * 1.25)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("RL step")
    ax.set_ylabel("assistant turns per trajectory")
    ax.legend(loc="lower left")
    return Figure(fig_id, title, caption, to_svg(fig, fig_id, title), notes)


def _stop_reason_order(runs: Sequence[RunData]) -> list[str]:
    seen = {row["stop_reason"] for run in runs for row in run.stop_reasons}
    return [r for r in STOP_COLORS if r in seen] + sorted(seen - set(STOP_COLORS))


def _draw_stop_reasons(ax: Axes, run: RunData, reasons: Sequence[str]) -> None:
    """One bar per step, stacked by stop reason in shares of the step's trajectories; the legend counts each."""
    counts: dict[int, Counter[str]] = {}
    for row in run.stop_reasons:
        counts.setdefault(row["step"], Counter())[row["stop_reason"]] += row["n"]
    steps = sorted(counts)
    totals = np.array([sum(counts[s].values()) for s in steps], dtype=float)
    bottom = np.zeros(len(steps))
    for reason in reasons:
        n = np.array([counts[s][reason] for s in steps], dtype=float)
        if not n.any():
            continue
        shares = n / totals
        color = STOP_COLORS.get(reason, "#bcbd22")
        ax.bar(steps, shares, bottom=bottom, width=0.8, color=color, label=f"{reason}: {int(n.sum()):,}")
        if len(steps) <= LABELLED_POINTS:
            for step, share, start in zip(steps, shares, bottom):
                if share >= 0.1:
                    ax.text(
                        step, start + share / 2, f"{share:.0%}", ha="center", va="center", color="white", fontsize=7
                    )
        bottom += shares
    ax.set_ylim(0, 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("share of trajectories")
    ax.grid(False)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), title="stop reason (trajectories)")


def stop_reason_figure(runs: Sequence[RunData]) -> Figure | None:
    """How each step's trajectories ended; None when no run has an environment."""
    if not any(run.environment for run in runs):
        return None
    fig_id, title = "stop-reasons", "Stop reasons"
    caption = (
        "Why each RL step's trajectories ended, as shares of the step's trajectories (turns.stop_reason on a "
        "trajectory's last turn): done, max_turns, token_budget, tool_timeout or error."
    )
    present, notes = _split(runs, lambda r: bool(r.stop_reasons), _no_episodes_reason)
    if not present:
        return Figure(fig_id, title, caption, None, notes)
    reasons = _stop_reason_order(present)
    fig = _new_figure((HALF[0], 0.8 + 2.6 * len(present)))
    axes = fig.subplots(len(present), 1, sharex=True, squeeze=False)
    for ax, run in zip(axes[:, 0], present):
        _draw_stop_reasons(ax, run, reasons)
        if len(runs) > 1:
            ax.set_title(run.run_id, fontsize=9)
    axes[-1][0].set_xlabel("RL step")
    return Figure(fig_id, title, caption, to_svg(fig, fig_id, title), notes)


def _no_tool_calls_reason(run: RunData) -> str:
    if run.episodes:
        return f"no tool calls in its {sum(e['trajectories'] for e in run.episodes):,} trajectories"
    return _no_episodes_reason(run)


def tool_call_figure(runs: Sequence[RunData]) -> Figure | None:
    """The share of each step's tool calls that returned ok; None when no run has an environment."""
    if not any(run.environment for run in runs):
        return None
    fig_id, title = "tool-calls", "Tool-call success rate"
    caption = (
        "Share of each RL step's tool calls that returned status ok, among all its calls (turns.tool_statuses: "
        "ok, error, timeout or malformed); a point's label is ok / calls."
    )
    present, notes = _split(runs, lambda r: any(t["calls"] for t in r.tool_calls), _no_tool_calls_reason)
    if not present:
        return Figure(fig_id, title, caption, None, notes)
    colors = run_colors(runs)
    fig = _new_figure(HALF)
    ax = fig.add_subplot()
    for run in present:
        color = colors[run.run_id]
        rows = [t for t in run.tool_calls if t["calls"]]
        steps, rates = [t["step"] for t in rows], [t["ok"] / t["calls"] for t in rows]
        ok, calls = sum(t["ok"] for t in rows), sum(t["calls"] for t in rows)
        label = f"{run.run_id}: {ok:,} of {calls:,} calls ok ({ok / calls:.0%})"
        ax.plot(steps, rates, color=color, marker="o", markersize=3.5, lw=1.5, label=label)
        _label_points(ax, steps, rates, [f"{t['ok']}/{t['calls']}" for t in rows], color)
    ax.set_ylim(-0.02, 1.12)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("RL step")
    ax.set_ylabel("share of tool calls with status ok")
    ax.legend(loc="lower left")
    return Figure(fig_id, title, caption, to_svg(fig, fig_id, title), notes)


def judge_figure(runs: Sequence[RunData]) -> Figure | None:
    """The share of each step's judge verdicts that failed, and the mean seconds of a call; None when no run was
    rewarded by a judge."""
    if not any(run.judge for run in runs):
        return None
    fig_id, title = "judge", "Judge: failed verdicts and latency"
    caption = (
        "Left: share of each RL step's judge verdicts with status error (rewards.verifier = 'judge'; left out of "
        "the update); a point's label is failed / verdicts. Right: mean seconds of the step's calls to the judge "
        "(rewards.latency_s of the verdicts not taken from the cache)."
    )
    present, notes = _split(runs, lambda r: bool(r.judge), lambda r: "no judge verdicts")
    colors = run_colors(runs)
    fig = _new_figure((WIDE, HALF[1]))
    failed_ax, latency_ax = fig.subplots(1, 2)
    slowest = 0.0
    for run in present:
        color = colors[run.run_id]
        steps = [j["step"] for j in run.judge]
        rates = [j["failed"] / j["verdicts"] for j in run.judge]
        failed, verdicts = sum(j["failed"] for j in run.judge), sum(j["verdicts"] for j in run.judge)
        label = f"{run.run_id}: {failed:,} of {verdicts:,} failed ({failed / verdicts:.1%})"
        failed_ax.plot(steps, rates, color=color, marker="o", markersize=3.5, lw=1.5, label=label)
        _label_points(failed_ax, steps, rates, [f"{j['failed']}/{j['verdicts']}" for j in run.judge], color)
        asked = [(j["step"], j["seconds"]) for j in run.judge if j["seconds"] is not None]
        latency_ax.plot([a[0] for a in asked], [a[1] for a in asked], color=color, marker="o", markersize=3.5)
        slowest = max([slowest, *(a[1] for a in asked)])
    failed_ax.set_ylim(-0.02, 1.12)
    failed_ax.set_ylabel("share of verdicts failed")
    failed_ax.legend(loc="upper left")
    latency_ax.set_ylabel("seconds a call (cache misses)")
    latency_ax.set_ylim(0, slowest * 1.15 or 1.0)
    for ax in (failed_ax, latency_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("RL step")
    return Figure(fig_id, title, caption, to_svg(fig, fig_id, title), notes)


def mismatch_figure(runs: Sequence[RunData]) -> Figure | None:
    """The sampler-trainer mismatch of each step that measured it (rollouts carrying their sampler's log-probs);
    None when no run measured one."""
    points = {r.run_id: [s for s in r.steps if is_number(s.get("mismatch_mean"))] for r in runs}
    if not any(points.values()):
        return None
    fig_id, title = "mismatch", "Sampler-trainer mismatch"
    caption = (
        "Mean (solid) and largest (dashed) |log π_sampler − log π_trainer| over each step's sampled tokens "
        "(train_steps.mismatch_mean, mismatch_max; log scale): another engine or precision, or a stale sampler "
        "(flow.async_level). A label gives the share of tokens train.grpo.correction changed, when above 0."
    )
    present, notes = _split(runs, lambda r: bool(points[r.run_id]), lambda r: "no step measured it")
    colors = run_colors(runs)
    fig = _new_figure(HALF)
    ax = fig.add_subplot()
    for run in present:
        rows, color = points[run.run_id], colors[run.run_id]
        steps = [p["step"] for p in rows]
        ax.plot(steps, [max(p["mismatch_mean"], 1e-12) for p in rows], color=color, marker="o", ms=3, label=run.run_id)
        ax.plot(steps, [max(p["mismatch_max"], 1e-12) for p in rows], color=color, lw=0.8, ls="--")
        shares = [p.get("corrected_share") or 0.0 for p in rows]
        if any(shares):
            _label_points(ax, steps, [p["mismatch_max"] for p in rows], [f"{x:.0%}" for x in shares], color)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("RL step")
    ax.set_ylabel("|log-prob difference|")
    ax.legend(loc="best")
    return Figure(fig_id, title, caption, to_svg(fig, fig_id, title), notes)


FIGURES: tuple[Callable[[Sequence[RunData]], Figure | None], ...] = (
    reward_figure,
    accuracy_figure,
    effective_ratio_figure,
    budget_figure,
    curriculum_figure,
    difficulty_figure,
    status_figure,
    turns_figure,
    stop_reason_figure,
    tool_call_figure,
    judge_figure,
    mismatch_figure,
)


def all_figures(runs: Sequence[RunData]) -> list[Figure]:
    """Every figure of the report that applies to these runs, in page order; matplotlib's style is set for these
    figures only."""
    with mpl.rc_context(STYLE):
        return [figure for make in FIGURES if (figure := make(runs)) is not None]


def is_number(value: Any) -> bool:
    """A value a curve can draw: not missing and finite (a step that trained no group has no mean reward)."""
    return isinstance(value, int | float) and math.isfinite(value)
