"""rlvr-pipeline: raw problems to verified rewards and better models.

The package root holds only what every part shares (the error types); the parts themselves live in
the repository's top-level folders and import as `rlvr.flows`, `rlvr.tasks`, `rlvr.storage`,
`rlvr.verifiers`, `rlvr.trainer` and `rlvr.curricula` (see pyproject.toml's package-dir).
"""

__version__ = "0.1.0"

from rlvr import moved as _moved

_moved.install()  # old import paths of moved modules keep working, with a DeprecationWarning (rlvr/moved.py)
