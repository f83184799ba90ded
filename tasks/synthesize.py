"""synthesize: the problem pool from the configured sources: read, validate, deduplicate, decontaminate, split.

Every raw row ends up in exactly one of `problems`, `quarantine` (with its check and reason) or
`duplicates` (merged into the problem it repeats), so for each source

    rows read = accepted + quarantined + duplicates

is a query over the three artifacts, and the stage checks it before committing (`counts` in the
problems manifest holds the per-source figures the summary prints).
"""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlvr.data.decontaminate import Decontaminator
from rlvr.data.dedup import NearDuplicateConfig, find_duplicates
from rlvr.data.sources import SOURCES, SkillsSourceConfig, SourceConfig, make_sources, source_names
from rlvr.data.validate import Candidate, Rejected, as_text, validate
from rlvr.progress import report
from rlvr.storage.ids import row_id
from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table


def _source_type() -> Any:
    return SOURCES.config_type()


def default_source() -> SourceConfig:
    return SkillsSourceConfig()


class DecontaminateConfig(BaseModel):
    """Eval sets (sources: files or datasets) that training problems must not overlap, by word n-grams."""

    model_config = ConfigDict(extra="forbid")

    eval_sets: list[SourceConfig] = Field(default_factory=list)
    n: int = Field(13, ge=1, description="n-gram length in words (shorter prompts must match an eval text whole)")


class SynthesizeConfig(BaseModel):
    """Where problems come from and how they are split (test is held out from all training).

    `sources` is a weighted list; with `size` set, each source gives its share
    (size x weight / total weight) of raw rows, else all its rows. `source` is shorthand for one source.
    """

    model_config = ConfigDict(extra="forbid")

    sources: list[SourceConfig] = Field(default_factory=lambda: [default_source()], min_length=1)
    size: int | None = Field(None, ge=1, description="raw rows over all sources (None: every row of each)")
    test_fraction: float = Field(0.2, ge=0.0, lt=1.0)
    warmup_fraction: float = Field(0.2, ge=0.0, lt=1.0)
    max_prompt_chars: int = Field(8192, ge=1)
    near_duplicates: NearDuplicateConfig = Field(default_factory=NearDuplicateConfig)
    decontaminate: DecontaminateConfig = Field(default_factory=DecontaminateConfig)

    @model_validator(mode="before")
    @classmethod
    def _one_source(cls, data: Any) -> Any:
        if isinstance(data, dict) and "source" in data:
            if "sources" in data:
                raise ValueError("give either synthesize.source (one) or synthesize.sources (a list), not both")
            data = {**data, "sources": [data["source"]]}
            del data["source"]
        return data


def synthesize_config_type() -> type[SynthesizeConfig]:
    """SynthesizeConfig with each source as the union of the registered sources (keyed by `type`)."""
    from pydantic import create_model

    sources: Any = list[_source_type()]  # type: ignore[misc]
    decontaminate = create_model(
        "DecontaminateConfig", __base__=DecontaminateConfig, eval_sets=(sources, Field(default_factory=list))
    )
    return create_model(
        "SynthesizeConfig",
        __base__=SynthesizeConfig,
        sources=(sources, Field(default_factory=lambda: [default_source()], min_length=1)),
        decontaminate=(decontaminate, Field(default_factory=decontaminate)),
    )


def allotments(weights: list[float], size: int | None) -> list[int | None]:
    """Raw rows each source gives: None (all) without a size, else size x weight shares by largest remainder."""
    if size is None:
        return [None] * len(weights)
    total = sum(weights)
    exact = [size * w / total for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: counts[i] - exact[i])[: size - sum(counts)]:
        counts[i] += 1
    return list(counts)


def assign_splits(n: int, test_fraction: float, warmup_fraction: float, seed: int) -> list[str]:
    """A seeded split label for each of n rows: round(n*test) test, round(n*warmup) warmup, rest train."""
    n_test, n_warmup = round(n * test_fraction), round(n * warmup_fraction)
    if n_test + n_warmup > n:
        raise ValueError(f"test_fraction {test_fraction} + warmup_fraction {warmup_fraction} add up to more than 1")
    labels = ["test"] * n_test + ["warmup"] * n_warmup + ["train"] * (n - n_test - n_warmup)
    random.Random(seed).shuffle(labels)
    return labels


@dataclass
class Pool:
    """What the stage has decided so far: accepted candidates, rejected rows, merged duplicates."""

    accepted: list[Candidate] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    duplicates: list[dict[str, Any]] = field(default_factory=list)
    read: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class SourceJob:
    """One source's share of the stage: a unit of the run's fan-out (flows/executors.py)."""

    name: str
    config: SourceConfig
    limit: int | None
    seed: int
    max_prompt_chars: int


@dataclass(frozen=True)
class SourceRead:
    name: str
    accepted: list[Candidate]
    rejected: list[Rejected]
    count: int


def read_source(job: SourceJob) -> SourceRead:
    """A source's rows (its allotment), validated."""
    report("data", phase="read", source=job.name)
    source = SOURCES.make(job.config)
    rows = itertools.islice(source.rows(job.seed), job.limit)
    accepted, rejected, count = validate(rows, job.name, source.verifier, job.max_prompt_chars)
    return SourceRead(job.name, accepted, rejected, count)


def read_sources(cfg: SynthesizeConfig, seed: int, fan_out: Callable[..., Iterator[SourceRead]] = map) -> Pool:
    """Every source's rows (its allotment), validated; one unit of `fan_out` per source, pooled in config order."""
    limits = allotments([s.weight for s in cfg.sources], cfg.size)
    jobs = [
        SourceJob(name, source, limit, seed, cfg.max_prompt_chars)
        for name, source, limit in zip(source_names(cfg.sources), cfg.sources, limits)
    ]
    pool = Pool()
    for read in fan_out(read_source, jobs):
        pool.accepted += read.accepted
        pool.rejected += read.rejected
        pool.read[read.name] = read.count
    return pool


def problem_id(candidate: Candidate) -> str:
    """Content hash: the same problem (prompt, reference, verifier) has the same id in every run."""
    return row_id("p", candidate.verifier, candidate.prompt, candidate.reference)


def deduplicate(pool: Pool, near: NearDuplicateConfig, run_id: str) -> None:
    """Drop exact and near duplicates (each recorded against the problem it repeats)."""
    report("data", phase="deduplicate", rows=len(pool.accepted))
    found = find_duplicates([c.prompt for c in pool.accepted], [c.reference for c in pool.accepted], near)
    dropped = set()
    for dup in found:
        candidate, kept = pool.accepted[dup.index], pool.accepted[dup.duplicate_of]
        dropped.add(dup.index)
        pool.duplicates.append(
            {
                "run_id": run_id,
                "problem_id": problem_id(candidate),
                "duplicate_of": problem_id(kept),
                "similarity": dup.similarity,
                "kind": dup.kind,
                "source": candidate.source,
                "source_index": candidate.source_index,
            }
        )
    pool.accepted = [c for i, c in enumerate(pool.accepted) if i not in dropped]


def eval_texts(cfg: DecontaminateConfig, seed: int) -> list[tuple[str, str]]:
    """(eval set name, prompt text) of every readable row of the eval sets."""
    texts = []
    for name, source in make_sources(cfg.eval_sets).items():
        for row in source.rows(seed):
            if row.get("error") is None and row.get("prompt") is not None:
                texts.append((name, as_text(row["prompt"])))
    return texts


def decontaminate(pool: Pool, cfg: DecontaminateConfig, seed: int) -> None:
    """Quarantine accepted rows that share an n-gram with an eval set (failed_check "contaminated")."""
    if not cfg.eval_sets:
        return
    report("data", phase="decontaminate", rows=len(pool.accepted))
    texts = eval_texts(cfg, seed)
    matcher = Decontaminator([text for _, text in texts], n=cfg.n)
    clean = []
    for candidate in pool.accepted:
        hit = matcher.match(candidate.prompt)
        if hit is None:
            clean.append(candidate)
            continue
        where = texts[hit.eval_index][0]
        reason = f"contaminated: shares {hit.ngram!r} with eval set {where!r} (row {hit.eval_index})"
        pool.rejected.append(
            Rejected(candidate.source, candidate.source_index, "contaminated", reason, json.dumps(asdict(candidate)))
        )
    pool.accepted = clean


def problem_rows(pool: Pool, cfg: SynthesizeConfig, ctx: StageContext) -> list[dict[str, Any]]:
    """The accepted rows as `problems` rows; splits are drawn per source, so each source is represented."""
    rows = []
    for name, source in make_sources(cfg.sources).items():
        mine = [c for c in pool.accepted if c.source == name]
        own = source.cfg
        test = cfg.test_fraction if own.test_fraction is None else own.test_fraction
        warmup = cfg.warmup_fraction if own.warmup_fraction is None else own.warmup_fraction
        splits = assign_splits(len(mine), test, warmup, ctx.seed)
        rows += [
            {
                "problem_id": problem_id(c),
                "run_id": ctx.run_id,
                "split": split,
                "domain": c.domain,
                "category": c.category,
                "prompt": c.prompt,
                "reference": c.reference,
                "answer": c.answer,
                "verifier": c.verifier,
                "source": name,
                "generator": source.type,
                "generator_version": source.generator_version,
                "params": c.params,
                "seed": ctx.seed,
                "source_index": c.source_index,
                "parent_problem_id": None,
                "derivation": "original",
                "difficulty_label": c.difficulty_label,
                "solution": c.solution,
            }
            for c, split in zip(mine, splits)
        ]
    return rows


def source_counts(pool: Pool) -> dict[str, dict[str, Any]]:
    """Per source: read, accepted, quarantined (by check), duplicates, contaminated; checks the invariant."""
    counts: dict[str, dict[str, Any]] = {}
    for name, read in pool.read.items():
        rejected = Counter(r.check for r in pool.rejected if r.source == name)
        entry = {
            "read": read,
            "accepted": sum(c.source == name for c in pool.accepted),
            "quarantined": sum(rejected.values()),
            "by_check": dict(sorted(rejected.items())),
            "duplicates": sum(d["source"] == name for d in pool.duplicates),
            "contaminated": rejected.get("contaminated", 0),
        }
        if entry["accepted"] + entry["quarantined"] + entry["duplicates"] != read:
            raise AssertionError(f"source {name!r}: rows read != accepted + quarantined + duplicates: {entry}")
        counts[name] = entry
    return counts


def build(inputs: Inputs, cfg: SynthesizeConfig, ctx: StageContext) -> dict[str, Built]:
    """params: `fan_out` (where the sources are read; in place without one)."""
    pool = read_sources(cfg, ctx.seed, ctx.params.get("fan_out", map))
    deduplicate(pool, cfg.near_duplicates, ctx.run_id)
    decontaminate(pool, cfg.decontaminate, ctx.seed)
    problems = problem_rows(pool, cfg, ctx)
    counts = source_counts(pool)
    quarantine = [
        {
            "run_id": ctx.run_id,
            "stage": "synthesize",
            "source": r.source,
            "source_index": r.source_index,
            "failed_check": r.check,
            "reason": r.reason,
            "row_json": r.row_json,
        }
        for r in pool.rejected
    ]
    rows_in = sum(pool.read.values())
    return {
        "quarantine": Built(rows_to_table("quarantine", quarantine), extra={"rows_in": rows_in}),
        "duplicates": Built(rows_to_table("duplicates", pool.duplicates)),
        "problems": Built(
            rows_to_table("problems", problems),
            extra={"rows_in": rows_in, "quarantined": len(quarantine), "counts": counts},
        ),
    }


SYNTHESIZE: Stage[SynthesizeConfig] = Stage(
    name="synthesize",
    code_version="3",
    section="synthesize",
    config=synthesize_config_type,
    inputs=("config",),
    outputs={"quarantine": Output("quarantine"), "duplicates": Output("duplicates"), "problems": Output("problems")},
    build=build,
)
