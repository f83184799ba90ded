"""Readers (data/readers.py): real JSONL, JSON, CSV and Parquet files and `datasets` folders written in
tmp_path, read record by record with exact indices, errors and values; answer extraction and column mapping
(data/column_mapping.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from rlvr.data.column_mapping import ColumnMapping, Extraction, extract_answer, map_record
from rlvr.data.readers import RAW_CHARS, RawRecord, read_dataset, read_records
from rlvr.errors import UserError


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def summary(records: list[RawRecord]) -> list[tuple[int, Any, str | None]]:
    return [(record.index, record.values, record.error) for record in records]


# ---------------------------------------------------------------------------------------------
# JSON Lines


def test_jsonl_each_line_is_read_on_its_own(tmp_path: Path) -> None:
    long_prompt = "x" * 10_000_000
    lines = [
        b'\xef\xbb\xbf{"prompt": "What is 2+2?", "answer": "4"}\r',  # a BOM and a Windows line end
        b'{"prompt": "x" "answer": 1}',
        b"[1, 2]",
        b"   ",
        b'{"prompt": "caf\xe9"}',
        json.dumps({"prompt": long_prompt, "answer": 7}).encode(),
        b'{"prompt": "\\ud800"}',
        b"[" * 100_000,
        b'{"prompt": "last"}',
    ]
    path = write(tmp_path / "problems.jsonl", b"\n".join(lines) + b"\n\n")

    records = list(read_records(path))

    assert [(r.index, r.error) for r in records] == [
        (0, None),
        (1, "line 2 is not JSON: Expecting ',' delimiter at column 16"),
        (2, "line 3 is a JSON array, not an object"),
        (3, "line 5 is not UTF-8 (byte 0xe9 at column 16)"),
        (4, None),
        (5, "line 7 holds a lone surrogate \\ud800, which is not valid Unicode text"),
        (6, "line 8 nests JSON too deeply to read"),
        (7, None),
    ]
    assert records[0].values == {"prompt": "What is 2+2?", "answer": "4"}
    assert records[0].raw == '{"prompt": "What is 2+2?", "answer": "4"}'
    assert records[1].values is None and records[1].raw == '{"prompt": "x" "answer": 1}'
    assert records[3].raw == '{"prompt": "caf\\xe9"}'
    assert records[4].values == {"prompt": long_prompt, "answer": 7}
    assert len(records[4].raw) == RAW_CHARS + 1 and records[4].raw.endswith("xx…")
    assert records[7].values == {"prompt": "last"}


# ---------------------------------------------------------------------------------------------
# JSON arrays


def test_json_array_items_are_records(tmp_path: Path) -> None:
    path = write(
        tmp_path / "problems.json",
        b'[\n  {"prompt": "a", "answer": "1"},\n  7,\n  {"prompt": "b\xff"},\n  {"prompt": "c"}\n]\n',
    )

    assert summary(list(read_records(path))) == [
        (0, {"prompt": "a", "answer": "1"}, None),
        (1, None, "item 2 is a JSON number, not an object"),
        (2, None, "item 3 is not UTF-8 (byte 0xff at line 4 column 16)"),
        (3, {"prompt": "c"}, None),
    ]


def test_json_array_syntax_break_keeps_the_items_before_it(tmp_path: Path) -> None:
    path = write(tmp_path / "problems.json", b'[{"a": 1}, {"b": 2} {"c": 3}]')

    records = list(read_records(path))

    assert summary(records) == [
        (0, {"a": 1}, None),
        (1, {"b": 2}, None),
        (2, None, "expected ',' or ']' after item 2 at line 1 column 21; the rest of the file is not read"),
    ]
    assert records[2].raw == '{"c": 3}]'
    trailing = write(tmp_path / "two.json", b'[{"a": 1}]\n[{"b": 2}]\n')
    assert summary(list(read_records(trailing))) == [
        (0, {"a": 1}, None),
        (1, None, "text after the array's closing ']' at line 1 column 10 is not read"),
    ]


def test_json_file_holding_json_lines_is_read_as_json_lines(tmp_path: Path) -> None:
    path = write(tmp_path / "problems.json", b'{"prompt": "a"}\n{"prompt": "b"}\n')

    assert summary(list(read_records(path))) == [(0, {"prompt": "a"}, None), (1, {"prompt": "b"}, None)]


# ---------------------------------------------------------------------------------------------
# CSV


def test_csv_records_span_lines_and_bad_ones_are_quarantined(tmp_path: Path) -> None:
    lines = [
        b"id,prompt,answer",
        b'1,"Add',
        b'the numbers",3',
        b'2,"broken,4',  # its quote never closes: only this line is lost
        b"3,plain,5",
        b"",
        b"4,short",
        b"5,caf\xe9,6",
        b'6,"He said ""hi""",7',
    ]
    path = write(tmp_path / "problems.csv", b"\n".join(lines) + b"\n")

    records = list(read_records(path))

    assert summary(records) == [
        (0, {"id": "1", "prompt": "Add\nthe numbers", "answer": "3"}, None),
        (1, None, "CSV record at line 4 has an unterminated quote"),
        (2, {"id": "3", "prompt": "plain", "answer": "5"}, None),
        (3, None, "CSV record at line 7 has 2 fields, the header has 3"),
        (4, None, "CSV record at line 8 is not UTF-8 (byte 0xe9 at column 6)"),
        (5, {"id": "6", "prompt": 'He said "hi"', "answer": "7"}, None),
    ]
    assert records[0].raw == '1,"Add\nthe numbers",3\n'
    assert records[1].raw == '2,"broken,4\n'
    assert records[4].raw == "5,caf\\xe9,6\n"


def test_csv_broken_quote_before_a_multiline_record(tmp_path: Path) -> None:
    """The broken quote pairs with the next record's opening quote; the records after it are still read."""
    lines = [
        b"prompt,answer",
        b'"broken,1',
        b"ok,2",
        b'"two',
        b'lines",3',
        b'a 5" screen,4',  # a lone quote inside an unquoted field is text
        b'"x\r\ny\xff",5',
    ]
    path = write(tmp_path / "problems.csv", b"\r\n".join(lines) + b"\r\n")

    assert summary(list(read_records(path))) == [
        (0, None, "CSV record at line 2 has an unterminated quote"),
        (1, {"prompt": "ok", "answer": "2"}, None),
        (2, {"prompt": "two\r\nlines", "answer": "3"}, None),
        (3, {"prompt": 'a 5" screen', "answer": "4"}, None),
        (4, None, "CSV record at line 7 is not UTF-8 (byte 0xff at column 2 of line 8)"),
    ]


def test_csv_header_problems_stop_the_file(tmp_path: Path) -> None:
    repeated = write(tmp_path / "repeated.csv", b"prompt,answer,prompt\na,b,c\n")
    with pytest.raises(UserError, match=r"^the CSV header of '.*repeated.csv' repeats column 'prompt'$"):
        list(read_records(repeated))
    broken = write(tmp_path / "broken.csv", b'"prompt,answer\na,b\n')
    with pytest.raises(UserError, match=r"header .*: CSV record at line 1 has an unterminated quote$"):
        list(read_records(broken))
    assert list(read_records(write(tmp_path / "empty.csv", b""))) == []


# ---------------------------------------------------------------------------------------------
# Parquet


def test_parquet_rows_with_binary_values(tmp_path: Path) -> None:
    table = pa.table(
        {
            "prompt": pa.array(["a", "b", "c"]),
            "answer": pa.array([1, 2, 3], pa.int64()),
            "note": pa.array([b"fine", b"\xff\xfe", None], pa.binary()),
        }
    )
    path = tmp_path / "problems.parquet"
    pq.write_table(table, path, row_group_size=2)

    records = list(read_records(path))

    assert summary(records) == [
        (0, {"prompt": "a", "answer": 1, "note": "fine"}, None),
        (1, None, "row 2 column 'note' is not UTF-8 (byte 0xff at position 1)"),
        (2, {"prompt": "c", "answer": 3, "note": None}, None),
    ]
    assert records[0].raw == '{"prompt": "a", "answer": 1, "note": "fine"}'


# ---------------------------------------------------------------------------------------------
# Paths and formats


def test_read_records_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"^no such file: '.*missing.jsonl'$"):
        read_records(tmp_path / "missing.jsonl")
    text = write(tmp_path / "problems.txt", b'{"prompt": "a"}\n')
    with pytest.raises(UserError, match=r"cannot tell the format of '.*problems.txt' from its suffix"):
        read_records(text)
    with pytest.raises(UserError, match=r"^unknown file format 'xml'; known: jsonl, json, csv, parquet$"):
        read_records(text, format="xml")
    assert summary(list(read_records(text, format="jsonl"))) == [(0, {"prompt": "a"}, None)]
    with pytest.raises(UserError, match=r"cannot read '.*bad.parquet' as Parquet"):
        read_records(write(tmp_path / "bad.parquet", b"not parquet"))


# ---------------------------------------------------------------------------------------------
# Hugging Face datasets


def test_dataset_saved_to_disk(tmp_path: Path) -> None:
    from datasets import Dataset

    Dataset.from_list([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]).save_to_disk(tmp_path / "ds")

    assert summary(list(read_dataset(str(tmp_path / "ds")))) == [
        (0, {"prompt": "a", "answer": "1"}, None),
        (1, {"prompt": "b", "answer": "2"}, None),
    ]


def test_dataset_dict_split_is_picked(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    splits = {
        "train": Dataset.from_list([{"prompt": "train one", "blob": b"ok"}]),
        "test": Dataset.from_list([{"prompt": "test one", "blob": b"ok"}, {"prompt": "test two", "blob": b"\xff"}]),
    }
    DatasetDict(splits).save_to_disk(tmp_path / "dd")
    folder = str(tmp_path / "dd")

    assert summary(list(read_dataset(folder, split="test"))) == [
        (0, {"prompt": "test one", "blob": "ok"}, None),
        (1, None, "row 2 column 'blob' is not UTF-8 (byte 0xff at position 1)"),
    ]
    assert summary(list(read_dataset(folder))) == [(0, {"prompt": "train one", "blob": "ok"}, None)]
    with pytest.raises(UserError, match=r"^dataset '.*dd' has no split 'validation'; available: train, test$"):
        read_dataset(folder, split="validation")


def test_dataset_from_local_data_files(tmp_path: Path) -> None:
    path = write(tmp_path / "problems.jsonl", b'{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": 2}\n')
    cache = str(tmp_path / "cache")
    expected = [(0, {"prompt": "a", "answer": 1}, None), (1, {"prompt": "b", "answer": 2}, None)]

    assert summary(list(read_dataset("json", data_files=str(path), cache_dir=cache))) == expected
    assert summary(list(read_dataset(str(path), cache_dir=cache))) == expected
    with pytest.raises(UserError, match=r"^dataset '.*problems.jsonl' has no split 'test'; available: train$"):
        read_dataset(str(path), split="test", cache_dir=cache)


def test_dataset_that_cannot_load_names_the_id(tmp_path: Path) -> None:
    """conftest sets HF_HUB_OFFLINE, so a hub id fails here the way it does without a network."""
    with pytest.raises(UserError, match=r"^cannot load dataset 'nobody/no-such-set': \w+Error: .+$"):
        read_dataset("nobody/no-such-set", cache_dir=str(tmp_path / "cache"))


# ---------------------------------------------------------------------------------------------
# Answer extraction


@pytest.mark.parametrize(
    ("text", "mode", "answer"),
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "gsm8k", "7"),
        ("Total: 1,234 + 1 = 1,235\n#### 1,235", "gsm8k", "1235"),
        ("#### 12\nfirst guess\n####  1,234,567.5 \nthat is all", "gsm8k", "1234567.5"),
        ("no marker here", "gsm8k", None),
        ("#### ", "gsm8k", None),
        ("So \\boxed{\\frac{1}{2}}.", "boxed", "\\frac{1}{2}"),
        ("\\boxed{1} then \\fbox{ 2 } and finally \\boxed{x^{2}}", "boxed", "x^{2}"),
        ("the set \\boxed{\\{1, 2\\}}", "boxed", "\\{1, 2\\}"),
        ("\\boxed{1} and \\boxed{\\frac{1}{2}", "boxed", None),
        ("no box", "boxed", None),
        ("\\boxed{}", "boxed", None),
        ("  keep me  ", "none", "  keep me  "),
    ],
)
def test_extract_answer(text: str, mode: Extraction, answer: str | None) -> None:
    assert extract_answer(text, mode) == answer


def test_extract_answer_unknown_mode() -> None:
    with pytest.raises(UserError, match=r"^unknown answer extraction 'last'; known: none, gsm8k, boxed$"):
        extract_answer("x", cast(Any, "last"))


# ---------------------------------------------------------------------------------------------
# Column mapping


def test_map_record_default_columns() -> None:
    values = {"prompt": "2+2?", "answer": 4, "domain": "math", "id": 17, "category": "", "verifier": None}

    assert map_record(values, ColumnMapping(), "none") == {
        "prompt": "2+2?",
        "reference": "4",
        "domain": "math",
        "id": "17",
    }
    both = {"prompt": "p", "reference": "r", "answer": "a"}
    assert map_record(both, ColumnMapping(), "none") == {"prompt": "p", "reference": "r"}


def test_map_record_custom_columns_and_extraction() -> None:
    mapping = ColumnMapping(prompt="question", reference="solution", difficulty_label="level", id=None)
    values = {"question": "Q", "solution": "Work... #### 2,000", "level": "Level 3", "id": "ignored"}

    assert map_record(values, mapping, "gsm8k") == {
        "prompt": "Q",
        "reference": "2000",
        "difficulty_label": "Level 3",
        "solution": "Work...",  # the worked text the answer came from, less its #### line
    }
    boxed = {"question": "Q", "solution": "so $\\boxed{\\sqrt{2}}$"}
    assert map_record(boxed, mapping, "boxed") == {
        "prompt": "Q",
        "reference": "\\sqrt{2}",
        "solution": "so $\\boxed{\\sqrt{2}}$",
    }


def test_map_record_solution_column() -> None:
    """A record's own `solution` (MATH's) wins over the worked reference; a non-text one is a reason."""
    values = {"prompt": "Q", "answer": "Steps #### 7", "solution": "Own steps"}
    assert map_record(values, ColumnMapping(), "gsm8k")["solution"] == "Own steps"
    assert map_record({"prompt": "Q", "answer": "Steps\n#### 7"}, ColumnMapping(), "gsm8k")["solution"] == "Steps"
    assert "solution" not in map_record({"prompt": "Q", "answer": "7"}, ColumnMapping(), "none")
    assert map_record({"prompt": "Q", "answer": "7", "solution": 3}, ColumnMapping(), "none") == (
        "field 'solution' must be a string, got int"
    )


def test_map_record_keeps_chat_prompts_and_structured_references() -> None:
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    values = {"prompt": chat, "reference": {"tests": ["assert f() == 1"]}}

    assert map_record(values, ColumnMapping(), "none") == {"prompt": chat, "reference": {"tests": ["assert f() == 1"]}}


@pytest.mark.parametrize(
    ("values", "extraction", "reason"),
    [
        ({"answer": "1"}, "none", "missing field 'prompt'"),
        ({"prompt": None, "answer": "1"}, "none", "missing field 'prompt'"),
        (
            {"prompt": 3, "answer": "1"},
            "none",
            "field 'prompt' must be a string or a list of {role, content} messages, got int",
        ),
        (
            {"prompt": [{"role": "user"}], "answer": "1"},
            "none",
            "field 'prompt' must be a string or a list of {role, content} messages, got a list that is not chat messages",
        ),
        ({"prompt": "p"}, "none", "missing field 'reference' (looked for 'reference' and 'answer')"),
        (
            {"prompt": "p", "answer": True},
            "none",
            "field 'answer' must be a string, a number, an object or a list, got bool",
        ),
        ({"prompt": "p", "answer": float("nan")}, "none", "field 'answer' is nan, not a usable number"),
        ({"prompt": "p", "answer": "7"}, "gsm8k", "answer extraction 'gsm8k' found no '####' in field 'answer'"),
        (
            {"prompt": "p", "answer": "7 ####"},
            "gsm8k",
            "answer extraction 'gsm8k' found nothing after the last '####' in field 'answer'",
        ),
        (
            {"prompt": "p", "reference": "7"},
            "boxed",
            "answer extraction 'boxed' found no \\boxed{...} in field 'reference'",
        ),
        (
            {"prompt": "p", "reference": "\\boxed{7"},
            "boxed",
            "answer extraction 'boxed' found an unclosed or empty \\boxed{...} in field 'reference'",
        ),
        (
            {"prompt": "p", "answer": ["7"]},
            "boxed",
            "answer extraction 'boxed' needs a string in field 'answer', got list",
        ),
        ({"prompt": "p", "answer": "7", "domain": 5}, "none", "field 'domain' must be a string, got int"),
        ({"prompt": "p", "answer": "7", "id": 1.5}, "none", "field 'id' must be a string, got float"),
    ],
)
def test_map_record_reasons(values: dict[str, Any], extraction: Extraction, reason: str) -> None:
    assert map_record(values, ColumnMapping(), extraction) == reason


def test_map_record_explicit_reference_column_missing() -> None:
    assert map_record({"prompt": "p", "answer": "1"}, ColumnMapping(reference="solution"), "none") == (
        "missing field 'solution'"
    )


def test_column_mapping_refuses_unknown_keys() -> None:
    with pytest.raises(ValidationError, match="answer_column"):
        ColumnMapping.model_validate({"answer_column": "a"})
