"""Export of the problems table for verl, TRL and JSON Lines, checked by loading each file back with
`datasets` and scoring it the way the other trainer would: verl's `compute_score` per row, TRL's
GRPOTrainer reward call (dataset columns repeated per generation)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlvr.data.export import EXPORT_FORMATS, chat_messages, export_problems
from rlvr.errors import UserError
from rlvr.storage.schemas import SCHEMAS
from rlvr.verifiers.adapters import compute_score, trl_reward_func
from rlvr.verifiers.pool import VerifierPool

PROBLEMS_SCHEMA = SCHEMAS["problems"]
MATH_CHAT = json.dumps(
    [
        {"role": "system", "content": "Put the final answer in \\boxed{}."},
        {"role": "user", "content": "Write one half as a fraction."},
    ]
)


@functools.cache
def gcd_entries() -> list[dict[str, Any]]:
    """Two reasoning-gym GCD entries (imported here, not at collection: every xdist worker collects this file)."""
    import reasoning_gym

    return [json.loads(json.dumps(entry)) for entry in reasoning_gym.create_dataset("gcd", size=2, seed=1)]


# problem_id -> (a correct completion, a wrong one)
ANSWERS = {
    "p1-gcd": ("<answer>1</answer>", "<answer>7</answer>"),
    "p2-math": ("So it is \\boxed{\\frac{1}{2}}", "\\boxed{2}"),
    "p3-arith": ("5", "6"),
    "p4-gcd": ("2", "4"),
}


def _problem(problem_id: str, split: str, verifier: str, prompt: str, reference: str, answer: str) -> dict[str, Any]:
    return {
        "problem_id": problem_id,
        "run_id": "r1",
        "split": split,
        "domain": verifier,
        "category": f"{verifier}/basic",
        "prompt": prompt,
        "reference": reference,
        "answer": answer,
        "verifier": verifier,
        "source": "test",
        "generator": verifier,
        "generator_version": "1",
        "params": "{}",
        "seed": 7,
        "source_index": int(problem_id[1]),
        "parent_problem_id": "p0-root" if problem_id == "p2-math" else None,
        "derivation": "original",
        "difficulty_label": None,
    }


def problems_table(chat_math: bool = False) -> pa.Table:
    """Four problems over three verifiers, listed out of problem_id order; train: p1, p3; test: p2, p4."""
    gcd = gcd_entries()
    gcd_reference = [json.dumps({"dataset": "gcd", "entry": entry}) for entry in gcd]
    rows = [
        _problem("p3-arith", "train", "arithmetic", "2+3=", "5", "5"),
        _problem("p4-gcd", "test", "reasoning_gym", gcd[1]["question"], gcd_reference[1], gcd[1]["answer"]),
        _problem("p2-math", "test", "math", MATH_CHAT if chat_math else "One half?", "\\frac{1}{2}", "1/2"),
        _problem("p1-gcd", "train", "reasoning_gym", gcd[0]["question"], gcd_reference[0], gcd[0]["answer"]),
    ]
    return pa.Table.from_pylist(rows, schema=PROBLEMS_SCHEMA)


def load(path: Path, tmp_path: Path) -> list[dict[str, Any]]:
    from datasets import load_dataset

    builder = "json" if path.suffix == ".jsonl" else "parquet"
    dataset = load_dataset(builder, data_files=str(path), split="train", cache_dir=str(tmp_path / "hf-cache"))
    return list(dataset)


# ----------------------------------------------------------------------------------------------
# verl


def test_verl_layout_types_and_scores(tmp_path):
    paths = export_problems(problems_table(chat_math=True), "verl", tmp_path / "verl")
    assert paths == [tmp_path / "verl" / "test.parquet", tmp_path / "verl" / "train.parquet"]
    messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    assert pq.read_schema(paths[0]).remove_metadata() == pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", messages),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("problem_id", pa.string())])),
        ]
    )
    test_rows = load(paths[0], tmp_path)
    assert list(test_rows[0]) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert test_rows[0] == {
        "data_source": "math",
        "prompt": json.loads(MATH_CHAT),
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},
        "extra_info": {"split": "test", "index": 0, "problem_id": "p2-math"},
    }
    train_rows = load(paths[1], tmp_path)
    assert [row["extra_info"]["problem_id"] for row in train_rows] == ["p1-gcd", "p3-arith"]
    assert [row["extra_info"]["index"] for row in train_rows] == [0, 1]
    assert train_rows[1]["prompt"] == [{"role": "user", "content": "2+3="}]
    assert json.loads(train_rows[0]["reward_model"]["ground_truth"]) == {"dataset": "gcd", "entry": gcd_entries()[0]}
    for row in test_rows + train_rows:
        right, wrong = ANSWERS[row["extra_info"]["problem_id"]]
        args = (row["reward_model"]["ground_truth"], row["extra_info"])
        assert compute_score(row["data_source"], right, *args) == 1.0, row["extra_info"]
        assert compute_score(row["data_source"], wrong, *args) == 0.0, row["extra_info"]


def test_verl_compute_score_takes_a_reasoning_gym_json_ground_truth():
    ground_truth = json.dumps({"dataset": "gcd", "entry": gcd_entries()[1]})
    assert compute_score("reasoning_gym", "The GCD is\n<answer>2</answer>", ground_truth, {"index": 0}) == 1.0
    assert compute_score("reasoning_gym", "<answer>1</answer>", ground_truth, None) == 0.0


def test_export_is_deterministic_whatever_the_row_order(tmp_path):
    table = problems_table()
    first = export_problems(table, "verl", tmp_path / "a")
    second = export_problems(table.take([3, 1, 0, 2]), "verl", tmp_path / "b")
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]


# ----------------------------------------------------------------------------------------------
# TRL


def grpo_reward_call(reward, rows: list[dict[str, Any]], completions: list[list[Any]]) -> list[float]:
    """Call `reward` as TRL's GRPOTrainer does: each example repeated once per generation, every column
    but prompt/completion/completion_ids passed as a keyword list, plus completion_ids and trainer_state."""
    inputs = [row for row, group in zip(rows, completions) for _ in group]
    flat = [completion for group in completions for completion in group]
    keys = [key for key in inputs[0] if key not in ("prompt", "completion", "completion_ids")]
    reward_kwargs: dict[str, Any] = {key: [example[key] for example in inputs] for key in keys}
    reward_kwargs["trainer_state"] = SimpleNamespace(global_step=3, epoch=0.5)  # TRL passes its TrainerState
    return reward(
        prompts=[example["prompt"] for example in inputs],
        completions=flat,
        completion_ids=[[101, 102, i] for i in range(len(flat))],
        **reward_kwargs,
    )


def test_trl_text_prompts_and_completions(tmp_path):
    paths = export_problems(problems_table(), "trl", tmp_path / "trl")
    assert pq.read_schema(paths[0]).remove_metadata() == pa.schema(
        [("prompt", pa.string()), ("reference", pa.string()), ("verifier", pa.string()), ("problem_id", pa.string())]
    )
    rows = load(paths[0], tmp_path) + load(paths[1], tmp_path)
    assert [row["problem_id"] for row in rows] == ["p2-math", "p4-gcd", "p1-gcd", "p3-arith"]
    assert rows[3] == {"prompt": "2+3=", "reference": "5", "verifier": "arithmetic", "problem_id": "p3-arith"}
    completions = [[ANSWERS[row["problem_id"]][0], ANSWERS[row["problem_id"]][1]] for row in rows]
    completions[0].append("\\boxed{0.5}")  # groups may differ in size here; TRL's are all num_generations
    rewards = grpo_reward_call(trl_reward_func(), rows, completions)
    assert rewards == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]


def test_trl_conversational_when_any_prompt_is_a_chat(tmp_path):
    paths = export_problems(problems_table(chat_math=True), "trl", tmp_path / "trl")
    messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    assert pq.read_schema(paths[1]).field("prompt").type == messages
    rows = load(paths[0], tmp_path) + load(paths[1], tmp_path)
    assert rows[0]["prompt"] == json.loads(MATH_CHAT)
    assert rows[3]["prompt"] == [{"role": "user", "content": "2+3="}]
    completions = [[[{"role": "assistant", "content": text}] for text in ANSWERS[row["problem_id"]]] for row in rows]
    completions[2].reverse()  # p1-gcd: wrong first
    rewards = grpo_reward_call(trl_reward_func(), rows, completions)
    assert rewards == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def test_trl_reward_unknown_verifier_in_a_row_is_a_user_error():
    reward = trl_reward_func()
    with pytest.raises(UserError, match="unknown verifier 'maths'; registered: "):
        reward(prompts=["p", "p"], completions=["5", "5"], reference=["5", "5"], verifier=["arithmetic", "maths"])


def test_trl_reward_without_verifier_column_uses_verifier_name_and_answer_column():
    reward = trl_reward_func("arithmetic")
    assert reward(prompts=["p", "p"], completions=["5", "6"], answer=["5", "5"]) == [1.0, 0.0]
    forced = trl_reward_func("math", verifier_column=None)
    assert forced(prompts=["p"], completions=["#### 5"], reference=["5"], verifier=["arithmetic"]) == [1.0]


def test_trl_reward_with_a_pool_scores_only_the_pools_verifier():
    with VerifierPool("arithmetic", workers=1, timeout_s=5.0) as pool:
        reward = trl_reward_func("arithmetic", pool=pool)
        columns = {"reference": ["5", "5"], "verifier": ["arithmetic", "arithmetic"]}
        assert reward(prompts=["p", "p"], completions=["5", "4"], **columns) == [1.0, 0.0]
        with pytest.raises(UserError, match="the pool runs verifier 'arithmetic', but a row names 'math'"):
            reward(prompts=["p", "p"], completions=["5", "4"], reference=["5", "5"], verifier=["arithmetic", "math"])


# ----------------------------------------------------------------------------------------------
# JSON Lines, split selection, errors


def test_jsonl_round_trips_every_column(tmp_path):
    table = problems_table(chat_math=True)
    paths = export_problems(table, "jsonl", tmp_path / "jsonl")
    assert [p.name for p in paths] == ["test.jsonl", "train.jsonl"]
    loaded = load(paths[0], tmp_path) + load(paths[1], tmp_path)
    expected = sorted(table.to_pylist(), key=lambda row: (row["split"], row["problem_id"]))
    assert loaded == expected
    assert list(loaded[0]) == PROBLEMS_SCHEMA.names


@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_split_selection_writes_only_that_split(tmp_path, fmt):
    paths = export_problems(problems_table(), fmt, tmp_path / fmt, split="test")
    assert [p.name for p in sorted((tmp_path / fmt).iterdir())] == [paths[0].name]
    assert paths[0].stem == "test"


def test_unknown_split_format_and_missing_column_are_user_errors(tmp_path):
    table = problems_table()
    with pytest.raises(UserError, match=r"^no problems in split 'warmup'; splits present: test, train$"):
        export_problems(table, "verl", tmp_path, split="warmup")
    with pytest.raises(UserError, match=r"^no problems in split ''; splits present: test, train$"):
        export_problems(table, "trl", tmp_path, split="")
    with pytest.raises(UserError, match=r"^unknown export format 'csv'; choose one of: verl, trl, jsonl$"):
        export_problems(table, "csv", tmp_path)
    with pytest.raises(UserError, match=r"lacks column\(s\) verifier needed for trl export"):
        export_problems(table.drop_columns(["verifier"]), "trl", tmp_path)
    unknown = table.set_column(8, "verifier", pa.array(["arithmetic", "maths", "math", "reasoning_gym"]))
    with pytest.raises(UserError, match=r"^unknown verifier\(s\) 'maths'; registered: arithmetic, "):
        export_problems(unknown, "verl", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_chat_messages_tells_chats_from_text():
    assert chat_messages(MATH_CHAT) == json.loads(MATH_CHAT)
    assert chat_messages("2+3=") is None
    assert chat_messages("[1, 2, 3] sorted is?") is None
    assert chat_messages("[1, 2, 3]") is None
    with pytest.raises(UserError, match="chat prompt message 0 needs a string role and content"):
        chat_messages('[{"role": "user", "content": null}]')
