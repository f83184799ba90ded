"""Problem sources: where a run's raw problems come from, a weighted list under `synthesize.sources`.

A source turns its config and a seed into raw rows. Procedural generators live beside the verifier that
checks their answers (verifiers/arithmetic.py, verifiers/skills.py; reasoning-gym pairs each generator
with its scorer); users' files and Hugging Face datasets are read by rlvr.data.readers, their columns mapped
by rlvr.data.column_mapping. This module holds the interface, the registry and the built-in sources.

A raw row is a dict with `source_index` (its position in the source) and either `error` (a record that
could not be read or mapped, quarantined with that reason; `error_check` names the check, default
"read") or `prompt` and `reference` (or `answer`), plus optional `answer` (the plain answer text: a warm
start's target), `verifier`, `domain`, `category` (the arm a curriculum samples through), `params` (JSON
of what made it), `difficulty_label` and `solution` (worked steps: GHPO's hints).
The synthesize stage validates, deduplicates, decontaminates and splits the rows.
"""

from __future__ import annotations

import hashlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlvr.curricula.clpo import Rewrite, Rewriter, RewriteRequest
from rlvr.data.column_mapping import ColumnMapping
from rlvr.data.readers import RawRecord
from rlvr.plugins import TypedRegistry
from rlvr.verifiers import skills
from rlvr.verifiers.arithmetic import GENERATOR_VERSION, ArithmeticSpec, generate, worked_solution

__all__ = [
    "SOURCES",
    "ArithmeticSource",
    "ArithmeticSourceConfig",
    "DatasetSource",
    "DatasetSourceConfig",
    "FileSource",
    "FileSourceConfig",
    "ProblemSource",
    "ProceduralRewriter",
    "ReasoningGymSource",
    "ReasoningGymSourceConfig",
    "SkillsSource",
    "SkillsSourceConfig",
    "SourceConfig",
    "expression_of",
    "make_sources",
    "question_of",
    "source_names",
]


class SourceConfig(BaseModel):
    """Fields every source shares; each source's config subclasses it and adds `type`."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, description="how problems and reports name the source (default: its type)")
    weight: float = Field(1.0, gt=0, description="its share of `synthesize.size` (ignored when size is unset)")
    verifier: str | None = Field(None, description="the verifier of its problems (default: the source's own)")
    test_fraction: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        exclude_if=lambda value: value is None,  # left out of dumps (so of ids) when unset
        description="its share held out as test (default: synthesize.test_fraction)",
    )
    warmup_fraction: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        exclude_if=lambda value: value is None,
        description="its share kept for the warm start (default: synthesize.warmup_fraction)",
    )


SHARED_FIELDS = frozenset({"type", *SourceConfig.model_fields})


def spec_of(cfg: SourceConfig) -> dict[str, Any]:
    """The source-specific fields of a config (without type, name, weight, verifier)."""
    return cfg.model_dump(exclude=set(SHARED_FIELDS))


class ProblemSource(ABC):
    """Yields raw problem rows for a seed (the same rows for the same config and seed)."""

    type: ClassVar[str]
    generator_version: ClassVar[str] = "1"
    default_verifier: ClassVar[str] = "math"

    def __init__(self, cfg: SourceConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    def rows(self, seed: int) -> Iterable[dict[str, Any]]:
        """The raw rows, in a deterministic order."""

    def rewrite(self, prompt: str, answer: str, mode: str) -> tuple[str, str] | None:
        """A procedural rewrite of one of this source's problems (CLPO's rewriter for generator-backed
        domains): mode "simplify" (easier, e.g. a lower difficulty knob) or "diversify" (a new surface at
        the same difficulty), as (prompt, answer); None when the source has no such rewrite."""
        return None

    @property
    def verifier(self) -> str:
        """The verifier of rows that name none."""
        return self.cfg.verifier or self.default_verifier


class ArithmeticSourceConfig(SourceConfig, ArithmeticSpec):
    """The built-in arithmetic generator: `digits`-digit operands, `terms` terms, operators from `ops`.

    `style`: "expression" prompts are the bare expression ("34+6="), for a model that continues text and
    writes only the number (the arithmetic verifier); "question" prompts ask it in words ("What is 34 + 6?
    Answer with just the number."), for a chat model that answers in a sentence, checked by `final_number`
    (the answer's last number; `math` would accept an answer that only repeats the question, since it
    evaluates the expression); "working" asks for the working before the answer ("What is 34 + 6? Show your
    working, then give the final answer as 'Answer: <number>'."), also checked by `final_number`: the setting of
    RLPR, whose reward reads the reasoning before the answer (docs/rewards.md#rlpr).
    """

    type: Literal["arithmetic"] = "arithmetic"
    style: Literal["expression", "question", "working"] = "expression"


class ArithmeticSource(ProblemSource):
    """Seeded, distinct `a+b=` style problems; one category per (digits, terms).

    Rewrites keep the value: simplify computes one operation ahead (one term fewer: "2+3+4=" -> "5+4=",
    products first), diversify swaps the operands of the first commutative operation ("2+3*4=" ->
    "2+4*3=", or the first two of a sum).
    """

    type = "arithmetic"
    generator_version = GENERATOR_VERSION
    default_verifier = "arithmetic"

    @property
    def verifier(self) -> str:
        question = isinstance(self.cfg, ArithmeticSourceConfig) and self.cfg.style in QUESTION_SUFFIXES
        return self.cfg.verifier or ("final_number" if question else self.default_verifier)

    def rewrite(self, prompt: str, answer: str, mode: str) -> tuple[str, str] | None:
        asked = prompt.startswith(QUESTION_PREFIX)
        parsed = parse_expression(expression_of(prompt) if asked else prompt)
        if parsed is None:
            return None
        operands, operators = parsed
        if mode == "simplify":
            changed = _fold_first_operation(operands, operators)
        elif mode == "diversify":
            changed = _swap_first_commutative(operands, operators)
        else:
            raise ValueError(f"unknown rewrite mode {mode!r}; expected simplify or diversify")
        if changed is None:
            return None
        rewritten = render_expression(*changed)
        if asked:
            rewritten = question_of(rewritten, style_of(prompt))
        return (rewritten, answer) if rewritten != prompt else None

    def rows(self, seed: int) -> Iterable[dict[str, Any]]:
        knobs = spec_of(self.cfg)
        style = knobs.pop("style", "expression")
        spec = ArithmeticSpec(**knobs)
        asked = style in QUESTION_SUFFIXES
        params = json.dumps(spec.model_dump() | ({"style": style} if asked else {}), sort_keys=True)
        widths = "x".join(map(str, spec.operand_digits)) if spec.operand_digits else str(spec.digits)
        category = f"d{widths}t{spec.terms}" + (spec.ops if asked else "") + ("w" if style == "working" else "")
        for row in generate(spec, seed):
            if asked:
                row = {**row, "prompt": question_of(row["prompt"], style)}
            yield {**row, "category": category, "domain": "arithmetic", "params": params}


class SkillsSourceConfig(SourceConfig, skills.SkillsSpec):
    """The skills generator: `categories`, `per_category` problems of each, operands of `digits` digits."""

    type: Literal["skills"] = "skills"


class SkillsSource(ProblemSource):
    """Seeded skills problems (verifiers/skills.py), one category per rule; checked by `arithmetic`.
    Rewrites keep the rule: simplify drops the operand's tens digit, diversify reverses its digits."""

    type = "skills"
    generator_version = skills.GENERATOR_VERSION
    default_verifier = "arithmetic"

    def rows(self, seed: int) -> Iterable[dict[str, Any]]:
        for row in skills.generate(skills.SkillsSpec(**spec_of(self.cfg)), seed):
            parsed = parse_expression(row["prompt"])
            yield {**row, "solution": worked_solution(*parsed) if parsed else None}

    def rewrite(self, prompt: str, answer: str, mode: str) -> tuple[str, str] | None:
        return skills.rewrite(prompt, mode)


class ReasoningGymSourceConfig(SourceConfig):
    """reasoning-gym generators: each dataset a category, its config (difficulty knobs) as given.

    `datasets` maps dataset names to their config keyword arguments, e.g. `{gcd: {max_value: 100}}`
    (a list of names takes each dataset's defaults); `count` problems are drawn from each.
    """

    type: Literal["reasoning_gym"] = "reasoning_gym"
    datasets: dict[str, dict[str, Any]] = Field(default_factory=lambda: {"basic_arithmetic": dict[str, Any]()})
    count: int = Field(100, ge=1, description="problems per dataset")

    @field_validator("datasets", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        if isinstance(value, list):
            value = {name: {} for name in value}
        if isinstance(value, Mapping):
            from rlvr.verifiers.reasoning_gym import dataset_names

            known = dataset_names()
            unknown = [name for name in value if name not in known]
            if unknown:
                raise ValueError(f"unknown reasoning-gym datasets {unknown}; see `rlvr.verifiers.reasoning_gym`")
            value = {name: dict(knobs or {}) for name, knobs in value.items()}
        return value


class ReasoningGymSource(ProblemSource):
    """`count` problems of each configured reasoning-gym dataset, scored by that dataset's own scorer.

    Each dataset draws from its own seed (derived from the run's seed and its name), so adding a dataset
    leaves the others' problems alone. The reference is `{"dataset", "entry"}` as the verifier reads it.
    """

    type = "reasoning_gym"
    default_verifier = "reasoning_gym"

    def rows(self, seed: int) -> Iterable[dict[str, Any]]:
        import reasoning_gym

        assert isinstance(self.cfg, ReasoningGymSourceConfig)
        index = 0
        for name, knobs in self.cfg.datasets.items():
            params = json.dumps({"dataset": name, **knobs}, sort_keys=True, default=str)
            dataset_seed = int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:4], "big")
            generator = reasoning_gym.create_dataset(name, size=self.cfg.count, seed=dataset_seed, **knobs)
            for position in range(self.cfg.count):
                entry = json.loads(json.dumps(generator[position], default=str))
                yield {
                    "source_index": index,
                    "prompt": entry["question"],
                    "reference": {"dataset": name, "entry": entry},
                    "answer": str(entry.get("answer", "")),
                    "category": name,
                    "domain": "reasoning_gym",
                    "params": params,
                    "difficulty_label": _difficulty_label(entry),
                }
                index += 1


def _difficulty_label(entry: Mapping[str, Any]) -> str | None:
    """reasoning-gym's own difficulty metadata of an entry, as JSON (None when it has none)."""
    metadata = entry.get("metadata")
    difficulty = metadata.get("difficulty") if isinstance(metadata, Mapping) else None
    return json.dumps(difficulty, sort_keys=True) if difficulty else None


class ReaderSourceConfig(SourceConfig):
    """What file and dataset sources share: which columns hold what, and how the answer is extracted."""

    columns: ColumnMapping = Field(default_factory=lambda: ColumnMapping())
    extract: Literal["none", "gsm8k", "boxed"] = Field("none", description="answer extraction from the reference")
    domain: str = Field("", description="the domain of rows without a domain column")
    category: str = Field("", description="the category of rows without a category column (default: the name)")


class FileSourceConfig(ReaderSourceConfig):
    """A local JSONL, JSON, CSV or Parquet file (format from the suffix unless given)."""

    type: Literal["file"] = "file"
    path: str
    format: Literal["jsonl", "json", "csv", "parquet"] | None = None


class DatasetSourceConfig(ReaderSourceConfig):
    """A Hugging Face dataset: a `save_to_disk` folder, local data files, or a hub id (needs a network)."""

    type: Literal["dataset"] = "dataset"
    path: str
    subset: str | None = Field(None, description="the dataset's configuration name (e.g. GSM8K's 'main')")
    split: str = "train"
    data_files: list[str] | None = None


class ReaderSource(ProblemSource):
    """Rows of a user's file or dataset, mapped by `columns`; a record that cannot be read or mapped is
    an `error` row (quarantined with its reason), never a stop."""

    @abstractmethod
    def records(self) -> Iterable[RawRecord]:
        """The source's records in order, each parsed or carrying why it could not be."""

    def rows(self, seed: int) -> Iterable[dict[str, Any]]:
        from rlvr.data.column_mapping import map_record

        assert isinstance(self.cfg, ReaderSourceConfig)
        for record in self.records():
            if record.values is None:
                yield {"source_index": record.index, "error": record.error, "raw": record.raw}
                continue
            mapped = map_record(record.values, self.cfg.columns, self.cfg.extract)
            if isinstance(mapped, str):
                yield {"source_index": record.index, "error": mapped, "error_check": "fields", "raw": record.raw}
                continue
            if self.cfg.extract != "none" and "answer" not in mapped:
                mapped["answer"] = mapped["reference"]
            yield {
                "domain": self.cfg.domain,
                "category": self.cfg.category or self.cfg.name or "",
                **mapped,
                "source_index": record.index,
                "params": json.dumps(spec_of(self.cfg), sort_keys=True, default=str),
            }


class FileSource(ReaderSource):
    type = "file"

    def records(self) -> Iterable[RawRecord]:
        from rlvr.data.readers import read_records

        assert isinstance(self.cfg, FileSourceConfig)
        return read_records(Path(self.cfg.path), self.cfg.format)


class DatasetSource(ReaderSource):
    type = "dataset"

    def records(self) -> Iterable[RawRecord]:
        from rlvr.data.readers import read_dataset

        assert isinstance(self.cfg, DatasetSourceConfig)
        return read_dataset(self.cfg.path, name=self.cfg.subset, split=self.cfg.split, data_files=self.cfg.data_files)


class ProceduralRewriter(Rewriter):
    """CLPO's rewriter for generator-backed domains: the `rewrite` of the source each problem came from
    (`source_of` maps problem ids to source names; a problem of an unknown source gets no rewrite)."""

    name = "procedural"

    def __init__(self, sources: Mapping[str, ProblemSource], source_of: Mapping[str, str]) -> None:
        self.sources = sources
        self.source_of = source_of

    def rewrite(self, requests: Sequence[RewriteRequest]) -> list[Rewrite | None]:
        results: list[Rewrite | None] = []
        for request in requests:
            source = self.sources.get(self.source_of.get(request.problem_id, ""))
            made = source.rewrite(request.prompt, request.answer, request.mode) if source else None
            results.append(Rewrite(*made) if made is not None else None)
        return results


def source_names(configs: Sequence[SourceConfig]) -> list[str]:
    """Each source's name: its `name`, else its type, numbered when a type repeats (file, file-2)."""
    names: list[str] = []
    for cfg in configs:
        base = cfg.name or str(getattr(cfg, "type", "source"))
        name, n = base, 2
        while name in names:
            name, n = f"{base}-{n}", n + 1
        names.append(name)
    return names


def make_sources(configs: Sequence[SourceConfig]) -> dict[str, ProblemSource]:
    """The configured sources by name, in config order."""
    return {name: SOURCES.make(cfg) for name, cfg in zip(source_names(configs), configs)}


_TOKEN = re.compile(r"^(-?\d+)((?:[+\-*]\d+)*)=$")


def parse_expression(prompt: str) -> tuple[list[int], list[str]] | None:
    """`"12+3*4="` -> ([12, 3, 4], ["+", "*"]) (a leading minus sign belongs to the first operand)."""
    match = _TOKEN.match(prompt.replace(" ", ""))
    if match is None:
        return None
    rest = re.findall(r"([+\-*])(\d+)", match.group(2))
    return [int(match.group(1))] + [int(value) for _, value in rest], [op for op, _ in rest]


QUESTION_PREFIX = "What is "
# Asked without it, SmolLM2-135M-Instruct explains and rarely reaches the number in 32 tokens (greedy: two-digit
# sums 0.03, one-digit products 0.10); with it, 0.17 and 0.47 (30 problems each, 2026-11-24).
QUESTION_SUFFIX = "? Answer with just the number."
# RLPR's reward reads the reasoning before the answer; asked for "just the number" the model writes none.
WORKING_SUFFIX = "? Show your working, then give the final answer as 'Answer: <number>'."
QUESTION_SUFFIXES = {"question": QUESTION_SUFFIX, "working": WORKING_SUFFIX}
_SPOKEN = {"+": " + ", "-": " - ", "*": " times "}


def question_of(expression: str, style: str = "question") -> str:
    """`"34+6*2="` -> `"What is 34 + 6 times 2? Answer with just the number."` (a leading minus stays on its
    number); `style` "working" asks for the working instead (`WORKING_SUFFIX`)."""
    body = expression.removesuffix("=")
    spoken = body[0] + re.sub(r"[+\-*]", lambda op: _SPOKEN[op.group(0)], body[1:])
    return f"{QUESTION_PREFIX}{spoken}{QUESTION_SUFFIXES[style]}"


def style_of(question: str) -> str:
    """The style whose suffix ends `question` ("question" for none)."""
    return next((style for style, suffix in QUESTION_SUFFIXES.items() if question.endswith(suffix)), "question")


def expression_of(question: str) -> str:
    """Inverse of `question_of`, of either style."""
    body = question.removeprefix(QUESTION_PREFIX).removesuffix(QUESTION_SUFFIXES[style_of(question)])
    return body.replace(" times ", "*").replace(" ", "") + "="


def render_expression(operands: list[int], operators: list[str]) -> str:
    text = str(operands[0])
    for op, value in zip(operators, operands[1:]):
        text += f"{op}{value}"
    return f"{text}="


def _fold_first_operation(operands: list[int], operators: list[str]) -> tuple[list[int], list[str]] | None:
    """One term fewer, same value: the first product if there is one, else the first two operands
    (nothing for a single operation: folding it would print the answer)."""
    if len(operators) < 2:
        return None
    i = operators.index("*") if "*" in operators else 0
    if operators[i] == "*":
        value = operands[i] * operands[i + 1]
    else:
        value = operands[i] + operands[i + 1] if operators[i] == "+" else operands[i] - operands[i + 1]
    if value < 0 and i > 0:
        return None  # "a+-b" is not in the generator's language
    return operands[:i] + [value] + operands[i + 2 :], operators[:i] + operators[i + 1 :]


def _swap_first_commutative(operands: list[int], operators: list[str]) -> tuple[list[int], list[str]] | None:
    """The operands of the first product swapped, or the first two operands of a sum (same value)."""
    for i, op in enumerate(operators):
        binds_right = i + 1 < len(operators) and operators[i + 1] == "*"
        binds_left = i > 0 and operators[i - 1] == "*"
        if op == "*" or (op == "+" and not binds_right and not binds_left and (i == 0 or operators[i - 1] == "+")):
            if operands[i] == operands[i + 1] or (i == 0 and operands[0] < 0):
                continue
            swapped = list(operands)
            swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
            return swapped, list(operators)
    return None


SOURCES: TypedRegistry[ProblemSource] = TypedRegistry(
    "problem source", SourceConfig, ProblemSource, group="rlvr.sources"
)
SOURCES.register(ArithmeticSourceConfig, ArithmeticSource)
SOURCES.register(SkillsSourceConfig, SkillsSource)
SOURCES.register(ReasoningGymSourceConfig, ReasoningGymSource)
SOURCES.register(FileSourceConfig, FileSource)
SOURCES.register(DatasetSourceConfig, DatasetSource)
SOURCES.default = "skills"  # the demo's task: a section without `type` is the skills generator
