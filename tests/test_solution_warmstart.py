"""`warmstart.data=solutions`: the warm start trains on each warmup problem's worked solution (the `solution`
column the arithmetic generator writes), not on the bare answer; problems without one stop it with one line."""

from __future__ import annotations

import json
from typing import Any

import pytest

import rlvr.tasks.warmstart as warmstart
from rlvr.errors import UserError
from rlvr.flows.config import load_config
from rlvr.storage.stage import run_stage
from rlvr.storage.store import Store
from rlvr.storage.views import query
from rlvr.tasks.initialize import INITIALIZE
from rlvr.tasks.synthesize import SYNTHESIZE


def _warm_start(tmp_path, monkeypatch, sources: str, data: str) -> tuple[Store, list[tuple[str, str]]]:
    cfg = load_config(
        None,
        [
            f"synthesize.sources={sources}",
            f"warmstart.data={data}",
            "warmstart.steps=2",
            "warmstart.batch_size=4",
        ],
    )
    seen: list[tuple[str, str]] = []
    real = warmstart.sft_warmstart

    def recording(policy: Any, optimizer: Any, examples: list[tuple[str, str]], **kwargs: Any) -> list[float]:
        seen.extend(examples)
        return real(policy, optimizer, examples, **kwargs)

    monkeypatch.setattr(warmstart, "sft_warmstart", recording)
    store = Store.open(str(tmp_path / "store"), create=True)
    at = {"run_id": "solved", "seed": 0}
    problems = run_stage(store, SYNTHESIZE, cfg.synthesize, **at).ids["problems"]
    initial = run_stage(store, INITIALIZE, cfg.policy, params={"seed": 0}, step=0, **at).id
    run_stage(store, warmstart.WARMSTART, cfg.warmstart, inputs={"problems": problems, "policy": initial}, step=0, **at)
    return store, seen


def test_a_warm_start_on_solutions_trains_on_each_problems_worked_solution(tmp_path, monkeypatch) -> None:
    sources = "[{type: arithmetic, name: sums, style: working, digits: 2, ops: '+', count: 6, warmup_fraction: 1.0, test_fraction: 0}]"
    store, seen = _warm_start(tmp_path, monkeypatch, sources, "solutions")
    problems = query(store, "SELECT prompt, solution FROM problems WHERE split = 'warmup' ORDER BY prompt").to_pylist()
    assert len(problems) == 6 and sorted(seen) == [(p["prompt"], p["solution"]) for p in problems]
    prompt, solution = seen[0]
    total = int(solution.rsplit("The answer is ", 1)[1].rstrip("."))
    assert prompt.endswith("Show your working, then give the final answer as 'Answer: <number>'.")
    left, right = (int(x) for x in prompt.removeprefix("What is ").split("?")[0].split(" + "))
    assert total == left + right and solution.startswith(f"{left} + {right} = ")
    assert query(store, "SELECT count(*) AS n FROM warmstart").to_pylist() == [{"n": 2}]


def test_a_warm_start_on_solutions_of_problems_without_one_stops_with_one_line(tmp_path, monkeypatch) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "\n".join(json.dumps({"prompt": f"What is {i} plus 1?", "answer": str(i + 1)}) for i in range(3)) + "\n"
    )
    sources = f"[{{type: file, name: plain, path: '{rows}', warmup_fraction: 1.0, test_fraction: 0}}]"
    with pytest.raises(UserError, match=r"^warmstart.data=solutions: 3 of the 3 'warmup' problems have no worked "):
        _warm_start(tmp_path, monkeypatch, sources, "solutions")
