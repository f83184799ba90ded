"""A run's process gives freed tensor memory back to the system (trainer/ranks/launch.py `return_freed_memory`,
called by every tracked run: flows/runs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_a_tracked_run_fixes_the_threshold_before_it_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import rlvr.trainer.ranks.launch as launch
    from rlvr.flows import runs
    from rlvr.flows.config import load_config
    from rlvr.storage.store import open_store

    calls: list[str] = []
    monkeypatch.setattr(launch, "return_freed_memory", lambda: calls.append("fixed"))
    root = str(open_store(str(tmp_path / "store"), create=True).root)
    result = runs._tracked(root, load_config(None, ["run_id=memory"]), lambda: {"body": calls.copy()}, new=True)
    assert (calls, result["body"]) == (["fixed"], ["fixed"])
