"""synthesize: make the problem pool from a source, validate, deduplicate, split.

Every raw row ends up either in `problems` or in `quarantine` with a reason, so
rows in = rows accepted + rows quarantined is a query over the two artifacts.
"""

from __future__ import annotations

import json
import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlvr.storage.ids import row_id
from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.verifiers.registry import get_verifier
from rlvr.verifiers.sources import SOURCES, SkillsSourceConfig, SourceConfig


def _source_type() -> Any:
    return SOURCES.config_type()


class SynthesizeConfig(BaseModel):
    """Where problems come from and how they are split (test is held out from all training)."""

    model_config = ConfigDict(extra="forbid")

    source: SourceConfig = Field(default_factory=SkillsSourceConfig)
    test_fraction: float = Field(0.2, ge=0.0, lt=1.0)
    warmup_fraction: float = Field(0.2, ge=0.0, lt=1.0)
    max_prompt_chars: int = Field(48, ge=1)
    verifier: str = Field("arithmetic", description="the verifier a reference must satisfy to be accepted")


def synthesize_config_type() -> type[SynthesizeConfig]:
    """SynthesizeConfig with `source` as the union of the registered sources (keyed by `type`)."""
    from pydantic import create_model

    return create_model(
        "SynthesizeConfig",
        __base__=SynthesizeConfig,
        source=(_source_type(), Field(default_factory=SkillsSourceConfig)),
    )


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


def build(inputs: Inputs, cfg: SynthesizeConfig, ctx: StageContext) -> dict[str, Built]:
    source = SOURCES.make(cfg.source)
    raw = list(source.rows(ctx.seed))
    accepted, rejected = validate_rows(raw, cfg.verifier, cfg.max_prompt_chars)
    splits = assign_splits(len(accepted), cfg.test_fraction, cfg.warmup_fraction, ctx.seed)
    problems = [
        {
            "problem_id": row_id("p", source.type, source.generator_version, row["prompt"]),
            "run_id": ctx.run_id,
            "split": split,
            "domain": row.get("domain", ""),
            "category": row.get("category", ""),
            "prompt": row["prompt"],
            "answer": row["answer"],
            "generator": source.type,
            "generator_version": source.generator_version,
            "params": row.get("params", ""),
            "seed": ctx.seed,
            "source_index": row["source_index"],
            "parent_problem_id": None,
            "derivation": "original",
        }
        for row, split in zip(accepted, splits)
    ]
    quarantine = [
        {
            "run_id": ctx.run_id,
            "stage": "synthesize",
            "source_index": row.get("source_index", -1),
            "reason": row["reason"],
            "row_json": json.dumps({k: v for k, v in row.items() if k != "reason"}, default=str),
        }
        for row in rejected
    ]
    return {
        "quarantine": Built(rows_to_table("quarantine", quarantine), extra={"rows_in": len(raw)}),
        "problems": Built(
            rows_to_table("problems", problems), extra={"rows_in": len(raw), "quarantined": len(rejected)}
        ),
    }


SYNTHESIZE: Stage[SynthesizeConfig] = Stage(
    name="synthesize",
    code_version="2",
    section="synthesize",
    config=synthesize_config_type,
    inputs=("config",),
    outputs={"quarantine": Output("quarantine"), "problems": Output("problems")},
    build=build,
)
