"""`rlvr report`: the HTML page of real runs, rendered in headless Chromium, every plot drawn and titled.

One SEC + Knapsack run (every figure has data) and one uniform run (the curriculum figure has none) are
made once for the module. Chromium loads the page from file:// with name resolution cut, takes a
screenshot, and the pixels inside each plot's box must show drawn color.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from rlvr.flows.report import Lineage, RunPage, flatten, run_summary, write_report
from rlvr.flows.report_plots import RunData, all_figures, histogram_edges, smoothing_window, trailing_mean
from rlvr.storage.store import Store
from rlvr.storage.views import query
from tests.cli_helpers import rlvr
from tests.conftest import TINY_OVERRIDES

FIGURES = {
    "reward": "Training reward",
    "accuracy": "Held-out accuracy",
    "effective-ratio": "Effective-gradient ratio",
    "budgets": "Rollout budgets",
    "curriculum": "Curriculum: arm probabilities and values",
    "difficulty": "Problem difficulty",
    "verifier-status": "Verifier status by domain",
}
UNIFORM_NOTE = "uni: no data: select.type=uniform records no arm probabilities or values (Q)"
WIDTH = 1400
# Written into a copy of the page only: Chromium reports where each plot landed (the page itself has no script).
MEASURE = """<script>
for (const f of document.querySelectorAll('figure')) {
  const r = (f.querySelector('svg') || f).getBoundingClientRect();
  f.setAttribute('data-box', [r.left, r.top + window.scrollY, r.width, r.height].map(Math.round).join(','));
}
document.body.setAttribute('data-height', document.documentElement.scrollHeight);
</script></body>"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prefect_api):
    """A store with `sec` (SEC + Knapsack, 6 steps) and `uni` (uniform, 3 steps)."""
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute

    root = str(tmp_path_factory.mktemp("report") / "store")
    # Knapsack from the difficulty prior, so its budgets vary from the first step (the report plots them)
    sec = [
        "select.type=sec",
        "allocate.type=knapsack",
        "allocate.unknown=prior",
        "warmstart.steps=30",
        "difficulty.k=4",
    ]
    execute(root, load_config(None, ["run_id=sec", *TINY_OVERRIDES, *sec]))
    execute(root, load_config(None, ["run_id=uni", *TINY_OVERRIDES, "train.steps=3"]))
    return Store.open(root)


@pytest.fixture(scope="module")
def chromium() -> str:
    found = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail("CI is set but headless Chromium is missing: apt-get install -y chromium")
    pytest.skip("headless Chromium is not installed (apt-get install -y chromium); CI installs it")


class Page(HTMLParser):
    """Each <figure>: its h2 title, SVG and path counts, the SVG's texts and any no-data note."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.figures: dict[str, dict] = {}
        self.height = 0
        self._figure: dict | None = None
        self._capture: str | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "body" and a.get("data-height"):
            self.height = int(a["data-height"])
        if tag == "figure":
            box = [int(v) for v in a["data-box"].split(",")] if a.get("data-box") else None
            self._figure = {"title": "", "svgs": 0, "paths": 0, "texts": [], "no_data": "", "notes": "", "box": box}
            self.figures[a["id"].removeprefix("fig-")] = self._figure
        elif self._figure is not None:
            if tag in ("svg", "path"):
                self._figure[tag + "s"] += 1
            self._capture = {"h2": "title", "text": "texts", "p": "no_data", "ul": "notes"}.get(tag, self._capture)

    def handle_endtag(self, tag: str) -> None:
        if tag == "figure":
            self._figure = None
        if tag in ("h2", "text", "p", "ul"):
            self._capture = None

    def handle_data(self, data: str) -> None:
        if self._figure is None or self._capture is None:
            return
        if self._capture == "texts":
            self._figure["texts"].append(data)
        else:
            self._figure[self._capture] += data


def render(chromium: str, html_path: Path, work: Path) -> tuple[Page, np.ndarray]:
    """The DOM Chromium built (with each plot's box) and a screenshot of the page as it is."""
    from PIL import Image

    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        "--host-resolver-rules=MAP * ~NOTFOUND",  # nothing resolves: the page must need no network
        f"--user-data-dir={work / 'chromium-profile'}",
    ]
    measured = work / f"measured-{html_path.name}"
    measured.write_text(html_path.read_text(encoding="utf-8").replace("</body>", MEASURE), encoding="utf-8")
    dom = subprocess.run(
        [chromium, *flags, f"--window-size={WIDTH},1000", "--dump-dom", measured.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    page = Page(dom.stdout)
    shot = work / f"{html_path.stem}.png"
    subprocess.run(
        [
            chromium,
            *flags,
            f"--window-size={WIDTH},{page.height}",
            f"--screenshot={shot}",
            html_path.as_uri(),
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    return page, np.asarray(Image.open(shot).convert("RGB")).astype(int)


def assert_drawn(figure: dict, pixels: np.ndarray, name: str) -> None:
    """The plot's box holds ink (axes, text) and color (the data: lines, bars), not a blank canvas."""
    left, top, width, height = figure["box"]
    assert width > 500 and height > 150, f"{name}: the plot is {width}x{height} px"
    region = pixels[top : top + height, left : left + width]
    assert region.shape[0] == height, f"{name}: the screenshot ends before the plot does"
    ink = (region.min(axis=2) < 200).mean()
    color = ((region.max(axis=2) - region.min(axis=2)) > 60).sum()
    assert ink > 0.01, f"{name}: {ink:.3%} of the plot's pixels are drawn"
    assert color > 300, f"{name}: only {color} colored pixels"


@pytest.mark.slow
def test_report_of_a_sec_knapsack_run_draws_every_plot_in_chromium(runs, chromium, tmp_path):
    result = rlvr("report", "sec", "--store", runs.root)
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip())
    assert path == Path(runs.root) / "reports" / "sec.html"
    text = path.read_text(encoding="utf-8")
    for marker in ("<script", "<link", "<img", "@import", 'src="http', 'href="http'):
        assert marker not in text, f"the page must be self-contained, found {marker!r}"
    assert not re.search(r"url\((?!#)", text), "url() may only point inside the page"
    page, pixels = render(chromium, path, tmp_path)
    assert list(page.figures) == list(FIGURES)
    for name, title in FIGURES.items():
        figure = page.figures[name]
        assert figure["title"] == title
        assert figure["svgs"] == 1 and figure["paths"] >= 5, f"{name}: {figure['svgs']} svg, {figure['paths']} paths"
        assert figure["no_data"] == "" and figure["notes"] == "", f"{name}: {figure['no_data']}{figure['notes']}"
        assert_drawn(figure, pixels, name)
    assert "sec" in page.figures["reward"]["texts"]  # the legend names the run
    arms = query(runs, "SELECT DISTINCT arm FROM curriculum_state WHERE run_id = 'sec'").column("arm").to_pylist()
    assert len(arms) == 8 and set(arms) <= set(page.figures["curriculum"]["texts"])


@pytest.mark.slow
def test_comparison_overlays_both_runs_and_says_why_uniform_has_no_arms(runs, chromium, tmp_path):
    path = Path(write_report(runs, ["sec", "uni"]))
    assert path == Path(runs.root) / "reports" / "report-sec-vs-uni.html"
    page, pixels = render(chromium, path, tmp_path)
    for name in FIGURES:
        assert_drawn(page.figures[name], pixels, name)
    for name in ("reward", "accuracy", "effective-ratio"):
        assert {"sec", "uni"} <= set(page.figures[name]["texts"]), name
    assert any(t.startswith("uni (uniform; mean 4.0, 12 prompt-steps)") for t in page.figures["budgets"]["texts"])
    assert {"sec · arithmetic", "uni · arithmetic"} <= set(page.figures["verifier-status"]["texts"])
    assert page.figures["curriculum"]["notes"] == UNIFORM_NOTE
    text = path.read_text(encoding="utf-8")
    assert '<tr class="differs"><td>select.type</td><td>&quot;sec&quot;</td><td>&quot;uniform&quot;</td></tr>' in text


@pytest.mark.slow
def test_uniform_run_alone_shows_the_reason_instead_of_an_empty_curriculum(runs, tmp_path):
    out = tmp_path / "uni.html"
    result = rlvr("report", "uni", "--store", runs.root, "--out", str(out))
    assert result.returncode == 0 and result.stdout.strip() == str(out), result.stderr
    page = Page(out.read_text(encoding="utf-8"))
    assert list(page.figures) == list(FIGURES)  # no turns, stop reasons or tool calls: one-turn runs have none
    assert page.figures["curriculum"]["svgs"] == 0
    assert page.figures["curriculum"]["no_data"] == UNIFORM_NOTE
    assert all(page.figures[name]["svgs"] == 1 for name in FIGURES if name != "curriculum")


@pytest.mark.slow
def test_report_figures_come_from_the_stores_rows(runs):
    from rlvr.flows.report import load_runs

    sec, uni = load_runs(runs, ["sec", "uni"])
    assert sum(sec.data.budgets) == 6 * 4 * 4  # Knapsack spends exactly prompts x n each step
    assert len(set(sec.data.budgets)) > 1  # and spreads it: the histogram has more than one bar
    assert [s["step"] for s in uni.data.steps] == [1, 2, 3]
    rewards = query(runs, "SELECT count(*) AS n FROM rewards WHERE run_id = 'sec'").column("n")[0].as_py()
    assert sum(r["n"] for r in sec.data.statuses) == rewards
    from rlvr.flows.runs import accuracy_summary

    accuracy = accuracy_summary(runs, "sec")
    expected = " → ".join(f"{accuracy[k]:.2f}" for k in ("accuracy_init", "accuracy_warmstart", "accuracy_final"))
    summary = run_summary(sec)
    assert (summary["status"], summary["steps"], summary["curriculum"]) == ("completed", "6 / 6", "sec / knapsack")
    assert summary["accuracy"] == expected
    assert summary["rollouts"] == str(sum(sec.data.budgets))
    checkpoint = sec.lineage.checkpoint
    assert checkpoint is not None and checkpoint["step"] == 6


@pytest.mark.slow
def test_unknown_run_is_one_line_and_a_nonzero_exit(runs):
    result = rlvr("report", "sec", "nope", "--store", runs.root)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: unknown run id 'nope' in store {runs.root}; runs there: sec, uni"


def test_a_data_run_gets_a_reason_for_every_rl_figure():
    data_run = RunData(
        run_id="d", kind="data", status="completed", config={}, difficulty={"init": [0.0, 0.5]}, difficulty_k=2
    )
    figures = {f.id: f for f in all_figures([data_run])}
    for name in ("reward", "effective-ratio", "budgets", "curriculum", "verifier-status"):
        assert figures[name].svg is None and figures[name].notes == ["d: no data: a data run has no RL steps"]
    assert figures["accuracy"].notes == ["d: no data: no evaluation committed"]
    assert figures["difficulty"].svg is not None and figures["difficulty"].svg.startswith('<svg role="img"')


def test_a_data_runs_header_shows_no_rl_columns():
    data_run = RunData(run_id="d", kind="data", status="completed", config={"train": {"steps": 600}})
    summary = run_summary(RunPage(data_run, {}, Lineage([], None, [], [], [])))
    assert summary == {
        "status": "completed (data run)",
        "steps": "-",
        "curriculum": "-",
        "accuracy": "n/a",
        "reward": "n/a",
        "ratio": "n/a",
        "rollouts": "0",
        "wall": "n/a",
    }


def test_figures_are_reproducible_svg():
    steps = [{"step": s, "mean_reward": s / 10, "effective_ratio": 0.5, "rollouts": 16} for s in range(1, 9)]
    run = RunData(run_id="r", kind="rl", status="completed", config={}, steps=steps, budgets=[2, 4, 4, 6])
    first, second = all_figures([run]), all_figures([run])
    assert [f.svg for f in first] == [f.svg for f in second]
    assert "<dc:date>" not in (first[0].svg or "")


def test_binning_smoothing_and_config_keys():
    assert histogram_edges([2, 4, 4, 6]).tolist() == [1.5, 2.5, 3.5, 4.5, 5.5, 6.5]
    assert histogram_edges([4, 4]).tolist() == [3.5, 4.5]
    assert histogram_edges([0, 8], max_bins=4).tolist() == [0.0, 4.0, 8.0]
    assert (smoothing_window(6), smoothing_window(600)) == (1, 24)
    assert trailing_mean([1, 2, 3, 4], 2).tolist() == [1.5, 2.5, 3.5]
    config = {"select": {"type": "sec", "tau": 0.4}, "synthesize": {"sources": [{"type": "skills"}], "size": None}}
    assert flatten(config) == {
        "select.type": '"sec"',
        "select.tau": "0.4",
        "synthesize.sources[0].type": '"skills"',
        "synthesize.size": "null",
    }
