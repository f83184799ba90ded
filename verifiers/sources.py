"""Problem sources: where a run's raw problems come from, chosen by `synthesize.source.type`.

A source turns its config and a seed into problem rows. Procedural generators live beside the
verifier that checks their answers (verifiers/arithmetic.py), as reasoning-gym pairs each task's
generator with its scorer; this module holds the interface, the registry and the adapters.

A row is a dict with at least `prompt`, `answer` and `source_index` (its position in the source),
plus `category` (the arm a curriculum samples through), `domain` and `params` (the JSON of what made
it). The synthesize stage validates, deduplicates and splits the rows; bad rows are quarantined.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from rlvr.plugins import TypedRegistry
from rlvr.verifiers.arithmetic import GENERATOR_VERSION, ArithmeticSpec, generate


class SourceConfig(BaseModel):
    """Fields every source shares; each source's config subclasses it and adds `type`."""

    model_config = ConfigDict(extra="forbid")


class ProblemSource(ABC):
    """Yields raw problem rows for a seed (the same rows for the same config and seed)."""

    type: ClassVar[str]
    generator_version: ClassVar[str] = "1"

    def __init__(self, cfg: SourceConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    def rows(self, seed: int) -> Iterable[dict[str, Any]]:
        """The raw rows, in a deterministic order."""


class ArithmeticSourceConfig(SourceConfig, ArithmeticSpec):
    """The built-in arithmetic generator: `digits`-digit operands, `terms` terms, operators from `ops`."""

    type: Literal["arithmetic"] = "arithmetic"


class ArithmeticSource(ProblemSource):
    """Seeded, distinct `a+b=` style problems; one category per (digits, terms)."""

    type = "arithmetic"
    generator_version = GENERATOR_VERSION

    def rows(self, seed: int) -> Iterable[dict[str, Any]]:
        assert isinstance(self.cfg, ArithmeticSourceConfig)
        spec = ArithmeticSpec(**self.cfg.model_dump(exclude={"type"}))
        params = json.dumps(spec.model_dump(), sort_keys=True)
        category = f"d{spec.digits}t{spec.terms}"
        for row in generate(spec, seed):
            yield {**row, "category": category, "domain": "arithmetic", "params": params}


SOURCES: TypedRegistry[ProblemSource] = TypedRegistry(
    "problem source", SourceConfig, ProblemSource, group="rlvr.sources"
)
SOURCES.register(ArithmeticSourceConfig, ArithmeticSource)
