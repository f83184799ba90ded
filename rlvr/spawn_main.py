"""Child processes started without re-importing the parent's main module.

multiprocessing tells every forkserver or spawn child to import the parent's `__main__` before it runs
anything. A script that calls the Python API without an `if __name__ == "__main__":` guard would then run
again in each child (tests/test_api_no_main_guard.py). Children started inside `without_main()` (this thread
only) are told not to: the verifier pool's workers, unless a verifier lives in `__main__`, and the sampler
process of flow.sampler=process, whose work is all in the package.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import spawn
from typing import Any

_launching = threading.local()
_stdlib_preparation_data = spawn.get_preparation_data


def _preparation_data(name: str) -> dict[str, Any]:
    data = _stdlib_preparation_data(name)
    if getattr(_launching, "without_main", False):
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
    return data


if getattr(spawn.get_preparation_data, "__module__", None) != __name__:  # once, even if this module is reloaded
    spawn.get_preparation_data = _preparation_data


@contextmanager
def without_main(enabled: bool = True) -> Iterator[None]:
    """Processes started in the block (from this thread) do not import `__main__`; `enabled` False: they do."""
    _launching.without_main = enabled
    try:
        yield
    finally:
        _launching.without_main = False
