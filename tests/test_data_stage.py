"""The data stages: malformed input quarantined with reasons (the invariant holds), planted duplicates,
`rlvr data` / `rlvr difficulty` / `rlvr export` from the command line, difficulty on planted problems, and the
difficulty stage's verdicts (its reward_cache artifact) the same after a crash inside it."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import yaml

from rlvr.flows.config import load_config
from rlvr.storage.stage import run_stage
from rlvr.storage.store import Store
from rlvr.storage.views import query
from rlvr.tasks.synthesize import SYNTHESIZE
from tests.cli_helpers import rlvr

GOOD = {"prompt": "What is 2 + 3?", "answer": "5"}
BIG_PROMPT = "x" * (10 * 1024 * 1024)


def write_malformed_jsonl(path: Path) -> None:
    lines = [
        json.dumps(GOOD).encode(),  # 0 accepted
        json.dumps({"answer": "3"}).encode(),  # 1 missing prompt
        json.dumps({"prompt": 42, "answer": "1"}).encode(),  # 2 wrong type
        json.dumps({"prompt": "   ", "answer": "1"}).encode(),  # 3 empty prompt
        json.dumps({"id": "a", "prompt": "What is 7 * 6?", "answer": "42"}).encode(),  # 4 accepted
        json.dumps({"id": "a", "prompt": "What is 9 - 4?", "answer": "5"}).encode(),  # 5 duplicate id
        b'{"prompt": "caf\xe9 au lait?", "answer": "1"}',  # 6 non-UTF-8 bytes
        json.dumps({"prompt": BIG_PROMPT, "answer": "1"}).encode(),  # 7 a 10 MB prompt
        json.dumps({"prompt": "Simplify the fraction.", "answer": "\\frac{"}).encode(),  # 8 unparseable reference
        json.dumps({"prompt": "What is 1 + 1?", "answer": "2", "verifier": "nope"}).encode(),  # 9 unknown verifier
        b'{"prompt": "broken", "answer": ',  # 10 not JSON
        json.dumps({"prompt": "What  is 2 + 3?", "answer": "5"}).encode(),  # 11 exact duplicate of 0
        json.dumps({"prompt": "Name the capital of France.", "reference": None}).encode(),  # 12 missing reference
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")


def write_malformed_csv(path: Path) -> None:
    path.write_bytes(
        b"prompt,answer\n"
        b'"What is 10 + 5?",15\n'  # 0 accepted
        b'"What is 3 + 4?,7\n'  # 1 broken quote
        b'"What is 6 * 7?",42\n'  # 2 accepted: the line after the broken quote is read
        b"What is 8 - 2?,6,extra\n"  # 3 wrong field count
        b"What is 12 / 4?,3\n"  # 4 accepted
    )


EXPECTED_CHECKS = {
    ("jsonl", "read"): 2,  # non-UTF-8, not JSON
    ("jsonl", "fields"): 3,  # missing prompt, a prompt that is a number, missing reference
    ("jsonl", "prompt"): 2,  # empty, 10 MB
    ("jsonl", "id"): 1,
    ("jsonl", "parse"): 1,
    ("jsonl", "verifier"): 1,
    ("csv", "read"): 2,  # broken quote, wrong field count
}


@pytest.fixture(scope="module")
def malformed_run(tmp_path_factory, rlvr_forks):
    """`rlvr data --config` over a malformed JSONL and a malformed CSV (the math verifier by default), on the
    session's Prefect server (a temporary one of its own costs 13 CPU-seconds, mostly its database's migrations)."""
    folder = tmp_path_factory.mktemp("malformed")
    write_malformed_jsonl(folder / "bad.jsonl")
    write_malformed_csv(folder / "bad.csv")
    config = {
        "synthesize": {
            "sources": [
                {"type": "file", "name": "jsonl", "path": str(folder / "bad.jsonl")},
                {"type": "file", "name": "csv", "path": str(folder / "bad.csv")},
            ],
            "test_fraction": 0.0,
            "warmup_fraction": 0.0,
        }
    }
    (folder / "data.yaml").write_text(yaml.safe_dump(config))
    store = folder / "store"
    done = rlvr(
        "data", "--config", str(folder / "data.yaml"), "--store", str(store), "--run-id", "bad",
        forks=rlvr_forks,
    )  # fmt: skip
    return done, Store.open(str(store))


def test_malformed_rows_are_quarantined_and_the_command_exits_0(malformed_run):
    done, store = malformed_run
    assert done.returncode == 0, done.stderr[-2000:]
    checks = query(
        store, "SELECT source, failed_check AS check_, count(*) AS n FROM quarantine GROUP BY ALL"
    ).to_pylist()
    assert {(r["source"], r["check_"]): r["n"] for r in checks} == EXPECTED_CHECKS
    # the printed summary: one line per source with read, accepted, quarantined, ..., duplicates
    lines = {line.split("│")[1].strip(): line for line in done.stdout.splitlines() if line.count("│") > 6}
    assert [c.strip() for c in lines["jsonl"].split("│")[2:5]] == ["13", "2", "10"]
    assert [c.strip() for c in lines["csv"].split("│")[2:5]] == ["5", "3", "2"]
    assert "rows read 18 = accepted 5 + quarantined 12 + duplicates 1" in done.stdout


def test_invariant_rows_read_equal_accepted_quarantined_duplicates(malformed_run):
    _, store = malformed_run
    per_source = query(
        store,
        """SELECT s.source, s.n AS accepted, coalesce(q.n, 0) AS quarantined, coalesce(d.n, 0) AS duplicates
           FROM (SELECT source, count(*) AS n FROM problems GROUP BY 1) s
           LEFT JOIN (SELECT source, count(*) AS n FROM quarantine GROUP BY 1) q USING (source)
           LEFT JOIN (SELECT source, count(*) AS n FROM duplicates GROUP BY 1) d USING (source)
           ORDER BY 1""",
    ).to_pylist()
    assert per_source == [
        {"source": "csv", "accepted": 3, "quarantined": 2, "duplicates": 0},
        {"source": "jsonl", "accepted": 2, "quarantined": 10, "duplicates": 1},
    ]
    duplicate = query(store, "SELECT kind, similarity, source_index FROM duplicates").to_pylist()
    assert duplicate == [{"kind": "exact", "similarity": 1.0, "source_index": 11}]


def test_quarantine_reasons_say_what_is_wrong(malformed_run):
    _, store = malformed_run
    rows = query(store, "SELECT source_index, reason FROM quarantine WHERE source = 'jsonl' ORDER BY 1").to_pylist()
    reasons = {r["source_index"]: r["reason"] for r in rows}
    assert reasons[1] == "missing field 'prompt'"
    assert reasons[2] == "field 'prompt' must be a string or a list of {role, content} messages, got int"
    assert reasons[3] == "empty prompt"
    assert reasons[5] == "duplicate id 'a' (first at record 4)"
    assert reasons[6].startswith("line 7 is not UTF-8 (byte 0xe9")
    assert reasons[7] == f"prompt is {len(BIG_PROMPT)} characters; the limit (synthesize.max_prompt_chars) is 8192"
    assert reasons[8].startswith("math: reference '\\\\frac{' could not be parsed")
    assert reasons[9].startswith("unknown verifier 'nope'; registered: ")
    assert reasons[10].startswith("line 11 is not JSON")
    assert reasons[12] == "missing field 'reference' (looked for 'reference' and 'answer')"
    row_json = query(store, "SELECT row_json FROM quarantine WHERE source_index = 7").to_pylist()[0]["row_json"]
    assert len(row_json) < 10_000  # the 10 MB prompt is not copied into the quarantine


def planted_rows() -> list[dict[str, str]]:
    """40 distinct word problems, 6 exact duplicates, 4 near duplicates, 3 template siblings."""
    items = ["apples", "pencils", "marbles", "stamps", "coins", "books", "shells", "cards"]
    people = ["Ava", "Ben", "Cleo", "Dan", "Eli"]
    rows = [
        {
            "prompt": f"{person} has {3 + i} boxes of {item}, and every box holds {5 + j} {item}. "
            f"How many {item} does {person} have altogether?",
            "answer": str((3 + i) * (5 + j)),
        }
        for i, item in enumerate(items)
        for j, person in enumerate(people)
    ]
    exact = [{**rows[k], "prompt": rows[k]["prompt"].upper().replace(" ", "  ")} for k in (0, 5, 10, 15, 20, 25)]
    near = [
        {**rows[k], "prompt": rows[k]["prompt"].replace("altogether", "in total, altogether")} for k in (1, 7, 13, 19)
    ]
    siblings = [{**rows[k], "prompt": rows[k]["prompt"].replace("boxes", "crates"), "answer": "1"} for k in (2, 8, 14)]
    return rows + exact + near + siblings


def test_planted_duplicates_are_counted_exactly(tmp_path):
    path = tmp_path / "planted.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in planted_rows()))
    cfg = load_config(
        None,
        [
            f"synthesize.sources=[{{type: file, name: planted, path: '{path}'}}]",
            "synthesize.near_duplicates.threshold=0.7",
        ],
    )
    store = Store.open(str(tmp_path / "store"), create=True)
    made = run_stage(store, SYNTHESIZE, cfg.synthesize, run_id="planted")
    kinds = query(store, "SELECT kind, count(*) AS n FROM duplicates GROUP BY 1 ORDER BY 1").to_pylist()
    assert kinds == [{"kind": "exact", "n": 6}, {"kind": "near", "n": 4}]
    assert store.manifest(made.ids["problems"]).rows == 40 + 3
    merged = query(
        store,
        """SELECT d.source_index, p.source_index AS kept FROM duplicates d
           JOIN problems p ON p.problem_id = d.duplicate_of ORDER BY 1""",
    ).to_pylist()
    assert [(r["source_index"], r["kept"]) for r in merged] == [
        (40, 0), (41, 5), (42, 10), (43, 15), (44, 20), (45, 25), (46, 1), (47, 7), (48, 13), (49, 19)
    ]  # fmt: skip


def test_contaminated_rows_are_dropped_and_reported(tmp_path):
    rows = planted_rows()[:10]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"prompt": "Quiz: " + rows[3]["prompt"], "answer": "0"}) + "\n")
    cfg = load_config(
        None,
        [
            f"synthesize.sources=[{{type: file, name: train, path: '{tmp_path / 'train.jsonl'}'}}]",
            f"synthesize.decontaminate.eval_sets=[{{type: file, name: quiz, path: '{tmp_path / 'eval.jsonl'}'}}]",
        ],
    )
    store = Store.open(str(tmp_path / "store"), create=True)
    made = run_stage(store, SYNTHESIZE, cfg.synthesize, run_id="decon")
    quarantined = query(store, "SELECT source_index, failed_check, reason FROM quarantine").to_pylist()
    assert [(r["source_index"], r["failed_check"]) for r in quarantined] == [(3, "contaminated")]
    assert "with eval set 'quiz' (row 0)" in quarantined[0]["reason"]
    assert store.manifest(made.ids["problems"]).extra["counts"]["train"]["contaminated"] == 1


def test_weighted_sources_share_the_size(tmp_path):
    cfg = load_config(
        None,
        [
            "synthesize.size=30",
            "synthesize.sources=[{type: arithmetic, weight: 2, count: 100}, {type: skills, weight: 1}]",
        ],
    )
    store = Store.open(str(tmp_path / "store"), create=True)
    made = run_stage(store, SYNTHESIZE, cfg.synthesize, run_id="weights")
    counts = store.manifest(made.ids["problems"]).extra["counts"]
    assert {name: c["read"] for name, c in counts.items()} == {"arithmetic": 20, "skills": 10}


def test_a_source_can_split_its_own_way(tmp_path):
    """Products only for the warm start, three-term problems only for training and test: per-source fractions."""
    products = "{type: arithmetic, name: products, ops: '*', count: 40, warmup_fraction: 1.0, test_fraction: 0}"
    mixed = "{type: arithmetic, name: mixed, terms: 3, count: 50, warmup_fraction: 0}"
    cfg = load_config(None, [f"synthesize.sources=[{products}, {mixed}]", "synthesize.test_fraction=0.2"])
    store = Store.open(str(tmp_path / "store"), create=True)
    made = run_stage(store, SYNTHESIZE, cfg.synthesize, run_id="splits")
    sql = "SELECT source, split, count(*) AS n FROM problems GROUP BY ALL ORDER BY ALL"
    assert [tuple(r.values()) for r in query(store, sql).to_pylist()] == [
        ("mixed", "test", 10),
        ("mixed", "train", 40),
        ("products", "warmup", 40),
    ]
    assert "warmup_fraction" not in load_config(None, []).synthesize.model_dump()["sources"][0]  # ids stay
    assert made.ids["problems"]


MATH_FILE = [
    {
        "question": "Compute $\\frac{1}{2} + \\frac{1}{4}$.",
        "solution": "It is $\\boxed{\\frac{3}{4}}$.",
        "level": "Level 2",
    },
    {"question": "What is $3^2$?", "solution": "$3^2 = \\boxed{9}$", "level": "Level 1"},
    {"question": "Solve $2x = 10$.", "solution": "So $x = \\boxed{5}$.", "level": "Level 1"},
    {"question": "What is $\\sqrt{16}$?", "solution": "$\\boxed{4}$", "level": "Level 1"},
    {"question": "Compute $7 \\cdot 8$.", "solution": "$\\boxed{56}$", "level": "Level 1"},
    {"question": "What is $100 - 37$?", "solution": "$\\boxed{63}$", "level": "Level 1"},
    {"question": "Find $x$ if $x + 4 = 11$.", "solution": "$x = \\boxed{7}$", "level": "Level 2"},
    {"question": "Compute $2^{5}$.", "solution": "$\\boxed{32}$", "level": "Level 2"},
    {"question": "What is $12 \\div 3$?", "solution": "$\\boxed{4}$", "level": "Level 1"},
    {"question": "What is $\\frac{6}{8}$ in lowest terms?", "solution": "$\\boxed{\\frac{3}{4}}$", "level": "Level 3"},
]


def mixed_overrides(folder: Path) -> list[str]:
    path = folder / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MATH_FILE))
    sources = [
        {"type": "arithmetic", "count": 30},
        {"type": "reasoning_gym", "datasets": ["basic_arithmetic", "gcd", "lcm"], "count": 10},
        {
            "type": "file",
            "name": "math",
            "path": str(path),
            "columns": {"prompt": "question", "reference": "solution", "difficulty_label": "level"},
            "extract": "boxed",
            "domain": "math",
        },
    ]
    return [
        f"synthesize.sources={json.dumps(sources)}",
        "train.steps=3",
        "select.batch_size=24",
        "allocate.n=2",
        "warmstart.steps=4",
        "difficulty.k=2",
        "evaluate.every=3",
        "checkpoint.every=3",
    ]


@pytest.mark.slow
def test_mixed_domains_train_end_to_end_each_scored_by_its_verifier(tmp_path, prefect_api):
    from rlvr.flows.runs import execute

    cfg = load_config(None, ["run_id=mixed", *mixed_overrides(tmp_path)])
    summary = execute(str(tmp_path / "store"), cfg)
    store = Store.open(str(tmp_path / "store"))
    assert summary["accuracy_final"] is not None
    by_verifier = query(
        store,
        """SELECT r.verifier, p.domain, count(*) AS n FROM rewards r JOIN problems p USING (problem_id)
           GROUP BY ALL ORDER BY 1""",
    ).to_pylist()
    assert [(r["verifier"], r["domain"]) for r in by_verifier] == [
        ("arithmetic", "arithmetic"),
        ("math", "math"),
        ("reasoning_gym", "reasoning_gym"),
    ]
    assert sum(r["n"] for r in by_verifier) == 3 * 24 * 2
    categories = query(store, "SELECT DISTINCT category FROM problems ORDER BY 1").column("category").to_pylist()
    assert categories == ["basic_arithmetic", "d1t2", "gcd", "lcm", "math"]
    labels = query(store, "SELECT DISTINCT difficulty_label FROM problems WHERE source = 'math' ORDER BY 1")
    assert labels.column("difficulty_label").to_pylist() == ["Level 1", "Level 2", "Level 3"]


@pytest.mark.slow
def test_data_difficulty_export_and_training_on_a_data_run(tmp_path, rlvr_forks):
    """`rlvr data --input --policy init`, `rlvr run --data`, `rlvr difficulty` with another checkpoint, `rlvr export`."""
    from datasets import load_dataset

    store = str(tmp_path / "store")
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(6)]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    made = rlvr(
        "data", "--input", str(tmp_path / "sums.jsonl"), "--verifier", "arithmetic", "--policy", "init",
        "--run-id", "sums", "--store", store, "--set", "difficulty.k=2", forks=rlvr_forks,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    assert (
        "rows read 60 = accepted 60 + quarantined 0 + duplicates 0" in made.stdout
        and "mean pass rate (posterior)" in made.stdout
    )

    small = [arg for key in TRAIN_SMALL for arg in ("--set", key)]
    trained = rlvr("run", "--run-id", "on-sums", "--store", store, "--data", "sums", *small, forks=rlvr_forks)
    assert trained.returncode == 0, trained.stderr[-2000:]
    opened = Store.open(store)
    problems = query(opened, "SELECT DISTINCT run_id FROM problems").column("run_id").to_pylist()
    assert problems == ["sums"]  # the RL run trained on the data run's problems, made once
    checkpoint = query(
        opened, "SELECT artifact_id FROM checkpoints WHERE run_id = 'on-sums' ORDER BY step DESC LIMIT 1"
    )
    again = rlvr(
        "difficulty",
        "sums",
        "--policy",
        checkpoint.column("artifact_id")[0].as_py(),
        "--store",
        store,
        forks=rlvr_forks,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    policies = query(opened, "SELECT DISTINCT policy_id FROM difficulty WHERE run_id = 'sums'").to_pylist()
    assert len(policies) == 2  # the new estimate is a new artifact; the old one stays queryable

    exported = rlvr(
        "export", "sums", "--format", "verl", "--out", str(tmp_path / "verl"), "--store", store, forks=rlvr_forks
    )
    assert exported.returncode == 0, exported.stderr[-2000:]
    train = load_dataset("parquet", data_files=str(tmp_path / "verl" / "train.parquet"), split="train")
    assert train.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert set(train["data_source"]) == {"arithmetic"}


TRAIN_SMALL = [
    "train.steps=2",
    "select.batch_size=4",
    "allocate.n=2",
    "warmstart.steps=2",
    "difficulty.k=2",
    "evaluate.every=2",
    "checkpoint.every=2",
]


def test_planted_easy_problems_get_higher_pass_rates_than_hard_ones(tmp_path):
    """A policy warm-started on one-digit sums: their difficulty pass rate beats three-digit products'."""
    from rlvr.tasks.difficulty import DIFFICULTY
    from rlvr.tasks.initialize import INITIALIZE
    from rlvr.tasks.warmstart import WARMSTART

    easy = "{type: arithmetic, name: easy, digits: 1, count: 100}"
    hard = "{type: arithmetic, name: hard, digits: 3, ops: '*', count: 100}"
    taught = load_config(
        None, [f"synthesize.sources=[{easy}]", "synthesize.warmup_fraction=0.9", "synthesize.test_fraction=0"]
    )
    cfg = load_config(
        None,
        [
            f"synthesize.sources=[{easy}, {hard}]",
            "synthesize.test_fraction=0",
            "synthesize.warmup_fraction=0",
            "warmstart.steps=150",
            "difficulty.k=8",
            "difficulty.max_new_tokens=7",
        ],
    )
    store = Store.open(str(tmp_path / "store"), create=True)
    at = {"run_id": "planted", "seed": 0}
    lesson = run_stage(store, SYNTHESIZE, taught.synthesize, run_id="lesson").ids["problems"]
    problems = run_stage(store, SYNTHESIZE, cfg.synthesize, **at).ids["problems"]
    initial = run_stage(store, INITIALIZE, cfg.policy, params={"seed": 0}, step=0, **at).id
    warm = run_stage(store, WARMSTART, cfg.warmstart, inputs={"problems": lesson, "policy": initial}, step=0, **at)
    inputs = {"problems": problems, "policy": warm.ids["checkpoints"]}
    scoring = cfg.label.model_copy(update={"workers": 0})
    run_stage(store, DIFFICULTY, cfg.difficulty, inputs=inputs, params={"verifier": scoring}, **at)
    rates = query(
        store,
        """SELECT p.source, avg(d.pass_rate) AS rate, count(*) AS n FROM difficulty d JOIN problems p USING (problem_id)
           WHERE p.run_id = 'planted' GROUP BY 1 ORDER BY 1""",
    ).to_pylist()
    assert [(r["source"], r["n"]) for r in rates] == [("easy", 100), ("hard", 100)]
    easy_rate, hard_rate = rates[0]["rate"], rates[1]["rate"]
    assert easy_rate > 0.3 and hard_rate < 0.05, rates


def test_the_difficulty_stages_verdicts_are_the_same_after_a_crash_inside_it(tmp_path):
    """The stage commits the verdicts behind its pass rates as a `reward_cache` artifact, after its last shard. Killed
    after two of its four shards, it is made again with the same rows: the shards committed before the kill are
    sampled and verified again for their verdicts, not taken as they were."""
    from rlvr.tasks.difficulty import DIFFICULTY
    from rlvr.tasks.initialize import INITIALIZE

    cfg = load_config(None, ["difficulty.k=2", "difficulty.shard_size=20", "synthesize.source.per_category=10"])
    scoring = cfg.label.model_copy(update={"workers": 0})

    def killed_after_two(fn, jobs):
        for done, estimate in enumerate(map(fn, jobs)):
            if done == 2:
                raise KeyboardInterrupt("killed in the third shard")
            yield estimate

    def verdicts(root: Path, killed: bool) -> tuple[list[dict], list[dict]]:
        store = Store.open(str(root), create=True)
        at = {"run_id": "crash", "seed": 0}
        problems = run_stage(store, SYNTHESIZE, cfg.synthesize, **at).ids["problems"]
        policy = run_stage(store, INITIALIZE, cfg.policy, params={"seed": 0}, step=0, **at).id
        estimate = partial(
            run_stage, store, DIFFICULTY, cfg.difficulty, inputs={"problems": problems, "policy": policy}
        )
        if killed:
            with pytest.raises(KeyboardInterrupt):
                estimate(params={"verifier": scoring, "fan_out": killed_after_two}, **at)
            assert not store.manifests(kind="difficulty") and not store.manifests(kind="reward_cache")
        done = estimate(params={"verifier": scoring}, **at)
        return store.read_table(done["difficulty"]).to_pylist(), store.read_table(done["reward_cache"]).to_pylist()

    rows, entries = verdicts(tmp_path / "whole", killed=False)
    assert len(rows) > 2 * 20 and len(entries) > 20 and {e["status"] for e in entries} <= {"ok", "wrong", "unparseable"}
    assert sum(e["status"] == "ok" for e in entries) <= sum(r["successes"] for r in rows)
    assert verdicts(tmp_path / "killed", killed=True) == (rows, entries)


def test_an_input_that_is_neither_a_file_nor_a_folder_is_refused_before_any_work():
    """`rlvr data --input /dev/null` was refused by the reader, after the flow and a temporary Prefect server had
    started (22 CPU-s, 48 s); the command's own check refuses it first, as it does a missing or an empty file."""
    from rlvr.errors import UserError
    from rlvr.flows.cli.data_commands import input_source

    with pytest.raises(UserError) as refused:
        input_source(Path("/dev/null"), None)
    assert str(refused.value) == (
        "input '/dev/null' is neither a file nor a folder; give a .jsonl, .json, .csv or .parquet file"
    )
