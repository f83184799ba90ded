"""Keep the objects a process made at start-up out of the garbage collector's passes.

torch, transformers and Prefect leave millions of long-lived objects behind their imports, and every full
collection walks all of them again. In a small `rlvr run` (2 steps, tiny model) that was about 3 of its 11-12
CPU-seconds, and up to 10 s of wall time after "run completed" on a busy machine, spent in collections at exit
(measured 2026-12-02, issue 52). `gc.freeze()` after one last collection moves what is alive then into a generation
the collector never visits again. Objects made later are collected as before; objects alive at the freeze that later
become unreachable in a cycle are kept (reference counting still frees the rest), which is why only processes that
were started for one job call this, once their imports are done: an `rlvr run` or `rlvr resume`, a data-parallel
rank, the sampler process, `rlvr schedule`'s serving process and each of its firings. A Python program that runs
`execute` in its own process is left as it is.
"""

from __future__ import annotations

import gc
import importlib

# What a run imports as it starts (torch, transformers and Prefect among it): imported before the freeze, so that
# a process started for a run freezes them at once instead of collecting them again at each later pass.
RUN_MODULES = ("rlvr.flows.data_run", "rlvr.flows.rl_step", "rlvr.flows.step_loop")


def freeze_startup_objects() -> int:
    """Collect once, then freeze what is alive; returns how many objects are now frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def freeze_after_run_imports() -> int:
    """Import what a run imports (`RUN_MODULES`), then `freeze_startup_objects`."""
    for module in RUN_MODULES:
        importlib.import_module(module)
    return freeze_startup_objects()
