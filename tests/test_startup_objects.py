"""rlvr/startup_objects.py: a process started for one job freezes what its imports made, and still collects what it
makes afterwards. Checked in a fresh interpreter: freezing the test process would keep every later test's garbage."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc
import torch  # what an rlvr process imports first: hundreds of thousands of objects
from rlvr.startup_objects import freeze_startup_objects

frozen = freeze_startup_objects()
assert frozen == gc.get_freeze_count() > 100_000, frozen
assert sum(gc.get_count()) < 1_000  # the collection before the freeze left the young generations empty


class Node:
    pass


a, b = Node(), Node()
a.other, b.other = b, a  # a cycle made after the freeze ...
del a, b
assert gc.collect() >= 2  # ... is collected as before
assert gc.get_freeze_count() == frozen
print("ok")
"""


def test_a_freeze_keeps_the_imports_out_and_later_cycles_in() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr[-2000:]


def test_a_run_command_invoked_inside_a_program_does_not_freeze_it() -> None:
    """Only the `rlvr` process's own main() enables the freeze; typer's CliRunner in a test would otherwise freeze the
    whole pytest worker, whose later tests' cyclic garbage would then never be collected."""
    import gc

    from rlvr.flows.cli import commands

    before = gc.get_freeze_count()
    commands._freeze_the_runs_imports()
    assert not commands._started_as_rlvr
    assert gc.get_freeze_count() == before
