"""The sql, tool_call, reasoning_gym, format, text and composite verifiers: exact expected values
(partial credit computed by hand in the comments), the safety of the SQL runner (read-only, one
statement, timeouts) and bad input that must come back as a status, never as an exception."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import duckdb
import pytest

from rlvr.errors import UserError
from rlvr.verifiers.base import STATUSES, Score
from rlvr.verifiers.composite import CompositeVerifier, MathFormatVerifier
from rlvr.verifiers.format import FormatVerifier
from rlvr.verifiers.pool import VerifierPool
from rlvr.verifiers.reasoning_gym import ReasoningGymVerifier, extract_answer, rg_problems
from rlvr.verifiers.registry import get_verifier, registered, verifier_class
from rlvr.verifiers.sql import SqlVerifier, extract_sql, has_top_level_order_by, sql_tokens
from rlvr.verifiers.text import TextVerifier, extract_choice, normalize_text
from rlvr.verifiers.tool_call import ToolCallVerifier

# ----------------------------------------------------------------------------------------------
# SQL

USERS = [(1, "ann", 31, 1.5), (2, "bob", 25, 2.25), (3, "cid", 40, 0.1), (4, "dan", 35, None)]
ORDERS = [(10, 1, 9.5), (11, 1, 20.0), (12, 3, 7.25)]
GOLD = "SELECT name FROM users WHERE age > 30"  # ann, cid, dan
SLOW = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r"


@pytest.fixture(scope="module")
def databases(tmp_path_factory):
    """The same two tables in a SQLite file and a DuckDB file, built at test time."""
    folder = tmp_path_factory.mktemp("sql")
    sqlite_path, duckdb_path = folder / "shop.sqlite", folder / "shop.duckdb"
    connection = sqlite3.connect(sqlite_path)
    connection.execute("CREATE TABLE users (id INTEGER, name TEXT, age INTEGER, score REAL)")
    connection.execute("CREATE TABLE orders (id INTEGER, user_id INTEGER, amount REAL)")
    connection.executemany("INSERT INTO users VALUES (?, ?, ?, ?)", USERS)
    connection.executemany("INSERT INTO orders VALUES (?, ?, ?)", ORDERS)
    connection.commit()
    connection.close()
    connection = duckdb.connect(str(duckdb_path))
    connection.execute("CREATE TABLE users (id INTEGER, name VARCHAR, age INTEGER, score DOUBLE)")
    connection.execute("CREATE TABLE orders (id INTEGER, user_id INTEGER, amount DOUBLE)")
    connection.executemany("INSERT INTO users VALUES (?, ?, ?, ?)", USERS)
    connection.executemany("INSERT INTO orders VALUES (?, ?, ?)", ORDERS)
    connection.close()
    return {"sqlite": str(sqlite_path), "duckdb": str(duckdb_path)}


@pytest.fixture(params=["sqlite", "duckdb"])
def db(request, databases):
    return databases[request.param]


def sql_score(response, db, gold=GOLD, **extra):
    return SqlVerifier().score(response, {"db": db, "sql": gold, **extra})


def test_equal_result_from_different_sql_is_ok(db):
    result = sql_score("SELECT u.name FROM users AS u WHERE NOT u.age <= 30 ORDER BY u.name DESC", db)
    assert (result.status, result.value) == ("ok", 1.0)
    assert result.components["execution"] == 1.0 and result.components["syntax"] == 1.0
    assert result.components["schema_linking"] == 1.0  # {name, users, age} on both sides


def test_equivalence_normalises_values(db):
    assert sql_score("SELECT count(*) * 1.0 FROM users", db, "SELECT count(*) FROM users").status == "ok"
    assert sql_score("SELECT 0.1 + 0.2", db, "SELECT 0.3").status == "ok"
    assert sql_score("SELECT 0.30000001", db, "SELECT 0.3").status == "ok"  # same to 7 significant digits
    assert sql_score("SELECT 0.3000001", db, "SELECT 0.3").status == "wrong"
    assert sql_score("SELECT 0.301", db, "SELECT 0.3").status == "wrong"
    assert (
        sql_score("SELECT score FROM users ORDER BY id DESC", db, "SELECT score FROM users").status == "ok"
    )  # NULL == NULL
    joined = "SELECT u.name, sum(o.amount) FROM users u JOIN orders o ON o.user_id = u.id GROUP BY u.name"
    assert (
        sql_score(
            "SELECT name, (SELECT sum(amount) FROM orders WHERE user_id = users.id) AS s FROM users WHERE id IN (1, 3)",
            db,
            joined,
        ).status
        == "ok"
    )


def test_order_matters_only_when_the_gold_orders(db):
    by_age = "SELECT name FROM users ORDER BY age"  # bob ann dan cid
    assert sql_score("SELECT name FROM users ORDER BY name", db, by_age).status == "wrong"
    assert sql_score("SELECT name FROM users ORDER BY name", db, by_age, ordered=False).status == "ok"
    assert sql_score("SELECT name FROM users ORDER BY age, name", db, by_age).status == "ok"
    assert sql_score("SELECT name FROM users ORDER BY name", db, "SELECT name FROM users").status == "ok"
    assert (
        sql_score("SELECT name FROM users", db, "SELECT name FROM users", ordered=True).status == "ok"
    )  # same storage order
    assert has_top_level_order_by(sql_tokens(by_age))
    assert not has_top_level_order_by(sql_tokens("SELECT rank() OVER (ORDER BY age) FROM users"))
    assert not has_top_level_order_by(sql_tokens("SELECT * FROM (SELECT name FROM users ORDER BY age LIMIT 2) t"))


def test_wrong_result_gets_hand_computed_partial_credit(db):
    result = sql_score("SELECT id FROM users WHERE age > 30", db)
    # schema: {id, users, age} vs {name, users, age} -> 2/4.
    # n-grams: 1-grams 7 shared of 9, 2-grams 5 of 9, 3-grams 4 of 8 -> 16/26.
    assert result.status == "wrong"
    assert result.components == {"execution": 0.0, "syntax": 1.0, "schema_linking": 0.5, "ngram": 16 / 26}
    assert result.value == pytest.approx(0.1 * 1 + 0.1 * 0.5 + 0.1 * 16 / 26, abs=1e-12)
    assert result.reason == "different result: 3 rows vs 3 gold rows"
    assert result.extracted == "SELECT id FROM users WHERE age > 30"


def test_syntax_error_is_wrong_with_text_credit_only(db):
    result = sql_score("SELECT name FROM users WHERE", db)
    # schema {name, users} vs {name, users, age} -> 2/3; n-grams: 5+4+3 = 12 shared, 8+7+6 = 21 in the union.
    assert result.status == "wrong"
    assert result.components == {"execution": 0.0, "syntax": 0.0, "schema_linking": 2 / 3, "ngram": 12 / 21}
    assert result.value == pytest.approx(0.1 * 2 / 3 + 0.1 * 12 / 21, abs=1e-12)
    assert result.reason.startswith("predicted SQL failed: ")
    missing_column = sql_score("SELECT nme FROM users", db)
    assert missing_column.status == "wrong" and missing_column.components["syntax"] == 0.0


@pytest.mark.parametrize(
    "response",
    [
        "SELECT 1; DROP TABLE users",
        "DROP TABLE users",
        "DELETE FROM users",
        "WITH gone AS (SELECT 1) DELETE FROM users",
        "INSERT INTO users VALUES (9, 'eve', 1, 1.0)",
        "PRAGMA writable_schema = 1",
        "ATTACH DATABASE 'other.db' AS other",
    ],
)
def test_writes_and_several_statements_are_refused_and_the_db_is_unchanged(db, response):
    result = sql_score(response, db)
    assert (result.status, result.value) == ("wrong", 0.0)
    assert result.components["syntax"] == 0.0
    assert result.reason.startswith("not run: ")
    assert sql_score("SELECT count(*) FROM users", db, "SELECT 4").status == "ok"


def test_duckdb_cannot_read_other_files(databases):
    result = sql_score("SELECT * FROM read_csv('/etc/passwd')", databases["duckdb"])
    assert result.status == "wrong" and "PermissionException" in result.reason


@pytest.mark.serial  # the query must time out within its limit
def test_slow_query_times_out_within_its_limit(databases):
    started = time.monotonic()
    result = sql_score(SLOW, databases["sqlite"])  # default limit: 2 s
    assert time.monotonic() - started < 3.0
    assert (result.status, result.value) == ("timeout", 0.0)
    started = time.monotonic()
    result = sql_score(SLOW, databases["duckdb"], timeout_s=0.5)
    assert time.monotonic() - started < 1.5
    assert (result.status, result.value) == ("timeout", 0.0)
    gold_slow = SqlVerifier().score("SELECT 1", {"db": databases["sqlite"], "sql": SLOW, "timeout_s": 0.3})
    assert gold_slow.status == "timeout" and gold_slow.reason.startswith("gold SQL timed out")


def test_extraction_takes_the_last_sql_block():
    assert extract_sql("```sql\nSELECT 1\n```\nthen\n```sql\nSELECT 2\n```") == "SELECT 2"
    assert extract_sql("```sql\nSELECT 1\n```\n```\nSELECT 3\n```") == "SELECT 1"
    assert extract_sql("```\nSELECT 3\n```") == "SELECT 3"
    assert extract_sql("  SELECT 4  ") == "SELECT 4"


def test_sql_bad_references_and_empty_answers(db, tmp_path):
    verifier = SqlVerifier()
    missing = verifier.score("SELECT 1", {"db": str(tmp_path / "nope.sqlite"), "sql": "SELECT 1"})
    assert missing.status == "error" and "not found" in missing.reason
    assert verifier.score("SELECT 1", {"db": db}).status == "error"
    assert verifier.score("SELECT 1", "not json").status == "error"
    assert verifier.score("SELECT 1", {"db": str(tmp_path / "x.csv"), "sql": "SELECT 1"}).status == "error"
    assert verifier.score("SELECT 1", {"db": db, "sql": "DROP TABLE users"}).status == "error"
    assert verifier.score("SELECT 1", {"db": db, "sql": "SELECT nothing FROM nowhere"}).status == "error"
    assert verifier.score("SELECT 1", {"db": db, "sql": "SELECT 1", "ordered": "yes"}).status == "error"
    as_json = verifier.score("```sql\nSELECT 1\n```", json.dumps({"db": db, "sql": "SELECT 1"}))
    assert as_json.status == "ok"
    renamed = tmp_path / "shop.data"
    renamed.write_bytes(Path(db).read_bytes())
    dialect = "duckdb" if db.endswith(".duckdb") else "sqlite"
    assert verifier.score("SELECT 2", {"db": str(renamed), "sql": "SELECT 2", "dialect": dialect}).status == "ok"
    for empty in ("", "   ", "```sql\n```"):
        assert verifier.score(empty, {"db": db, "sql": "SELECT 1"}).status == "unparseable"


def test_sql_runs_in_the_pool(databases):
    reference = {"db": databases["duckdb"], "sql": GOLD, "timeout_s": 0.5}
    with VerifierPool("sql", workers=1, timeout_s=10.0) as pool:
        results = pool.score_many([("SELECT name FROM users WHERE age >= 31", reference), (SLOW, reference)])
    assert [r.status for r in results] == ["ok", "timeout"]


# ----------------------------------------------------------------------------------------------
# Tool calls

GOLD_CALLS = [
    {"name": "search", "arguments": {"query": "cats", "limit": 5}},
    {"name": "weather", "arguments": {"city": "Paris"}},
]


def tool_score(calls, reference=GOLD_CALLS):
    response = calls if isinstance(calls, str) else f"<tool_call>{json.dumps(calls)}</tool_call>"
    return ToolCallVerifier().score(response, reference)


def test_exact_calls_score_one():
    result = tool_score(GOLD_CALLS)
    assert (result.status, result.value) == ("ok", 1.0)
    assert result.components == {"r_format": 1.0, "r_name": 1.0, "r_param": 2.0, "r_value": 3.0, "r_correct": 3.0}


def test_partial_match_hand_computed():
    # Names equal (r_name 1); search matches fully (keys 1, values 2); weather has key "town" not
    # "city" (keys 0, values 0). S_max = 1 + 2 + 3 = 6; R_correct = 6 * (1 + 1 + 2) / 6 - 3 = 1.
    result = tool_score([GOLD_CALLS[0], {"name": "weather", "arguments": {"town": "Paris"}}])
    assert result.status == "wrong"
    assert result.components == {"r_format": 1.0, "r_name": 1.0, "r_param": 1.0, "r_value": 2.0, "r_correct": 1.0}
    assert result.value == pytest.approx((1 + 1 + 3) / 7, abs=1e-12)


def test_wrong_tool_name_hand_computed():
    # Names {search, forecast} vs {search, weather}: 1/3; only search matches (keys 1, values 2).
    # R_correct = 6 * (1/3 + 1 + 2) / 6 - 3 = 1/3; value = (1 + 1/3 + 3) / 7 = 13/21.
    result = tool_score([GOLD_CALLS[0], {"name": "forecast", "arguments": {"city": "Paris"}}])
    assert result.components["r_name"] == pytest.approx(1 / 3)
    assert result.components["r_correct"] == pytest.approx(1 / 3)
    assert result.value == pytest.approx(13 / 21)


def test_values_are_compared_exactly_and_extra_calls_cost():
    result = tool_score([{"name": "search", "arguments": {"query": "cats", "limit": "5"}}, GOLD_CALLS[1]])
    assert result.components["r_value"] == 2.0 and result.status == "wrong"
    extra = tool_score(GOLD_CALLS + [{"name": "weather", "arguments": {"city": "Rome"}}])
    # names: multiset {search, weather, weather} vs {search, weather}: 2/3; both gold calls match fully.
    assert extra.components["r_name"] == pytest.approx(2 / 3)
    assert extra.components["r_correct"] == pytest.approx(6 * (2 / 3 + 2 + 3) / 6 - 3)
    assert extra.status == "wrong"
    flag = tool_score([{"name": "f", "arguments": {"x": 1}}], [{"name": "f", "arguments": {"x": True}}])
    assert flag.components["r_value"] == 0.0


def test_response_shapes():
    verifier = ToolCallVerifier()
    fenced = "I will call:\n```json\n" + json.dumps(GOLD_CALLS) + "\n```"
    assert verifier.score(fenced, GOLD_CALLS).status == "ok"
    two_tags = "".join(f"<tool_call>\n{json.dumps(call)}\n</tool_call>\n" for call in GOLD_CALLS)
    assert verifier.score(two_tags, json.dumps(GOLD_CALLS)).status == "ok"
    openai = [
        {"type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
        for c in GOLD_CALLS
    ]
    assert verifier.score(json.dumps(openai), GOLD_CALLS).status == "ok"
    parameters = [{"name": c["name"], "parameters": c["arguments"]} for c in GOLD_CALLS]
    assert verifier.score(json.dumps(parameters), GOLD_CALLS).status == "ok"
    single = verifier.score(json.dumps(GOLD_CALLS[1]), GOLD_CALLS[1])
    assert (single.status, single.value) == ("ok", 1.0)


def test_malformed_and_missing_calls():
    malformed = tool_score([GOLD_CALLS[0], GOLD_CALLS[1], {"arguments": {}}])
    assert malformed.components["r_format"] == 0.0 and malformed.status == "wrong"
    assert malformed.value == pytest.approx((0 + 3 + 3) / 7)
    for text in ("I would search for cats.", "<tool_call>{not json</tool_call>", ""):
        result = tool_score(text)
        assert (result.status, result.value) == ("unparseable", 0.0)
        assert result.components["r_correct"] == -3.0
    no_call_expected = tool_score("No tool is needed: it is sunny.", [])
    assert (no_call_expected.status, no_call_expected.value) == ("ok", 1.0)
    assert tool_score("[]", []).status == "ok"
    assert tool_score(GOLD_CALLS, [{"arguments": {}}]).status == "error"
    assert tool_score(GOLD_CALLS, "{bad").status == "error"


# ----------------------------------------------------------------------------------------------
# reasoning-gym

RG_DATASETS = ["basic_arithmetic", "chain_sum", "spell_backward", "word_sorting", "letter_counting", "gcd"]


@pytest.fixture(scope="module")
def rg_rows():
    return {name: rg_problems(name, count=3, seed=7) for name in RG_DATASETS}


@pytest.mark.parametrize("dataset", RG_DATASETS)
def test_reasoning_gym_true_answer_scores_one_and_wrong_zero(rg_rows, dataset):
    verifier = ReasoningGymVerifier()
    for row in rg_rows[dataset]:
        answer = row["reference"]["entry"]["answer"]
        right = verifier.score(f"<think>working</think>\n<answer>{answer}</answer>", row["reference"])
        assert (right.status, right.value, right.components) == ("ok", 1.0, {"rg_score": 1.0})
        assert right.extracted == answer
        wrong = verifier.score("<answer>no idea</answer>", json.dumps(row["reference"]))
        assert (wrong.status, wrong.value) == ("wrong", 0.0)
        assert wrong.components["rg_score"] < 1.0


def test_reasoning_gym_substring_partial_credit_is_not_rewarded(rg_rows):
    verifier = ReasoningGymVerifier()
    for dataset in ("basic_arithmetic", "gcd", "letter_counting"):  # datasets on the default scorer
        reference = rg_rows[dataset][0]["reference"]
        answer = reference["entry"]["answer"]
        padded = f"{answer} or maybe 12345"
        result = verifier.score(f"<answer>{padded}</answer>", reference)
        assert result.components["rg_score"] == pytest.approx(len(answer) / len(padded))  # reasoning-gym's credit
        assert 0 < result.components["rg_score"] < 1
        assert (result.status, result.value) == ("wrong", 0.0)


def test_reasoning_gym_extraction_and_references(rg_rows):
    verifier = ReasoningGymVerifier()
    reference = rg_rows["chain_sum"][0]["reference"]
    answer = reference["entry"]["answer"]
    assert verifier.score(f"Let me add.\nSo:\n{answer}\n\n", reference).status == "ok"
    assert extract_answer("a\n<answer> 1 </answer>\n<answer>2</answer>\ntrailing") == "2"
    assert extract_answer("  \n ") is None
    assert verifier.score("", reference).status == "unparseable"
    assert verifier.score("<answer> </answer>", reference).status == "unparseable"
    no_name = {"entry": reference["entry"]}  # the dataset comes from metadata.source_dataset
    assert verifier.score(answer, no_name).status == "ok"
    assert verifier.score(answer, {"dataset": "no_such_gym", "entry": reference["entry"]}).status == "error"
    assert verifier.score(answer, {"dataset": "chain_sum"}).status == "error"
    assert verifier.score(answer, "not json").status == "error"


def test_rg_problems_are_prompt_reference_rows_and_deterministic(rg_rows):
    rows = rg_rows["basic_arithmetic"]
    assert len(rows) == 3
    assert set(rows[0]) == {"prompt", "reference"}
    assert rows[0]["prompt"] == rows[0]["reference"]["entry"]["question"]
    assert rows[0]["reference"]["dataset"] == "basic_arithmetic"
    assert rg_problems("basic_arithmetic", count=3, seed=7) == rows
    assert rg_problems("basic_arithmetic", count=3, seed=8) != rows
    json.dumps(rows)  # storable as is


# ----------------------------------------------------------------------------------------------
# Format

CLEAN = "<think>\nreasoning\n</think>\n<answer>42</answer>\n"


def test_exact_structure_scores_one():
    result = FormatVerifier().score(CLEAN, None)
    assert (result.status, result.value, result.extracted) == ("ok", 1.0, "42")
    assert result.components == {"think": 1.0, "answer": 1.0, "order": 1.0, "outside": 1.0, "structured": 1.0}


@pytest.mark.parametrize(
    "response, think, answer, order, outside, value",
    [
        ("preamble " + CLEAN, 1, 1, 1, 0, 0.5),
        ("<answer>42</answer><think>x</think>", 1, 1, 0, 1, 0.5),
        ("<think>x</think> the answer is 42", 1, 0, 0, 0, 0.25),
        ("<think>x <answer>42</answer></think>", 1, 1, 0, 0, 0.5),
        ("<think>x</think><think>y</think><answer>42</answer>", 0, 1, 0, 1, 0.25),
        ("<think>x<answer>42</answer>", 0, 1, 0, 0, 0.25),
        ("just 42", 0, 0, 0, 0, 0.0),
    ],
)
def test_format_partial_components(response, think, answer, order, outside, value):
    result = FormatVerifier().score(response, None)
    assert result.status == "wrong"
    assert result.components == {
        "think": think,
        "answer": answer,
        "order": order,
        "outside": outside,
        "structured": 0.0,
    }
    assert result.value == value


def test_format_options():
    verifier = FormatVerifier()
    twice = "<think>x</think><think>y</think><answer>42</answer>"
    assert verifier.score(twice, {"exactly_once": False}).status == "ok"
    reversed_order = "<answer>42</answer>\n<think>x</think>"
    unordered = verifier.score(reversed_order, json.dumps({"require_order": False}))
    assert unordered.status == "ok" and "order" not in unordered.components
    custom = verifier.score("<reasoning>r</reasoning><final>5</final>", {"tags": ["reasoning", "final"]})
    assert (custom.status, custom.extracted) == ("ok", "5")
    assert verifier.score("<answer>5</answer>", {"tags": ["answer"]}).status == "ok"
    assert verifier.score("", None).status == "unparseable"
    assert verifier.score("  \n", {}).status == "unparseable"
    assert verifier.score(CLEAN, {"tag": ["x"]}).status == "error"
    assert verifier.score(CLEAN, {"tags": []}).status == "error"
    assert verifier.score(CLEAN, {"tags": ["a>b"]}).status == "error"
    assert verifier.score(CLEAN, "[1, 2]").status == "error"


# ----------------------------------------------------------------------------------------------
# Text


def test_exact_mode_normalises():
    verifier = TextVerifier()
    assert normalize_text("  The Eiffel   Tower! ") == "eiffel tower"
    assert verifier.score("the Eiffel tower.", "Eiffel Tower").status == "ok"
    assert verifier.score("<answer>An apple</answer> and more", {"answer": "apple"}).status == "ok"
    assert verifier.score("Paris", {"mode": "exact", "answer": ["Paris, France", "paris"]}).status == "ok"
    wrong = verifier.score("Lyon", "Paris")
    assert (wrong.status, wrong.value, wrong.components) == ("wrong", 0.0, {"exact": 0.0})
    assert verifier.score("   ", "Paris").status == "unparseable"
    assert verifier.score("Paris", json.dumps({"mode": "exact", "answer": "paris"})).status == "ok"


@pytest.mark.parametrize(
    "response, letter",
    [
        ("(B)", "B"),
        ("B", "B"),
        ("B.", "B"),
        ("Answer: B", "B"),
        ("The answer is (C) because a bird is not a fish.", "C"),
        ("I compared (A) and (D).\nthe answer is D", "D"),
        ("Thinking about a and b...\nFinal answer: option A", "A"),
        ("Options (A) and (B) fail, so\nC. 42 metres", "C"),
        ("It must be (D)", "D"),
        ("<answer>(A)</answer> although (B) is tempting", "A"),
        ("a bad answer", None),
        ("Answer: because", None),
    ],
)
def test_choice_extraction(response, letter):
    assert extract_choice(response) == letter


def test_choice_mode():
    verifier = TextVerifier()
    right = verifier.score("The answer is (B).", {"mode": "choice", "answer": "B"})
    assert (right.status, right.value, right.extracted) == ("ok", 1.0, "B")
    assert verifier.score("Answer: b", {"mode": "choice", "answer": "(b)"}).status == "unparseable"
    assert verifier.score("Answer: B", {"mode": "choice", "answer": "(b)"}).status == "ok"
    assert verifier.score("Answer: C", {"mode": "choice", "answer": "B"}).status == "wrong"
    assert verifier.score("B", {"mode": "choice", "answer": "BB"}).status == "error"


def test_bleu_mode():
    verifier = TextVerifier()
    same = verifier.score("the cat sat on the mat", {"mode": "bleu", "references": ["the cat sat on the mat"]})
    assert (same.status, same.value, same.components) == ("ok", 1.0, {"bleu": 1.0})
    # precisions 5/6, 3/5, 2/4, 1/3, equal lengths (no brevity penalty): BLEU = (1/12) ** (1/4)
    near = verifier.score("the cat sat on the mat", {"mode": "bleu", "references": ["the cat sat on a mat"]})
    assert near.value == pytest.approx((1 / 12) ** 0.25, abs=1e-9)
    assert near.status == "ok"  # 0.537 >= default threshold 0.5
    strict = verifier.score(
        "the cat sat on the mat", {"mode": "bleu", "answer": "the cat sat on a mat", "threshold": 0.6}
    )
    assert (strict.status, strict.value) == ("wrong", near.value)
    several = verifier.score(
        "the cat sat on the mat", {"mode": "bleu", "references": ["a dog", "the cat sat on the mat"]}
    )
    assert several.value == 1.0
    assert verifier.score("", {"mode": "bleu", "references": ["x"]}).status == "unparseable"
    assert verifier.score("x", {"mode": "bleu", "references": []}).status == "error"
    assert verifier.score("x", {"mode": "bleu", "references": ["x"], "threshold": 50}).status == "error"
    assert verifier.score("x", {"mode": "rouge", "answer": "x"}).status == "error"


# ----------------------------------------------------------------------------------------------
# Composites


def test_weighted_composite_keeps_components():
    verifier = CompositeVerifier.from_spec(
        {
            "name": "math+format",
            "components": [{"verifier": "math", "weight": 0.9}, {"verifier": "format", "weight": 0.1, "gate": False}],
        },
        verifier_class,
    )
    assert (verifier.name, verifier.domain, verifier.version) == ("math+format", "math", "1+math.2+format.1")
    clean = verifier.score("<think>6*7</think><answer>42</answer>", "42")
    assert (clean.status, clean.value) == ("ok", pytest.approx(1.0))
    unformatted = verifier.score("The answer is 42", {"math": "42"})
    assert (unformatted.status, unformatted.value) == ("ok", pytest.approx(0.9))
    assert unformatted.components["math.correct"] == 1.0 and unformatted.components["math.value"] == 1.0
    assert unformatted.components["format.think"] == 0.0 and unformatted.components["format.value"] == 0.0
    half = verifier.score("<think>6*7</think> so 41", "42")  # math wrong; format 0.5 * 1/2
    assert (half.status, half.value) == ("wrong", pytest.approx(0.1 * 0.25))


def test_gated_composite():
    verifier = get_verifier("math_format")
    assert isinstance(verifier, MathFormatVerifier)
    assert (verifier.name, verifier.domain, verifier.version) == ("math_format", "math", "1+math.2+format.1")
    assert verifier.score("<think>6*7</think>\n<answer>42</answer>", "42").value == 1.0
    gated = verifier.score("<think>6*7</think>\n<answer>42</answer> done", "42")
    assert (gated.status, gated.value) == ("wrong", 0.0)
    assert gated.components["math.correct"] == 1.0 and gated.components["format.outside"] == 0.0
    assert "gated to 0 by format" in gated.reason
    wrong = verifier.score("<think>6*7</think>\n<answer>41</answer>", "42")
    assert (wrong.status, wrong.value) == ("wrong", 0.0)
    keyed = verifier.score("<answer>42</answer>", json.dumps({"math": "42", "format": {"tags": ["answer"]}}))
    assert (keyed.status, keyed.value) == ("ok", 1.0)
    assert verifier.score("<think>x</think><answer>42</answer>", {"math": None}).status == "error"


def test_composite_spec_errors():
    for spec in (
        {"name": "x", "components": []},
        {"name": "x", "components": [{"verifier": "format", "gate": True}, {"verifier": "math"}]},
        {"name": "x", "components": [{"verifier": "math"}, {"verifier": "format", "gate": True, "weight": 0.1}]},
        {"name": "x", "components": [{"verifier": "math"}, {"verifier": "math"}]},
        {"name": "x", "components": [{"verifier": "maths"}]},
        {"name": "x", "components": [{"verifier": "math", "wieght": 1}]},
        {"components": [{"verifier": "math"}]},
    ):
        with pytest.raises(UserError):
            CompositeVerifier.from_spec(spec, verifier_class)


# ----------------------------------------------------------------------------------------------
# All verifiers: registered, and bad input is a status, never an exception

MINE = ["sql", "tool_call", "reasoning_gym", "format", "text", "math_format"]


@pytest.fixture(scope="module")
def valid_references(databases, rg_rows):
    return {
        "sql": {"db": databases["sqlite"], "sql": GOLD},
        "sql_duckdb": {"db": databases["duckdb"], "sql": GOLD},
        "tool_call": GOLD_CALLS,
        "reasoning_gym": rg_rows["spell_backward"][0]["reference"],
        "format": None,
        "text": {"mode": "bleu", "references": ["a b c d"]},
        "text_choice": {"mode": "choice", "answer": "A"},
        "math_format": "42",
    }


def test_registered_with_names_and_versions():
    names = registered()
    for name in MINE:
        assert names[name].name == name and names[name].version.startswith("1")
        assert isinstance(get_verifier(name), names[name])


BAD_RESPONSES = [
    None,
    42,
    b"SELECT 1",
    ["x"],
    "",
    "\x00",
    "SELECT '\x00'",
    "\ud800",
    "SELECT '\ud800'",
    "```sql\nSELECT '\ud800\x00'\n```",
    "<tool_call>\ud800</tool_call>",
    "<answer>\ud800\x00</answer>",
    "<think>\x00</think><answer>\ud800</answer>",
    "[" * 5000,
    "(" * 5000 + "B",
    "x" * 100_000,
]
BAD_REFERENCES = [None, 42, "", "\ud800", "{not json", {"x": 1}, [], [1, 2], "\x00"]


@pytest.mark.parametrize(
    "key", ["sql", "sql_duckdb", "tool_call", "reasoning_gym", "format", "text", "text_choice", "math_format"]
)
def test_bad_input_never_raises(valid_references, key):
    name = key.split("_duckdb")[0].split("_choice")[0]
    verifier = get_verifier(name)
    for response in BAD_RESPONSES:
        result = verifier.score(response, valid_references[key])
        assert isinstance(result, Score) and result.status in STATUSES, (key, response)
        assert 0.0 <= result.value <= 1.0
        if not isinstance(response, str):
            assert result.status == "error"
    for reference in BAD_REFERENCES:
        result = verifier.score("SELECT 1", reference)
        assert isinstance(result, Score) and result.status in STATUSES, (key, reference)
