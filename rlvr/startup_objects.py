"""Keep the objects a process made at start-up out of the garbage collector's passes.

torch, transformers and Prefect leave millions of long-lived objects behind their imports, and every full
collection walks all of them again. In a small `rlvr run` (2 steps, tiny model) that was about 3 of its 11-12
CPU-seconds, and up to 10 s of wall time after "run completed" on a busy machine, spent in collections at exit
(measured 2026-12-02, issue 52). `gc.freeze()` after one last collection moves what is alive then into a generation
the collector never visits again. Objects made later are collected as before; objects alive at the freeze that later
become unreachable in a cycle are kept (reference counting still frees the rest), which is why only processes that
were started for one job call this, once their imports are done: an `rlvr run` or `rlvr resume`, a data-parallel
rank, the sampler process. A Python program that runs `execute` in its own process is left as it is.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect once, then freeze what is alive; returns how many objects are now frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
