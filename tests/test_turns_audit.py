"""Auditing multi-turn runs (docs/audit.md, "Audit turns and tool calls"): on a real run whose episodes call tools,
the report's turn and tool-call figures show what the store holds (counted here from the rollouts and from the
lists in Python, not by the report's SQL), every turns query of the docs runs and answers what it says, and a tool
call leads back to the checkpoint whose policy made it. One-turn runs get no episode figures (tests/test_report.py).

The run is the one the docs show, made from their command: the tiny model never writes a `<tool_call>`, so its
environment is tests/env_fixtures.py's scripted caller over the real calculator environment, tool runner and
sandbox (a malformed call, a flood, a hang, a caller that never stops, drawn per problem)."""

from __future__ import annotations

import re
import shlex
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from rlvr.storage.store import Store
from rlvr.storage.views import query
from tests.test_docs_commands import FENCE, commands, words
from tests.test_report import chromium  # noqa: F401  (the fixture: Chromium, or a skip that says why)

# ----- the run of docs/audit.md's turns section ----------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
SECTION = "## Audit turns and tool calls"
EPISODE_FIGURES = ("turns", "stop-reasons", "tool-calls")
QUERIES = (  # the section's `rlvr query` examples, in page order
    "every tool call of a trajectory",
    "the turns of a trajectory with their spans",
    "tool-call success rate per step",
    "stop reasons per step",
    "trajectories that ended on tool_timeout",
    "the checkpoint whose policy made each call",
    "the calls a checkpoint's policy made",
)


def turns_section() -> str:
    text = (REPO / "docs" / "audit.md").read_text(encoding="utf-8")
    start = text.index(SECTION)
    return text[start : text.index("\n## ", start + len(SECTION))]


def docs_run() -> tuple[str, list[str]]:
    """The run id and `--set` overrides of the section's `PYTHONPATH=. rlvr run ...` command."""
    line = next(b for b in FENCE.findall(turns_section()) if "rlvr run" in b).replace("\\\n", " ")
    args = shlex.split(line)
    assert args[:3] == ["PYTHONPATH=.", "rlvr", "run"], args[:3]
    run_id = args[args.index("--run-id") + 1]
    return run_id, [args[i + 1] for i, arg in enumerate(args) if arg == "--set"]


def docs_queries() -> list[str]:
    """The SQL of each `rlvr query` in the section's code blocks."""
    found = [words(line) for line in commands(turns_section())]
    return [args[1] for args in found if args[0] == "query"]


def rows(store: Store, sql: str) -> list[dict[str, Any]]:
    return query(store, sql).to_pylist()


@pytest.fixture(scope="module")
def tools_run(tmp_path_factory, prefect_api) -> Store:
    """The docs' run, made here: scripted tool calls over 3 steps, a checkpoint after step 2."""
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute

    run_id, overrides = docs_run()
    root = str(tmp_path_factory.mktemp("turns-audit") / "store")
    execute(root, load_config(None, [f"run_id={run_id}", *overrides]))
    return Store.open(root)


def calls_of(turn_rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """(step, rollout, turn, call number, name, arguments, status, output) of every call, from the lists in Python."""
    return [
        (t["step"], t["rollout_id"], t["turn"], i + 1, *call)
        for t in sorted(turn_rows, key=lambda t: (t["rollout_id"], t["turn"]))
        for i, call in enumerate(
            zip(t["tool_names"] or [], t["tool_arguments"] or [], t["tool_statuses"] or [], t["tool_outputs"] or [])
        )
    ]


@pytest.fixture(scope="module")
def audited(tools_run) -> dict[str, Any]:
    """What the tests compare with, read from the store without the SQL under test: every call, the trajectories,
    three of them (one whose calls fared apart, one of step 3, one of step 1) and two checkpoints (the copy of the
    policy after step 2, which sampled step 3, and the warm start, which sampled step 1)."""
    turn_rows = rows(tools_run, "SELECT * FROM turns")
    trajectories = rows(tools_run, "SELECT rollout_id, step, n_turns, stop_reason, policy_id FROM rollouts")
    calls = calls_of(turn_rows)
    statuses: dict[str, set[str]] = {}
    for call in calls:
        statuses.setdefault(call[1], set()).add(call[6])
    step_of = {t["rollout_id"]: t["step"] for t in trajectories}
    varied = sorted(r for r, of in statuses.items() if len(of) >= 2)  # the docs' example: calls that fared apart
    late = sorted(r for r in statuses if step_of[r] == 3)
    early = sorted(r for r in statuses if step_of[r] == 1)
    assert varied and late and early, "no trajectory whose calls fared apart, or no calls in step 1 or in step 3"
    checkpoints = {m.step: m for m in tools_run.manifests(kind="checkpoints") if m.stage == "checkpoint"}
    return {
        "turns": turn_rows,
        "trajectories": {t["rollout_id"]: t for t in trajectories},
        "calls": calls,
        "varied": varied[0],
        "late": late[0],
        "early": early[0],
        "checkpoint": checkpoints[2],  # a copy of the policy after step 2, which sampled step 3
        "warm_start": next(m for m in tools_run.manifests(kind="checkpoints") if m.stage == "warmstart"),
    }


def shown(output: str) -> str:
    """A tool's output as the docs' query shows it: blanks collapsed, the first 40 characters."""
    return re.sub(r"\s+", " ", output)[:40]


def run_docs_query(store: Store, name: str, ids: dict[str, str]) -> list[dict[str, Any]]:
    """The docs' query `name` with the docs' rollout and checkpoint ids replaced by `ids`' (this run's)."""
    sql = docs_queries()[QUERIES.index(name)]
    for kind, pattern in (("rollout", r"r-[0-9a-f]{16}"), ("checkpoint", r"checkpoints-[0-9a-f]{20}")):
        if kind in ids:
            sql = re.sub(pattern, ids[kind], sql)
    return rows(store, sql)


# ----- the report ----------------------------------------------------------------------------------------------


def episode_figures(store: Store, run_ids: list[str], out: Path) -> dict[str, dict]:
    from rlvr.flows.report import write_report
    from tests.test_report import Page

    write_report(store, run_ids, out)
    return Page(out.read_text(encoding="utf-8")).figures


@pytest.mark.slow
def test_the_report_shows_the_turns_stop_reasons_and_tool_calls_the_store_holds(tools_run, audited, tmp_path):
    figures = episode_figures(tools_run, ["tools"], tmp_path / "tools.html")
    for name in EPISODE_FIGURES:
        assert figures[name]["svgs"] == 1 and figures[name]["no_data"] == figures[name]["notes"] == "", name
    trajectories = list(audited["trajectories"].values())
    steps = sorted({t["step"] for t in trajectories})
    # turns per trajectory: rollouts.n_turns, not the turns rows the report counts
    of_step = {s: [t["n_turns"] for t in trajectories if t["step"] == s] for s in steps}
    texts = figures["turns"]["texts"]
    assert [f"{sum(n) / len(n):.2f}" for n in of_step.values()] == [t for t in texts if re.fullmatch(r"\d\.\d\d", t)]
    mean = sum(t["n_turns"] for t in trajectories) / len(trajectories)
    env_type = next(o.removeprefix("env.type=") for o in docs_run()[1] if o.startswith("env.type="))
    assert f"tools ({env_type}): {mean:.2f} over {len(trajectories)} trajectories" in texts
    # stop reasons: rollouts.stop_reason, one per trajectory
    reasons = Counter(t["stop_reason"] for t in trajectories)
    legend = {t for t in figures["stop-reasons"]["texts"] if re.fullmatch(r"[a-z_]+: \d+", t)}
    assert legend == {f"{reason}: {n}" for reason, n in reasons.items()}
    assert {"tool_timeout", "max_turns"} <= set(reasons), reasons  # the scripted calls make both happen
    # tool calls: every entry of the lists, counted in Python
    calls = audited["calls"]
    per_step = [[c for c in calls if c[0] == s] for s in steps]
    labels = [f"{sum(c[6] == 'ok' for c in of)}/{len(of)}" for of in per_step]
    assert labels == [t for t in figures["tool-calls"]["texts"] if re.fullmatch(r"\d+/\d+", t)]
    ok = sum(c[6] == "ok" for c in calls)
    assert 0 < ok < len(calls), "every call ok or none: the success rate says nothing"
    assert f"tools: {ok} of {len(calls)} calls ok ({ok / len(calls):.0%})" in figures["tool-calls"]["texts"]


@pytest.mark.slow
def test_the_episode_figures_are_drawn_in_chromium(tools_run, chromium, tmp_path):  # noqa: F811
    from rlvr.flows.report import write_report
    from tests.test_report import assert_drawn, render

    path = Path(write_report(tools_run, ["tools"], tmp_path / "tools.html"))
    page, pixels = render(chromium, path, tmp_path)
    for name in EPISODE_FIGURES:
        assert_drawn(page.figures[name], pixels, name)


def test_a_page_without_environments_has_no_episode_figures_and_a_run_without_calls_says_so():
    from rlvr.flows.report_plots import RunData, all_figures

    steps = [{"step": 1, "mean_reward": 0.5, "effective_ratio": 0.5, "rollouts": 4}]
    plain = RunData("plain", "rl", "completed", {"env": {"type": "one_turn"}}, steps=steps)
    assert not {f.id for f in all_figures([plain])} & set(EPISODE_FIGURES)
    retry = RunData(
        "retry",
        "rl",
        "completed",
        {"env": {"type": "retry", "max_turns": 3}},
        steps=steps,
        episodes=[{"step": 1, "trajectories": 4, "assistant_turns": 7}],
        stop_reasons=[{"step": 1, "stop_reason": "done", "n": 3}, {"step": 1, "stop_reason": "max_turns", "n": 1}],
        tool_calls=[],
    )
    figures = {f.id: f for f in all_figures([retry, plain])}
    one_turn = "plain: no data: no environment (env.type=one_turn): one turn per rollout"
    for name in ("turns", "stop-reasons"):
        assert figures[name].svg is not None and figures[name].notes == [one_turn]
    assert figures["tool-calls"].svg is None
    assert figures["tool-calls"].notes == ["retry: no data: no tool calls in its 4 trajectories", one_turn]


# ----- the docs' queries ---------------------------------------------------------------------------------------


def test_the_docs_turns_section_has_its_queries_and_one_run_command():
    assert len(docs_queries()) == len(QUERIES)
    run_id, overrides = docs_run()
    assert run_id == "tools" and "env.type=tests.env_fixtures:ScriptedToolEnvironment" in overrides


@pytest.mark.slow
def test_the_docs_queries_of_one_trajectory_list_its_calls_and_spans(tools_run, audited):
    rollout = audited["varied"]
    got = run_docs_query(tools_run, "every tool call of a trajectory", {"rollout": rollout})
    expected = [(*c[2:7], shown(c[7])) for c in audited["calls"] if c[1] == rollout]
    keys = ("turn", "call", "tool", "arguments", "status", "output")
    assert [tuple(r[k] for k in keys) for r in got] == expected
    spans = run_docs_query(tools_run, "the turns of a trajectory with their spans", {"rollout": rollout})
    n_tokens = rows(tools_run, f"SELECT len(completion_ids) AS n FROM rollouts WHERE rollout_id = '{rollout}'")[0]["n"]
    assert [(s["token_start"], s["token_end"]) for s in spans] == list(
        zip([0] + [s["token_end"] for s in spans[:-1]], [s["token_end"] for s in spans])
    )
    assert spans[-1]["token_end"] == n_tokens  # the spans tile the trajectory
    assert all(s["loss_mask"] == ([1] if s["role"] == "assistant" else [0]) for s in spans)
    assert [s["stop_reason"] for s in spans] == [None] * (len(spans) - 1) + [
        audited["trajectories"][rollout]["stop_reason"]
    ]


@pytest.mark.slow
def test_the_docs_queries_per_step_count_what_the_rollouts_and_lists_hold(tools_run, audited):
    rates = run_docs_query(tools_run, "tool-call success rate per step", {})
    by_step: dict[int, list[str]] = {}
    for call in audited["calls"]:
        by_step.setdefault(call[0], []).append(call[6])
    expected = [(s, len(v), v.count("ok"), round(v.count("ok") / len(v), 3)) for s, v in sorted(by_step.items())]
    assert [(r["step"], r["calls"], r["ok"], r["ok_rate"]) for r in rates] == expected
    stops = run_docs_query(tools_run, "stop reasons per step", {})
    reasons = Counter((t["step"], t["stop_reason"]) for t in audited["trajectories"].values())
    assert {(r["step"], r["stop_reason"]): r["trajectories"] for r in stops} == reasons
    timeouts = run_docs_query(tools_run, "trajectories that ended on tool_timeout", {})  # the first five
    ended = sorted((t["step"], r) for r, t in audited["trajectories"].items() if t["stop_reason"] == "tool_timeout")
    assert [(r["step"], r["rollout_id"]) for r in timeouts] == ended[:5]
    assert {r["status"] for r in timeouts} == {"timeout"}


@pytest.mark.slow
def test_a_tool_call_leads_to_the_checkpoint_whose_policy_made_it(tools_run, audited):
    from rlvr.storage.lineage import ancestors, descendants, resolve_id

    checkpoint, warm_start = audited["checkpoint"], audited["warm_start"]
    for rollout, expected in ((audited["late"], checkpoint), (audited["early"], warm_start)):
        policy = audited["trajectories"][rollout]["policy_id"]
        # `rlvr lineage ROLLOUT_ID`: the rollout's artifact, whose parents hold the policy; its turns are a sibling
        holding = tools_run.manifest(resolve_id(tools_run, rollout))
        assert holding.kind == "rollouts" and policy in holding.parents
        (turns,) = [m for m in tools_run.manifests(kind="turns") if m.step == holding.step and m.run_id == "tools"]
        assert sorted(turns.parents) == sorted(holding.parents) and descendants(tools_run, turns.artifact_id) == []
        assert policy in {m.artifact_id for m in ancestors(tools_run, turns.artifact_id)}
        found = run_docs_query(tools_run, "the checkpoint whose policy made each call", {"rollout": rollout})
        n_calls = sum(1 for c in audited["calls"] if c[1] == rollout)
        assert [(r["policy_id"], r["checkpoint"]) for r in found] == [(policy, expected.artifact_id)] * n_calls
    assert checkpoint.parents == [audited["trajectories"][audited["late"]]["policy_id"]]
    for manifest, step in ((checkpoint, 3), (warm_start, 1)):
        made = run_docs_query(tools_run, "the calls a checkpoint's policy made", {"checkpoint": manifest.artifact_id})
        expected_calls = Counter((c[0], c[4], c[6]) for c in audited["calls"] if c[0] == step)
        assert {(r["step"], r["tool"], r["status"]): r["calls"] for r in made} == expected_calls
