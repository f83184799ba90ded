"""Reading users' problem files (JSONL, JSON, CSV, Parquet) and Hugging Face datasets, record by record.

Reading is tolerant: a record that cannot be parsed becomes a `RawRecord` with a one-line `error` and its
raw text, so the synthesize stage quarantines it and reads on. Only what makes the whole source unreadable
(a missing file, an unknown format, a CSV header that cannot be split, a dataset that does not load) raises
`UserError`. What the fields of a parsed record mean to the pipeline is data/column_mapping.py's job.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlvr.errors import UserError

RAW_CHARS = 2000  # how much of a record's text its quarantine row keeps
CSV_FIELD_CHARS = 1 << 30  # csv's default field limit (131,072 characters) would refuse a long prompt
PARQUET_BATCH_ROWS = 1024  # Parquet is read a batch at a time, never a whole large file at once

BOM = b"\xef\xbb\xbf"
SUFFIX_FORMATS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
}
_SUFFIXES = ".jsonl, .json, .csv or .parquet"
DATASETS_BUILDERS = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}

_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # an undecodable byte, as surrogateescape decodes it
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # a JSON `\ud800` escape: no UTF-8 can store it


@dataclass(frozen=True)
class RawRecord:
    """One record of a source: its parsed values, or why it could not be parsed; `raw` feeds quarantine."""

    index: int  # 0-based position among the source's records (blank lines and a CSV header are not records)
    values: dict[str, Any] | None
    error: str | None
    raw: str


# ---------------------------------------------------------------------------------------------
# Raw text for quarantine rows


def _clip(text: str) -> str:
    return text if len(text) <= RAW_CHARS else text[:RAW_CHARS] + "…"


def _raw_bytes(data: bytes) -> str:
    """Bytes as quarantine text: undecodable bytes escaped (`\\xff`), long text cut."""
    # a character takes at most 4 bytes, so the slice still decodes to more than RAW_CHARS when data is longer
    return _clip(data[: 4 * RAW_CHARS + 4].decode("utf-8", "backslashreplace"))


def _raw_escaped(text: str) -> str:
    """Text decoded with surrogateescape as quarantine text (its undecodable bytes shown as `\\xff`)."""
    head = text[: RAW_CHARS + 1].encode("utf-8", "surrogateescape")
    return _clip(head.decode("utf-8", "backslashreplace"))


def _raw_json(values: Mapping[str, Any]) -> str:
    """A typed row (Parquet, datasets) as quarantine text."""
    return _clip(json.dumps(values, ensure_ascii=False, default=_json_fallback))


def _json_fallback(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)


def _bad_byte(data: bytes, start: int, unit: str = "column") -> str:
    return f"byte 0x{data[start]:02x} at {unit} {start + 1}"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


# ---------------------------------------------------------------------------------------------
# Files


def read_records(path: str | Path, format: str | None = None) -> Iterator[RawRecord]:
    """The records of a user's file, in order; `format` (jsonl, json, csv, parquet) defaults to the suffix.

    The file and format are checked now, so a bad path fails before the first record is asked for.
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"no such file: '{path}'")
    if not path.is_file():
        raise UserError(f"'{path}' is not a file; give a {_SUFFIXES} file")
    fmt = format if format is not None else _format_from_suffix(path)
    reader = _READERS.get(fmt)
    if reader is None:
        raise UserError(f"unknown file format '{fmt}'; known: {', '.join(_READERS)}")
    return reader(path)


def _format_from_suffix(path: Path) -> str:
    fmt = SUFFIX_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise UserError(f"cannot tell the format of '{path}' from its suffix; name it {_SUFFIXES} or give the format")
    return fmt


def _read_jsonl(path: Path) -> Iterator[RawRecord]:
    """One record per non-blank line; each line is decoded on its own, so one bad line spoils only itself."""
    with path.open("rb") as lines:
        index = 0
        for lineno, line in enumerate(lines, 1):
            line = line.rstrip(b"\r\n")
            if lineno == 1:
                line = line.removeprefix(BOM)
            if not line.strip():
                continue
            yield _jsonl_record(index, lineno, line)
            index += 1


def _jsonl_record(index: int, lineno: int, line: bytes) -> RawRecord:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return RawRecord(index, None, f"line {lineno} is not UTF-8 ({_bad_byte(line, exc.start)})", _raw_bytes(line))
    raw = _clip(text)
    try:
        value = json.loads(text)
        problem = _object_problem(value)
    except json.JSONDecodeError as exc:
        return RawRecord(index, None, f"line {lineno} is not JSON: {exc.msg} at column {exc.colno}", raw)
    except RecursionError:
        return RawRecord(index, None, f"line {lineno} nests JSON too deeply to read", raw)
    if problem is not None:
        return RawRecord(index, None, f"line {lineno} {problem}", raw)
    return RawRecord(index, value, None, raw)


def _object_problem(value: Any) -> str | None:
    """Why a parsed JSON value cannot be a record (not an object, or a string no UTF-8 can store)."""
    if not isinstance(value, dict):
        return f"is {_json_kind(value)}, not an object"
    surrogate = _lone_surrogate(value)
    if surrogate is not None:
        return f"holds a lone surrogate \\u{ord(surrogate):04x}, which is not valid Unicode text"
    return None


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a JSON boolean"
    if isinstance(value, int | float):
        return "a JSON number"
    kinds = {list: "a JSON array", str: "a JSON string", type(None): "JSON null"}
    return kinds.get(type(value), "a JSON value")


def _lone_surrogate(value: Any) -> str | None:
    """The first lone surrogate in a parsed JSON value's strings and keys (from a JSON escape such as `\\ud800`)."""
    if isinstance(value, str):
        found = _LONE_SURROGATE.search(value)
        return found.group() if found else None
    if isinstance(value, dict):
        return _first_surrogate([*value.keys(), *value.values()])
    if isinstance(value, list):
        return _first_surrogate(value)
    return None


def _first_surrogate(items: list[Any]) -> str | None:
    for item in items:
        found = _lone_surrogate(item)
        if found is not None:
            return found
    return None


def _read_json(path: Path) -> Iterator[RawRecord]:
    """A JSON array of objects, item by item; a file that does not start with `[` is read as JSON Lines
    (JSON Lines saved as .json are common)."""
    with path.open("rb") as head:
        start = head.read(4096).removeprefix(BOM).lstrip()
    if not start.startswith(b"["):
        return _read_jsonl(path)
    text = path.read_bytes().removeprefix(BOM).decode("utf-8", "surrogateescape")
    return _json_items(text)


def _json_items(text: str) -> Iterator[RawRecord]:
    """The items of a JSON array, each parsed on its own: a bad item is an error record, and a break in the
    array's syntax ends the reading with one error record for the rest."""
    decoder = json.JSONDecoder()
    pos = _json_space(text, text.index("[") + 1)
    index = 0
    while not text.startswith("]", pos):
        try:
            value, end = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError) as exc:
            reason = f"item {index + 1} {_json_failure(exc)}; the rest of the file is not read"
            yield RawRecord(index, None, reason, _raw_escaped(text[pos : pos + RAW_CHARS + 1]))
            return
        yield _json_item(index, value, text, pos, end)
        index += 1
        pos = _json_space(text, end)
        if text.startswith(",", pos):
            pos = _json_space(text, pos + 1)
        elif not text.startswith("]", pos):
            reason = f"expected ',' or ']' after item {index} at {_text_position(text, pos)}"
            yield RawRecord(
                index,
                None,
                f"{reason}; the rest of the file is not read",
                _raw_escaped(text[pos : pos + RAW_CHARS + 1]),
            )
            return
    if text[pos + 1 :].strip():
        reason = f"text after the array's closing ']' at {_text_position(text, pos)} is not read"
        yield RawRecord(index, None, reason, _raw_escaped(text[pos + 1 : pos + RAW_CHARS + 2]))


def _json_failure(exc: json.JSONDecodeError | RecursionError) -> str:
    if isinstance(exc, RecursionError):
        return "nests JSON too deeply to read"
    return f"is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"


def _json_item(index: int, value: Any, text: str, start: int, end: int) -> RawRecord:
    span = text[start:end]
    raw = _raw_escaped(span)
    bad = _ESCAPED_BYTE.search(span)
    if bad is not None:
        byte = ord(bad.group()) - 0xDC00
        where = _text_position(text, start + bad.start())
        return RawRecord(index, None, f"item {index + 1} is not UTF-8 (byte 0x{byte:02x} at {where})", raw)
    try:
        problem = _object_problem(value)
    except RecursionError:
        problem = "nests JSON too deeply to read"
    if problem is not None:
        return RawRecord(index, None, f"item {index + 1} {problem}", raw)
    return RawRecord(index, value, None, raw)


def _json_space(text: str, pos: int) -> int:
    match = _JSON_SPACE.match(text, pos)
    return match.end() if match else pos


def _text_position(text: str, pos: int) -> str:
    """`pos` as "line L column C", both from 1."""
    line = text.count("\n", 0, pos) + 1
    column = pos - text.rfind("\n", 0, pos)
    return f"line {line} column {column}"


# ---------------------------------------------------------------------------------------------
# CSV: records may span lines inside quotes; a broken quote must not swallow the rest of the file


class _Lines:
    """A file's physical lines, numbered from 1, with lines pushed back to be read again after a broken quote."""

    def __init__(self, lines: Iterable[bytes]) -> None:
        self._lines = enumerate(lines, 1)
        self._back: deque[tuple[int, bytes]] = deque()

    def next(self) -> tuple[int, bytes] | None:
        if self._back:
            return self._back.popleft()
        return next(self._lines, None)

    def push_back(self, lines: Sequence[tuple[int, bytes]]) -> None:
        self._back.extendleft(reversed(lines))


def _without_bom(lines: Iterable[bytes]) -> Iterator[bytes]:
    for lineno, line in enumerate(lines):
        yield line.removeprefix(BOM) if lineno == 0 else line


def _read_csv(path: Path) -> Iterator[RawRecord]:
    """Records keyed by the header's names, all values strings (no type inference)."""
    csv.field_size_limit(max(csv.field_size_limit(), CSV_FIELD_CHARS))  # process-wide, so only ever raised
    with path.open("rb") as file:
        lines = _Lines(_without_bom(file))
        header = _csv_record(lines, 0, None)
        if header is None:
            return
        if header.values is None:
            raise UserError(f"cannot read the header of '{path}': {header.error}")
        names = list(header.values.values())
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise UserError(f"the CSV header of '{path}' repeats column {', '.join(map(repr, repeated))}")
        index = 0
        while (record := _csv_record(lines, index, names)) is not None:
            yield record
            index += 1


def _csv_record(lines: _Lines, index: int, names: list[str] | None) -> RawRecord | None:
    """The next record (None at the end). A record whose quotes do not work out is an error record for its
    first physical line, and reading resumes at the line after it. Without `names` (the header) any number
    of fields is accepted and they are keyed by position."""
    chunk, closed = _record_lines(lines)
    if not chunk:
        return None
    lineno, first = chunk[0]
    data = b"".join(line for _, line in chunk)
    width = None if names is None else len(names)
    fields = _single_record(_split_csv(data), width) if closed else None
    if fields is not None:
        return _csv_values(index, chunk, fields, names)
    if len(chunk) == 1 and closed:
        return RawRecord(index, None, f"CSV record at line {lineno} {_csv_shape(data, width)}", _raw_bytes(data))
    lines.push_back(chunk[1:])
    alone = _single_record(_split_csv(first), width)  # a stray quote in an unquoted field (`5" screen`) is fine
    if alone is not None:
        return _csv_values(index, chunk[:1], alone, names)
    return RawRecord(index, None, f"CSV record at line {lineno} has an unterminated quote", _raw_bytes(first))


def _record_lines(lines: _Lines) -> tuple[list[tuple[int, bytes]], bool]:
    """The physical lines of the next record: lines are added while the count of quotes is odd.
    Returns them and whether the quotes closed before the end of the file."""
    first = lines.next()
    while first is not None and not first[1].strip():
        first = lines.next()
    if first is None:
        return [], True
    chunk, quotes = [first], first[1].count(b'"')
    while quotes % 2:
        following = lines.next()
        if following is None:
            return chunk, False
        chunk.append(following)
        quotes += following[1].count(b'"')
    return chunk, True


def _split_csv(data: bytes) -> list[list[str]] | str:
    """The csv module's rows of `data` (undecodable bytes kept as surrogates), or its complaint."""
    text = data.decode("utf-8", "surrogateescape")
    try:
        return list(csv.reader(io.StringIO(text, newline=""), strict=True))
    except csv.Error as exc:
        return f"cannot be split: {exc}"


def _single_record(rows: list[list[str]] | str, width: int | None) -> list[str] | None:
    """The fields when the rows are one record of the header's width, else None."""
    if isinstance(rows, str) or len(rows) != 1 or (width is not None and len(rows[0]) != width):
        return None
    return rows[0]


def _csv_shape(data: bytes, width: int | None) -> str:
    """Why one physical line is not a record of the header's width."""
    rows = _split_csv(data)
    if isinstance(rows, str):
        return rows
    if len(rows) != 1:
        return f"holds {len(rows)} records on one line (are its lines ended by a bare carriage return?)"
    return f"has {len(rows[0])} fields, the header has {width}"


def _csv_values(index: int, chunk: list[tuple[int, bytes]], fields: list[str], names: list[str] | None) -> RawRecord:
    data = b"".join(line for _, line in chunk)
    lineno = chunk[0][0]
    for at, line in chunk:
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as exc:
            where = _bad_byte(line, exc.start) if at == lineno else f"{_bad_byte(line, exc.start)} of line {at}"
            return RawRecord(index, None, f"CSV record at line {lineno} is not UTF-8 ({where})", _raw_bytes(data))
    keys = names if names is not None else [str(position) for position in range(len(fields))]
    return RawRecord(index, dict(zip(keys, fields)), None, _raw_bytes(data))


# ---------------------------------------------------------------------------------------------
# Parquet and Hugging Face datasets: typed rows; only binary values can fail (they must be UTF-8 text)


def _read_parquet(path: Path) -> Iterator[RawRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"cannot read '{path}' as Parquet: {_first_line(exc)}") from None
    return _parquet_rows(path, parquet)


def _parquet_rows(path: Path, parquet: Any) -> Iterator[RawRecord]:
    import pyarrow as pa

    index = 0
    try:
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for row in batch.to_pylist():
                yield _typed_record(index, row)
                index += 1
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"cannot read '{path}' past row {index}: {_first_line(exc)}") from None


def _typed_record(index: int, row: dict[str, Any]) -> RawRecord:
    """A typed row with its binary values decoded to text; a value that is not UTF-8 spoils the row."""
    values = {}
    for column, value in row.items():
        try:
            values[column] = _as_text(value)
        except UnicodeDecodeError as exc:
            bad = _bad_byte(exc.object, exc.start, "position")
            reason = f"row {index + 1} column '{column}' is not UTF-8 ({bad})"
            return RawRecord(index, None, reason, _raw_json(row))
    return RawRecord(index, values, None, _raw_json(values))


def _as_text(value: Any) -> Any:
    """`value` with every bytes inside it decoded as UTF-8 (raises UnicodeDecodeError)."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, list):
        return [_as_text(item) for item in value]
    if isinstance(value, dict):
        return {key: _as_text(item) for key, item in value.items()}
    return value


def read_dataset(
    path: str,
    *,
    name: str | None = None,
    split: str = "train",
    data_files: str | Sequence[str] | Mapping[str, str | Sequence[str]] | None = None,
    cache_dir: str | None = None,
) -> Iterator[RawRecord]:
    """The rows of one split of a Hugging Face dataset: a `save_to_disk` folder, a local data file or folder
    of files, or a hub id (needs the network). The dataset is loaded now; rows are yielded as read.

    `load_dataset` caches under `cache_dir`, else under HF_HOME, which the caller points away from home.
    A folder saved from a single `Dataset` has no splits and is read whole.
    """
    import datasets

    try:
        loaded = _load_dataset(datasets, path, name, split, data_files, cache_dir)
    except UserError:
        raise
    except Exception as exc:  # the loaders raise many kinds; any of them means this source cannot be read
        raise UserError(f"cannot load dataset '{path}': {_first_line(exc)}") from None
    return _dataset_rows(_pick_split(loaded, split, path))


def _load_dataset(
    datasets: Any, path: str, name: str | None, split: str, data_files: Any, cache_dir: str | None
) -> Any:
    """A Dataset or DatasetDict: a folder from `save_to_disk`, a folder of data files (its splits named by
    the files), one data file (by its suffix), else a hub id (only the split asked for is downloaded)."""
    local = Path(path)
    if local.is_dir() and ((local / "dataset_dict.json").is_file() or (local / "state.json").is_file()):
        return datasets.load_from_disk(path)
    if local.is_dir():
        return datasets.load_dataset(path, name, data_files=data_files, cache_dir=cache_dir)
    if local.is_file():
        builder = DATASETS_BUILDERS.get(SUFFIX_FORMATS.get(local.suffix.lower(), ""))
        if builder is None:
            raise UserError(f"cannot tell the format of '{path}' from its suffix; name it {_SUFFIXES}")
        return datasets.load_dataset(builder, data_files=path, cache_dir=cache_dir)
    return datasets.load_dataset(path, name, split=split, data_files=data_files, cache_dir=cache_dir)


def _pick_split(loaded: Any, split: str, path: str) -> Any:
    import datasets

    if not isinstance(loaded, datasets.DatasetDict):
        return loaded
    if split not in loaded:
        raise UserError(f"dataset '{path}' has no split '{split}'; available: {', '.join(loaded)}")
    return loaded[split]


def _dataset_rows(dataset: Iterable[dict[str, Any]]) -> Iterator[RawRecord]:
    for index, row in enumerate(dataset):
        yield _typed_record(index, row)


_READERS: dict[str, Callable[[Path], Iterator[RawRecord]]] = {
    "jsonl": _read_jsonl,
    "json": _read_json,
    "csv": _read_csv,
    "parquet": _read_parquet,
}
