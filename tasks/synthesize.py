"""synthesize: make the problem pool (procedural generator), validate, deduplicate, split.

Every generated row ends up either in `problems` or in `quarantine` with a reason, so
rows in = rows accepted + rows quarantined is a query over the two artifacts.
"""

from __future__ import annotations

import json
import random
from typing import Any, Literal

from prefect import task
from prefect.cache_policies import NONE
from pydantic import BaseModel, ConfigDict, Field

from rlvr.storage.ids import row_id
from rlvr.storage.stage import StageOutput, open_store, rows_to_table
from rlvr.verifiers.arithmetic import GENERATOR_VERSION, ArithmeticSpec, generate
from rlvr.verifiers.registry import get_verifier

CODE_VERSION = "1"


class SynthesizeConfig(BaseModel):
    """Where problems come from and how they are split (test is held out from all training)."""

    model_config = ConfigDict(extra="forbid")

    generator: Literal["arithmetic"] = "arithmetic"
    arithmetic: ArithmeticSpec = Field(default_factory=ArithmeticSpec)
    test_fraction: float = Field(0.2, ge=0.0, lt=1.0)
    warmup_fraction: float = Field(0.3, ge=0.0, lt=1.0)
    max_prompt_chars: int = Field(48, ge=1)
    verifier: str = "arithmetic"


def validate_rows(
    rows: list[dict[str, Any]], verifier_name: str, max_prompt_chars: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split raw rows into accepted and quarantined (each quarantined row carries its reason).

    A row is rejected when its prompt is empty or too long for the policy, when its reference does
    not verify against itself (the verifier could never reward it), or when it repeats an earlier prompt.
    """
    verifier = get_verifier(verifier_name)
    accepted, rejected, seen = [], [], set()
    for row in rows:
        prompt, answer = row.get("prompt"), row.get("answer")
        if not isinstance(prompt, str) or not prompt.strip():
            reason = "empty prompt"
        elif len(prompt) > max_prompt_chars:
            reason = f"prompt longer than {max_prompt_chars} characters"
        elif verifier.score(str(answer), answer).status != "ok":
            reason = f"reference {answer!r} does not verify against itself with {verifier_name}"
        elif prompt in seen:
            reason = "duplicate prompt"
        else:
            seen.add(prompt)
            accepted.append(row)
            continue
        rejected.append({**row, "reason": reason})
    return accepted, rejected


def assign_splits(n: int, test_fraction: float, warmup_fraction: float, seed: int) -> list[str]:
    """A seeded split label for each of n rows: round(n*test) test, round(n*warmup) warmup, rest train."""
    n_test, n_warmup = round(n * test_fraction), round(n * warmup_fraction)
    if n_test + n_warmup > n:
        raise ValueError("test_fraction + warmup_fraction must leave room for the train split")
    labels = ["test"] * n_test + ["warmup"] * n_warmup + ["train"] * (n - n_test - n_warmup)
    random.Random(seed).shuffle(labels)
    return labels


@task(name="synthesize", cache_policy=NONE)
def synthesize(store_root: str, run_id: str, seed: int, cfg: SynthesizeConfig, config_id: str) -> str:
    """Commit the `problems` and `quarantine` artifacts; return the problems id."""
    store = open_store(store_root)
    settings = cfg.model_dump()
    problems_out = StageOutput("problems", "synthesize", CODE_VERSION, run_id, (config_id,), settings)
    quarantine_out = StageOutput("quarantine", "synthesize", CODE_VERSION, run_id, (config_id,), settings)
    if store.exists(problems_out.artifact_id) and store.exists(quarantine_out.artifact_id):
        return problems_out.artifact_id

    spec = cfg.arithmetic
    raw = generate(spec, seed)
    accepted, rejected = validate_rows(raw, cfg.verifier, cfg.max_prompt_chars)
    splits = assign_splits(len(accepted), cfg.test_fraction, cfg.warmup_fraction, seed)
    params = json.dumps(spec.model_dump(), sort_keys=True)
    problems = [
        {
            "problem_id": row_id("p", cfg.generator, GENERATOR_VERSION, row["prompt"]),
            "run_id": run_id,
            "split": split,
            "domain": "arithmetic",
            "category": f"d{spec.digits}t{spec.terms}",
            "prompt": row["prompt"],
            "answer": row["answer"],
            "generator": cfg.generator,
            "generator_version": GENERATOR_VERSION,
            "params": params,
            "seed": seed,
            "source_index": row["source_index"],
            "parent_problem_id": None,
            "derivation": "original",
        }
        for row, split in zip(accepted, splits)
    ]
    quarantine = [
        {
            "run_id": run_id,
            "stage": "synthesize",
            "source_index": row.get("source_index", -1),
            "reason": row["reason"],
            "row_json": json.dumps({k: v for k, v in row.items() if k != "reason"}, default=str),
        }
        for row in rejected
    ]
    common = dict(run_id=run_id, stage="synthesize", parents=[config_id], code_version=CODE_VERSION,
                  config=settings)
    store.write_artifact("quarantine", quarantine_out.artifact_id, rows_to_table("quarantine", quarantine),
                         **common, extra={"rows_in": len(raw)})
    store.write_artifact("problems", problems_out.artifact_id, rows_to_table("problems", problems),
                         **common, extra={"rows_in": len(raw), "quarantined": len(rejected)})
    return problems_out.artifact_id
