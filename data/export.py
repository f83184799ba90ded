"""Export the problems table as another trainer's training set: verl, TRL, or plain JSON Lines.

One file per split (`{split}.parquet`, or `{split}.jsonl`), rows in problem_id order, so the same
problems always give byte-identical files. The rewards stay ours: a verl file names our verifier as
`data_source`, which `rlvr.verifiers.adapters.compute_score` routes on; a TRL file carries the `verifier`
and `reference` columns that `rlvr.verifiers.adapters.trl_reward_func` reads, so one reward function
scores a mixed-domain file.

Layouts:
- verl (what `RLHFDataset` and the rule reward manager read): `data_source` (verifier name),
  `prompt` (list of {role, content}), `ability` (domain), `reward_model` {style: "rule", ground_truth:
  reference}, `extra_info` {split, index (row position in the file), problem_id}.
- trl (a `GRPOTrainer` train_dataset): `prompt`, `reference`, `verifier`, `problem_id`. The prompt is a
  string, or, if any exported prompt is a chat, every prompt is a conversation (list of {role, content}),
  since TRL decides per batch whether a dataset is conversational.
- jsonl: every column of the problems table, one JSON object per line.

A prompt is a chat when it is the JSON text of a non-empty list of {"role", "content"} objects.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rlvr.chat import as_messages, chat_messages
from rlvr.errors import UserError
from rlvr.verifiers.registry import registered

EXPORT_FORMATS = ("verl", "trl", "jsonl")

MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
VERL_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", MESSAGES_TYPE),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("problem_id", pa.string())])),
    ]
)
TRL_COLUMNS = ("prompt", "reference", "verifier", "problem_id")

# Columns each format reads; none may be null, or the trainer would get a problem it cannot prompt or score.
_REQUIRED: dict[str, tuple[str, ...]] = {
    "verl": ("problem_id", "split", "prompt", "domain", "reference", "verifier"),
    "trl": ("problem_id", "split", "prompt", "reference", "verifier"),
    "jsonl": ("problem_id", "split"),
}
_SPLIT_NAME = re.compile(r"[A-Za-z0-9_-]+")  # split names become file names


def _check_input(problems: pa.Table, fmt: str) -> None:
    if fmt not in EXPORT_FORMATS:
        raise UserError(f"unknown export format {fmt!r}; choose one of: {', '.join(EXPORT_FORMATS)}")
    missing = [c for c in _REQUIRED[fmt] if c not in problems.column_names]
    if missing:
        raise UserError(f"the problems table lacks column(s) {', '.join(missing)} needed for {fmt} export")
    for column in _REQUIRED[fmt]:
        nulls = problems.column(column).null_count
        if nulls:
            raise UserError(f"column {column!r} is null in {nulls} problem(s); {fmt} export needs a value in each")
    if fmt in ("verl", "trl"):
        known = registered()
        unknown = sorted(set(problems.column("verifier").to_pylist()) - set(known))
        if unknown:
            raise UserError(f"unknown verifier(s) {', '.join(map(repr, unknown))}; registered: {', '.join(known)}")


def _splits_to_write(problems: pa.Table, split: str | None) -> list[str]:
    present = sorted(set(problems.column("split").to_pylist()))
    for name in present:
        if not _SPLIT_NAME.fullmatch(name):
            raise UserError(f"split {name!r} cannot be a file name; use letters, digits, '_' or '-'")
    if split is None:
        return present
    if split not in present:
        raise UserError(f"no problems in split {split!r}; splits present: {', '.join(present) or 'none'}")
    return [split]


def _split_rows(problems: pa.Table, split: str) -> list[dict[str, Any]]:
    """The split's problems in problem_id order: the files do not depend on how the table was assembled."""
    return problems.filter(pc.equal(problems.column("split"), split)).sort_by("problem_id").to_pylist()


def verl_table(rows: list[dict[str, Any]], split: str) -> pa.Table:
    """verl's RL dataset layout (see the module docstring) for one split's problems, in file order."""
    records = [
        {
            "data_source": row["verifier"],
            "prompt": as_messages(row["prompt"]),
            "ability": row["domain"],
            "reward_model": {"style": "rule", "ground_truth": row["reference"]},
            "extra_info": {"split": split, "index": index, "problem_id": row["problem_id"]},
        }
        for index, row in enumerate(rows)
    ]
    return pa.Table.from_pylist(records, schema=VERL_SCHEMA)


def trl_table(rows: list[dict[str, Any]], conversational: bool) -> pa.Table:
    """A GRPOTrainer dataset: the prompt plus the columns our TRL reward function reads."""
    if conversational:
        prompts = pa.array([as_messages(row["prompt"]) for row in rows], type=MESSAGES_TYPE)
    else:
        prompts = pa.array([row["prompt"] for row in rows], type=pa.string())
    columns = {"prompt": prompts}
    for name in TRL_COLUMNS[1:]:
        columns[name] = pa.array([row[name] for row in rows], type=pa.string())
    return pa.table(columns)


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Write beside `path`, then rename: an interrupted export never leaves a truncated file that loads."""
    partial = path.with_name(f".{path.name}.partial")
    write(partial)
    os.replace(partial, path)


def _write_jsonl(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")


def _writer(fmt: str, rows: list[dict[str, Any]], split: str, conversational: bool) -> Callable[[Path], None]:
    """What writes one split's file in `fmt` to a given path."""
    if fmt == "jsonl":
        return lambda target: _write_jsonl(rows, target)
    table = verl_table(rows, split) if fmt == "verl" else trl_table(rows, conversational)
    return lambda target: pq.write_table(table, target)


def export_problems(problems: pa.Table, fmt: str, out_dir: Path, split: str | None = None) -> list[Path]:
    """Write `problems` in format `fmt` under `out_dir`, one file per split (or only `split`); the paths."""
    _check_input(problems, fmt)
    splits = _splits_to_write(problems, split)
    rows_by_split = {name: _split_rows(problems, name) for name in splits}
    conversational = fmt == "trl" and any(
        chat_messages(row["prompt"]) is not None for rows in rows_by_split.values() for row in rows
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in rows_by_split.items():
        path = out_dir / f"{name}.{'jsonl' if fmt == 'jsonl' else 'parquet'}"
        _write_atomically(path, _writer(fmt, rows, name, conversational))
        paths.append(path)
    return paths
