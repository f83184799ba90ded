"""What a run checks and says before any work: the limits of CLPO's same-step rewrites and of flow.async_level
that a loaded config cannot check alone (one line each), the warning of GHPO's hints without solutions, and the
verdicts a run will ask of a judge or reward model (`planned_model_calls`), announced before it asks."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rlvr.curricula.hints import solutions_of
from rlvr.endpoints import rate_of
from rlvr.errors import UserError
from rlvr.flows.config import RunConfigBase
from rlvr.progress import report
from rlvr.storage.stage import TABLES
from rlvr.storage.store import open_store
from rlvr.verifiers.cache import MODEL_VERIFIERS
from rlvr.verifiers.model_rewards import endpoint_of

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)


def warn_without_solutions(store: str, cfg: RunConfigBase, problems: str) -> None:
    """GHPO's hints come from the problems' solutions: say so when they have none (the run goes on unhinted)."""
    if not cfg.select.hints.enabled:
        return
    table = TABLES.get(open_store(store), problems)
    if not solutions_of(table):
        message = (
            f"select.hints is on but none of the run's {table.num_rows} problems has a solution with a step before "
            "the one that states its answer, so no hint will be given (sources give one through a `solution` "
            "column or a worked reference: docs/data.md)"
        )
        log.warning(message)
        report("warning", message=message)


def planned_model_calls(cfg: RunConfigBase, problems: pa.Table) -> dict[str, dict[str, int]]:
    """For each model that scores some of the run's problems (a judge, a reward model), how many verdicts each part
    of the run asks of it at most: the evaluations (the held-out split, at each), the difficulty pass (k a problem)
    and the steps' labels (the rollouts a step samples, in the model's share of the training problems)."""
    rows = problems.select(["verifier", "split"]).to_pylist()
    evaluations = 1 + (1 if cfg.warmstart.steps else 0) + -(-cfg.train.steps // cfg.evaluate.every)
    planned: dict[str, dict[str, int]] = {}
    for name in sorted(MODEL_VERIFIERS):
        mine = [r["split"] for r in rows if cfg.label.verifier_of(r["verifier"]) == name]
        if not mine:
            continue
        trained = [split for split in mine if split in cfg.select.splits]
        pool = sum(1 for r in rows if r["split"] in cfg.select.splits) or 1
        per_step = cfg.select.batch_size * cfg.allocate.n * len(trained) / pool
        planned[name] = {
            "evaluations": evaluations * mine.count(cfg.evaluate.split),
            "difficulty": cfg.difficulty.k * sum(split in cfg.difficulty.splits for split in mine),
            "steps": round(cfg.train.steps * per_step),
        }
    return planned


def announce_model_calls(store: str, cfg: RunConfigBase, problems: str) -> None:
    """Before a run asks a model for its rewards, say how many verdicts it will ask for (a warning line), and plan the
    endpoint's measured rate for them: its first calls then give the estimate of the whole run's (rlvr/endpoints.py)."""
    if cfg.label.reward == "rlpr":
        return
    for name, parts in planned_model_calls(cfg, TABLES.get(open_store(store), problems)).items():
        if cfg.label.endpoint_version(name) is None:
            continue  # no endpoint: the label stage refuses in one line
        total = sum(parts.values())
        endpoint = endpoint_of(cfg.label, name)
        sample = 2 * cfg.label.judge.concurrency if name == "judge" and cfg.label.judge is not None else 1
        rate_of(endpoint).plan("this run", total, sample)
        split = ", ".join(f"{part} {calls:,}" for part, calls in parts.items())
        message = f"this run will ask {endpoint} for up to {total:,} verdicts ({split}; cached ones are not asked)"
        log.warning(message)
        report("warning", message=message)


def check_clpo(cfg: RunConfigBase) -> None:
    """restructure.join same_step needs prompts left for the drawn groups, as a one-line error before any work."""
    slots = cfg.restructure.rewrite_slots(cfg.select.batch_size)
    if slots and slots >= cfg.select.batch_size:
        raise UserError(
            f"restructure.join=same_step keeps {slots} of select.batch_size={cfg.select.batch_size} prompts for "
            "rewrites, leaving none to draw; raise select.batch_size or lower restructure.share"
        )


def check_async(cfg: RunConfigBase, store: str = "") -> None:
    """flow.async_level's limit that depends on the store, as a one-line error before any work (what it does not
    combine with in the config is refused when the config is loaded: flows/compatibility.py)."""
    if not cfg.flow.async_level:
        return
    if cfg.flow.sampler == "process" and store.startswith("memory://"):
        raise UserError(
            f"flow.sampler=process needs a store another process can open; {store} lives in this process's "
            "memory: use a local path or an object-store URL, or set flow.sampler=thread"
        )
