"""GHPO's hints: the schedule (grow while all wrong, shrink once there is signal), the hinted prompt, the
solutions the sources give, hints that never state the answer (hand-written cases, and 10,000 problems of
every built-in solution writer and the gsm8k / boxed readers), and a real run whose selections and rollouts
follow the schedule while its evaluation never sees a hint."""

from __future__ import annotations

import json
import random
import re
from fractions import Fraction

import pyarrow as pa
import pytest
from pydantic import ValidationError

from rlvr.curricula.hints import (
    GroupOutcome,
    HintConfig,
    Solution,
    hint_prefix,
    hinted_prompt,
    level_of,
    next_levels,
    ratio_of,
    solutions_of,
    start_levels,
    states_answer,
)
from rlvr.data.validate import Validator
from rlvr.verifiers.arithmetic import worked_solution

CFG = HintConfig(enabled=True)
RUN_HINTS = HintConfig(enabled=True, template="{prompt}{hint}")  # the hinted run's: text the tiny model reads


def outcome(slot: int, problem: str, correct: bool) -> GroupOutcome:
    return GroupOutcome(slot, problem, correct)


def test_levels_grow_while_all_wrong_and_stop_at_the_last_ratio() -> None:
    levels: dict[str, int] = {}
    seen = []
    for _ in range(5):
        levels = next_levels(levels, [outcome(0, "p", False)], {"p"}, CFG)
        seen.append(ratio_of(levels.get("p", 0), CFG))
    assert seen == [0.25, 0.5, 0.75, 0.75, 0.75]


def test_levels_shrink_once_a_group_has_a_correct_sample() -> None:
    levels = {"p": 3, "q": 1}
    levels = next_levels(levels, [outcome(0, "p", True), outcome(1, "q", True)], {"p", "q"}, CFG)
    assert levels == {"p": 2}  # level 0 is not stored
    levels = next_levels(levels, [outcome(0, "p", True)], {"p"}, CFG)
    assert levels == {"p": 1}
    levels = next_levels(levels, [outcome(0, "p", False)], {"p"}, CFG)
    assert levels == {"p": 2}


def test_levels_follow_slot_order_and_skip_problems_without_a_solution() -> None:
    """Two groups of one problem in a step move it twice, in slot order; no solution, no hint."""
    outcomes = [outcome(1, "p", True), outcome(0, "p", False), outcome(2, "x", False)]
    assert next_levels({}, outcomes, {"p"}, CFG) == {}  # up at slot 0, down at slot 1
    assert next_levels({}, list(reversed(outcomes[:2])), {"p"}, CFG) == {}
    assert next_levels({"p": 1}, [outcome(0, "p", False), outcome(1, "p", False)], {"p"}, CFG) == {"p": 3}


def test_hint_prefix_takes_whole_words_of_the_steps_before_the_answer() -> None:
    solution = Solution(worked_solution([12, 34, 56], ["+", "+"]), ("102",))  # 34 words, the first step 15
    assert solution.text == (
        "12 + 34 = 12 + 30 + 4 = 42 + 4 = 46. 46 + 56 = 46 + 50 + 6 = 96 + 6 = 102. The answer is 102."
    )
    assert hint_prefix(solution, 0.25) == "12 + 34 = 12 + 30 + 4"  # ceil(8.5) = 9 words
    assert hint_prefix(solution, 0.5) == "12 + 34 = 12 + 30 + 4 = 42 + 4 = 46."  # 17, cut to the first step's 15
    assert hint_prefix(solution, 1.0) == hint_prefix(solution, 0.5)
    assert hint_prefix(solution, 0.0) == ""


def test_hinted_prompt_is_the_prompt_without_a_hint() -> None:
    two_steps = Solution("3 * 4 = 12. 2 + 12 = 14. The answer is 14.", ("14",))
    assert hinted_prompt("2+3*4=", two_steps, 0.0, CFG) == "2+3*4="
    assert hinted_prompt("2+3*4=", None, 0.75, CFG) == "2+3*4="
    custom = HintConfig(enabled=True, template="{prompt} [{hint}]")
    assert hinted_prompt("2+3*4=", two_steps, 0.5, custom) == "2+3*4= [3 * 4 = 12.]"
    assert hinted_prompt("2+3=", Solution("2 + 3 = 5. The answer is 5.", ("5",)), 0.75, custom) == "2+3="


# ---------------------------------------------------------------------------------------------
# Hints never state the answer


def test_a_one_step_solution_gives_no_hint_at_any_ratio() -> None:
    """The issue's case: at ratio 0.5 the old hint of `5 + 40 = 45. The answer is 45.` was `5 + 40 = 45.`.
    Its first step states the answer, so there is nothing to hint: the problem is treated as one without a
    solution (no hint, its level never moves)."""
    solution = Solution(worked_solution([5, 40], ["+"]), ("45",))
    assert solution.text == "5 + 40 = 45. The answer is 45."
    assert [hint_prefix(solution, r) for r in (0.25, 0.5, 0.75, 1.0)] == ["", "", "", ""]
    assert hinted_prompt("5+40=", solution, 0.5, CFG) == "5+40="
    table = pa.table({"problem_id": ["p"], "prompt": ["5+40="], "answer": ["45"], "solution": [solution.text]})
    assert solutions_of(table) == {}
    assert next_levels({}, [outcome(0, "p", False)], set(solutions_of(table)), CFG) == {}


def test_the_hint_stops_before_the_step_that_states_the_answer_as_a_number() -> None:
    """Answer 4: `14`, `45` and `4.5` are other numbers, `= 4` states it; the last step is never shown."""
    solution = Solution("7 * 2 = 14. 14 + 31 = 45. 45 / 10 = 4.5, which rounds to 4. The answer is 4.", ("4",))
    assert hint_prefix(solution, 1.0) == "7 * 2 = 14. 14 + 31 = 45."
    assert hint_prefix(solution, 0.25) == "7 * 2 = 14. 14"  # ceil(5.5) = 6 words
    no_answer = Solution("First, 3 + 4 = 7. Then 7 + 1 = 8.", ())  # the last step is the answer's
    assert hint_prefix(no_answer, 1.0) == "First, 3 + 4 = 7."


GSM8K_RATIONALE = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


def test_gsm8k_hints_from_the_reader_and_from_a_solution_column(tmp_path) -> None:
    """A gsm8k record read with `extract: gsm8k` keeps its rationale less the `####` line as its solution; the
    rationale's last line states 72, so only the first is shown. A solution column holding the whole text,
    `#### 72` included, gives the same hint."""
    from rlvr.data.sources import FileSource, FileSourceConfig

    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps({"question": "Natalia sold clips to 48 of her friends...", "answer": GSM8K_RATIONALE}))
    source = FileSource(FileSourceConfig(path=str(path), extract="gsm8k", columns={"prompt": "question"}))
    [row] = list(source.rows(0))
    assert (row["answer"], row["solution"]) == ("72", GSM8K_RATIONALE.rpartition("\n####")[0])
    first_line = "Natalia sold 48/2 = <<48/2=24>>24 clips in May."
    assert hint_prefix(Solution(row["solution"], (row["answer"],)), 1.0) == first_line
    assert hint_prefix(Solution(GSM8K_RATIONALE, ("72",)), 1.0) == first_line
    assert hint_prefix(Solution(row["solution"], (row["answer"],)), 0.25) == "Natalia sold 48/2 = <<48/2=24>>24"


def test_boxed_hints_stop_before_the_answer_in_any_of_its_forms(tmp_path) -> None:
    """MATH style, read with `extract: boxed`: the solution is the whole text, the answer the boxed content;
    0.75 (here as 3/4 = 6/8) is the answer written another way."""
    from rlvr.data.sources import FileSource, FileSourceConfig

    worked = (
        "The sum is $\\frac{1}{4} + \\frac{1}{2}$. Over a common denominator it is $\\frac{1}{4} + \\frac{2}{4}$. "
        "That is $0.75$. So it is $\\boxed{\\frac{3}{4}}$."
    )
    path = tmp_path / "math.jsonl"
    path.write_text(json.dumps({"problem": "What is 1/4 + 1/2?", "solution": worked}))
    columns = {"prompt": "problem", "reference": "solution"}
    [row] = list(FileSource(FileSourceConfig(path=str(path), extract="boxed", columns=columns)).rows(0))
    assert (row["answer"], row["solution"]) == ("\\frac{3}{4}", worked)
    solution = Solution(row["solution"], (row["answer"],))
    assert hint_prefix(solution, 1.0) == (
        "The sum is $\\frac{1}{4} + \\frac{1}{2}$. Over a common denominator it is $\\frac{1}{4} + \\frac{2}{4}$."
    )
    six_eighths = Solution("Halve it: $\\frac{6}{8}$. So it is $\\boxed{0.75}$.", ("0.75",))
    assert hint_prefix(six_eighths, 1.0) == ""
    assert hint_prefix(Solution("So $2x = 10$. Then $x = \\boxed{5}$.", ("\\boxed{5}",)), 1.0) == "So $2x = 10$."


@pytest.mark.parametrize(
    ("text", "answer", "states"),
    [
        ("= 45.", "45", True),
        ("= 45.0", "45", True),
        ("\\boxed{45}", "45", True),
        ("#### 45", "45", True),
        ("90/2", "45", True),
        ("1,776 in all", "1776", True),
        ("-6 + 1", "6", True),
        ("= 6", "-6", True),
        ("25% of it", "0.25", True),
        ("$\\dfrac{6}{8}$", "\\frac{3}{4}", True),
        ("$18", "\\$18", True),
        ("145 and 4.5 and 1,045", "45", False),
        ("14 and 45", "4", False),
        ("x = (2, 3)", "(2,3)", True),
        ("Because", "B", False),
        ("(B) is right", "B", True),
    ],
)
def test_states_answer_reads_numbers_whole(text, answer, states) -> None:
    assert states_answer(text, answer) is states


# The independent check of the property test: the answer's value among the hint's number tokens (whole tokens,
# thousands separators dropped, fractions a/b and \frac{a}{b} read), or any of the last step's markers.
_TOKEN = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")
_FRACTION = re.compile(r"(\d+)/(\d+)|\\frac\{(\d+)\}\{(\d+)\}")


def leaks(hint: str, answer: str) -> bool:
    fraction = _FRACTION.fullmatch(answer)
    value = Fraction(*(int(g) for g in fraction.groups() if g)) if fraction else Fraction(answer)
    values = {Fraction(token.replace(",", "")) for token in _TOKEN.findall(hint)}
    values |= {Fraction(int(a or c), int(b or d)) for a, b, c, d in _FRACTION.findall(hint) if int(b or d)}
    return abs(value) in {abs(v) for v in values} or any(m in hint for m in ("answer is", "####", "boxed"))


def reader_records(rng: random.Random, count: int) -> tuple[list[dict], list[dict]]:
    """gsm8k-style and MATH-style records with two to four steps, the answer in the last (and sometimes
    earlier, by chance: then the hint stops there)."""
    gsm8k, boxed = [], []
    for _ in range(count):
        a, b, c = rng.randrange(2, 60), rng.randrange(2, 40), rng.randrange(1, 500)
        lines = [f"She buys {a} packs of {b} pens: {a}*{b} = <<{a}*{b}={a * b}>>{a * b} pens."]
        total = a * b + c
        lines.append(f"She finds {c} more: {a * b}+{c} = <<{a * b}+{c}={total}>>{total:,} pens.")
        if rng.random() < 0.5:
            lines.insert(1, f"Each pack costs ${b}, so she pays {a}*{b} = ${a * b}.")
        gsm8k.append({"question": f"Pens ({a}, {b}, {c})?", "answer": "\n".join(lines) + f"\n#### {total:,}"})
        top, bottom = rng.randrange(1, 30), rng.randrange(2, 30)
        steps = [
            f"Add $\\frac{{{top}}}{{{bottom}}}$ to $\\frac{{{c}}}{{{bottom}}}$.",
            f"The numerators sum to {top + c}.",
        ]
        answer = Fraction(top + c, bottom)
        shown = str(answer) if answer.denominator == 1 else f"\\frac{{{answer.numerator}}}{{{answer.denominator}}}"
        boxed.append(
            {"problem": f"Sum ({top}, {c}, {bottom})?", "solution": " ".join(steps) + f" So $\\boxed{{{shown}}}$."}
        )
    return gsm8k, boxed


def generated_problems(tmp_path) -> pa.Table:
    """10,000+ problems as the synthesize stage stores them (prompt, answer, reference, solution), from every
    built-in writer of solutions: the arithmetic generator (each style and kind of step), the skills generator,
    and the file/dataset readers' gsm8k and boxed extraction; reasoning-gym problems come without one."""
    from rlvr.data.sources import (
        ArithmeticSource,
        ArithmeticSourceConfig,
        FileSource,
        FileSourceConfig,
        ReasoningGymSource,
        ReasoningGymSourceConfig,
        SkillsSource,
        SkillsSourceConfig,
    )
    from rlvr.data.validate import validate
    from rlvr.verifiers.skills import CATEGORIES

    gsm8k, boxed = reader_records(random.Random(0), 700)
    (tmp_path / "gsm8k.jsonl").write_text("\n".join(json.dumps(r) for r in gsm8k))
    (tmp_path / "math.jsonl").write_text("\n".join(json.dumps(r) for r in boxed))
    arithmetic = [
        dict(digits=1, terms=2, ops="+-*", count=300),
        dict(digits=2, terms=2, ops="+", count=700, style="question"),
        dict(digits=2, terms=2, ops="-", count=700),
        dict(digits=2, terms=2, ops="*", count=700),
        dict(digits=3, terms=2, ops="+-*", count=500),
        dict(digits=1, terms=3, ops="+-*", count=1300),
        dict(digits=2, terms=3, ops="+-*", count=1500, style="question"),
        dict(digits=1, terms=4, ops="+*", count=800),
        dict(digits=2, terms=4, ops="+-*", count=800),
        dict(digits=1, terms=6, ops="+-*", count=300),
    ]
    sources = [
        *(("arithmetic", ArithmeticSource(ArithmeticSourceConfig(**spec))) for spec in arithmetic),
        ("arithmetic", SkillsSource(SkillsSourceConfig(categories=list(CATEGORIES), per_category=100))),
        (
            "math",
            FileSource(
                FileSourceConfig(path=str(tmp_path / "gsm8k.jsonl"), extract="gsm8k", columns={"prompt": "question"})
            ),
        ),
        (
            "math",
            FileSource(
                FileSourceConfig(
                    path=str(tmp_path / "math.jsonl"),
                    extract="boxed",
                    columns={"prompt": "problem", "reference": "solution"},
                )
            ),
        ),
        ("reasoning_gym", ReasoningGymSource(ReasoningGymSourceConfig(datasets=["basic_arithmetic"], count=20))),
    ]
    rows = []
    for index, (verifier, source) in enumerate(sources):
        accepted, rejected, _ = validate(list(source.rows(index)), f"s{index}", verifier, max_prompt_chars=400)
        assert rejected == []
        rows += [
            {
                "problem_id": f"{index}-{c.source_index}",
                "prompt": c.prompt,
                "answer": c.answer,
                "reference": c.reference,
                "solution": c.solution,
                "source": type(source).__name__,
            }
            for c in accepted
        ]
    return pa.Table.from_pylist(rows)


RATIOS = sorted({*HintConfig().ratios, *(i / 20 for i in range(1, 21))})  # the defaults and (0, 1] by 0.05


def test_no_hint_contains_its_problems_answer_over_10000_generated_problems(tmp_path) -> None:
    problems = generated_problems(tmp_path)
    assert problems.num_rows >= 10_000
    solution_of = solutions_of(problems)
    shown: dict[str, int] = {}
    for row in problems.to_pylist():
        if row["source"] == "ReasoningGymSource":
            assert row["solution"] is None and row["problem_id"] not in solution_of
            continue
        assert row["solution"], row
        hints = {
            ratio: hinted_prompt(row["prompt"], solution_of.get(row["problem_id"]), ratio, CFG).removeprefix(
                row["prompt"]
            )
            for ratio in RATIOS
        }
        assert all((hint != "") == (row["problem_id"] in solution_of) for hint in hints.values())
        for hint in set(hints.values()):  # each distinct hint once: many ratios reach the same last step
            assert not leaks(hint, row["answer"]), (row, hints)
        shown[row["source"]] = shown.get(row["source"], 0) + (row["problem_id"] in solution_of)
    # not vacuous: every writer's multi-step solutions are hinted
    assert shown["ArithmeticSource"] > 4000 and shown["FileSource"] > 1000, shown
    assert len(solution_of) > 5000


def test_a_problem_whose_reference_differs_from_its_answer_is_cut_at_either() -> None:
    table = pa.table(
        {
            "problem_id": ["p"],
            "answer": ["12"],
            "reference": ["\\boxed{7}"],
            "solution": ["3 + 4 = 7. 7 + 5 = 12. The answer is 12."],
        }
    )
    assert solutions_of(table) == {}  # the first step states the reference's 7
    table = table.set_column(2, "reference", pa.array(["12"]))
    [(pid, solution)] = solutions_of(table).items()
    assert (pid, solution.answers, hint_prefix(solution, 1.0)) == ("p", ("12",), "3 + 4 = 7.")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"ratios": (0.5, 0.25)}, "hint ratios must be increasing shares in (0, 1], got [0.5, 0.25]"),
        ({"ratios": (0.0, 0.5)}, "hint ratios must be increasing shares in (0, 1]"),
        ({"template": "{prompt} only"}, "the hint template needs both {prompt} and {hint}"),
    ],
)
def test_hint_config_errors(fields, message) -> None:
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        HintConfig(**fields)


def test_worked_solutions_of_the_arithmetic_generator() -> None:
    assert worked_solution([37, 48], ["*"]) == "37 * 48 = 37 * 40 + 37 * 8 = 1480 + 296 = 1776. The answer is 1776."
    assert worked_solution([2, 3, 4], ["+", "*"]) == "3 * 4 = 12. 2 + 12 = 2 + 10 + 2 = 12 + 2 = 14. The answer is 14."
    assert worked_solution([52, 38], ["-"]) == "52 - 38 = 52 - 30 - 8 = 22 - 8 = 14. The answer is 14."
    assert worked_solution([5, 40], ["+"]) == "5 + 40 = 45. The answer is 45."


def test_a_solution_that_is_not_text_is_quarantined() -> None:
    validator = Validator("src", "arithmetic", 1000)
    rejected = validator.check({"source_index": 0, "prompt": "2+3=", "answer": "5", "solution": ["x"]})
    assert (rejected.check, rejected.reason) == ("solution", "solution must be text, got list")
    accepted = validator.check({"source_index": 1, "prompt": "2+4=", "answer": "6", "solution": "2 + 4 = 6."})
    assert accepted.solution == "2 + 4 = 6."


# ---------------------------------------------------------------------------------------------
# A real run with hints on


def test_from_difficulty_starts_unsolved_problems_at_level_1() -> None:
    """A problem the difficulty pass never saw solved starts at level 1 (with a solution to hint from); once it
    has had a group its carried level replaces the start, level 0 included."""
    cfg = HintConfig(enabled=True, from_difficulty=True)
    rates = {"p": 0.0, "q": 0.5, "r": 0.0, "s": None}
    start = start_levels(rates, {"p", "q", "s"}, cfg)
    assert start == {"p": 1}  # r has no solution, s was never estimated
    assert start_levels(rates, {"p", "q", "s"}, CFG) == {}  # off by default
    assert next_levels({}, [outcome(0, "p", False)], {"p"}, cfg, start) == {"p": 2}
    solved = next_levels({}, [outcome(0, "p", True)], {"p"}, cfg, start)
    assert solved == {"p": 0} and level_of("p", solved, start) == 0  # stored, so it does not start over at 1
    assert level_of("p", {}, start) == 1 and level_of("q", {}, start) == 0


GHPO_RUN = [
    "train.steps=8",
    "select.batch_size=4",
    "allocate.n=4",
    "warmstart.steps=30",
    "difficulty.k=2",
    "evaluate.every=4",
    "checkpoint.every=8",
    "select.hints.enabled=true",
    "select.hints.template={prompt}{hint}",  # text the tiny model reads (flows/compatibility.py)
    "synthesize.source.type=arithmetic",
    "synthesize.source.terms=3",  # two steps: one-step solutions state the answer at once and are never hinted
    "synthesize.source.count=16",
]


def ghpo_run(root: str, run_id: str, *extra: str):
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute
    from rlvr.storage.store import Store

    execute(root, load_config(None, [f"run_id={run_id}", *GHPO_RUN, *extra]))
    return Store.open(root)


@pytest.fixture(scope="module")
def from_difficulty_run(tmp_path_factory, prefect_api):
    return ghpo_run(str(tmp_path_factory.mktemp("ghpo-start")), "start", "select.hints.from_difficulty=true")


@pytest.fixture(scope="module")
def hinted_run(tmp_path_factory, prefect_api):
    return ghpo_run(str(tmp_path_factory.mktemp("ghpo")), "ghpo")


def rows(store, sql: str) -> list[dict]:
    from rlvr.storage.views import query

    return query(store, sql).to_pylist()


def hintable(store) -> set[str]:
    """The run's problems with something to hint (a solution whose first step does not state the answer)."""
    table = pa.Table.from_pylist(rows(store, "SELECT problem_id, answer, reference, solution FROM problems"))
    return set(solutions_of(table))


def replay_levels(store, start: dict[str, int]) -> tuple[int, int]:
    """Replay the hint schedule by hand from the store: each pick's hint ratio is its problem's level before the
    step (`start` before its first group), and the level moves up after an all-wrong group, down after one with
    a correct sample; a problem with nothing to hint stays at level 0. Returns how many groups raised a level
    and how many picks were hinted."""
    can_hint = hintable(store)
    assert can_hint and set(start) <= can_hint
    picks = rows(store, "SELECT step, slot, problem_id, hint_ratio FROM selections ORDER BY step, slot")
    groups = rows(
        store,
        "SELECT r.step, r.slot, r.problem_id, bool_or(w.status = 'ok') AS any_correct FROM rollouts r "
        "JOIN rewards w USING (rollout_id) GROUP BY ALL ORDER BY r.step, r.slot",
    )
    ratios, level, grew = [0.0, 0.25, 0.5, 0.75], dict(start), 0
    for step in sorted({p["step"] for p in picks}):
        for pick in (p for p in picks if p["step"] == step):
            assert pick["hint_ratio"] == ratios[level.get(pick["problem_id"], 0)], pick
        for group in (g for g in groups if g["step"] == step and g["problem_id"] in can_hint):
            before = level.get(group["problem_id"], 0)
            level[group["problem_id"]] = max(before - 1, 0) if group["any_correct"] else min(before + 1, 3)
            grew += level[group["problem_id"]] > before
    return grew, sum(p["hint_ratio"] > 0 for p in picks)


@pytest.mark.slow
def test_selections_follow_the_schedule_over_the_run(hinted_run) -> None:
    grew, hinted = replay_levels(hinted_run, {})
    assert grew > 0 and hinted > 0


@pytest.mark.slow
def test_from_difficulty_hints_the_first_draw_of_unsolved_problems(from_difficulty_run) -> None:
    """Every problem the difficulty pass never solved starts at level 1, so its first pick is hinted."""
    unsolved = rows(from_difficulty_run, "SELECT problem_id FROM difficulty WHERE pass_rate = 0")
    assert unsolved
    start = {row["problem_id"]: 1 for row in unsolved if row["problem_id"] in hintable(from_difficulty_run)}
    _, hinted = replay_levels(from_difficulty_run, start)
    first = rows(
        from_difficulty_run,
        "SELECT problem_id, arg_min(hint_ratio, step * 1000 + slot) AS first FROM selections GROUP BY problem_id",
    )
    assert all(row["first"] == 0.25 for row in first if row["problem_id"] in start)
    assert any(row["problem_id"] in start for row in first) and hinted > 0


@pytest.mark.slow
def test_rollouts_show_the_hint_their_selection_gave(hinted_run) -> None:
    found = rows(
        hinted_run,
        "SELECT r.problem_id, r.prompt, r.hint_ratio, s.hint_ratio AS picked, p.prompt AS own, p.answer "
        "FROM rollouts r JOIN selections s USING (step, slot) JOIN problems p ON p.problem_id = r.problem_id",
    )
    problems = pa.Table.from_pylist(rows(hinted_run, "SELECT problem_id, answer, reference, solution FROM problems"))
    solution_of = solutions_of(problems)
    assert {r["hint_ratio"] for r in found} >= {0.0, 0.25}
    for r in found:
        assert r["hint_ratio"] == r["picked"]
        shown = hinted_prompt(r["own"], solution_of.get(r["problem_id"]), r["hint_ratio"], RUN_HINTS)
        assert r["prompt"] == shown
        assert (r["prompt"] != r["own"]) == (r["hint_ratio"] > 0)
        assert not leaks(r["prompt"].removeprefix(r["own"]), r["answer"])


@pytest.mark.slow
def test_evaluation_never_sees_a_hint(hinted_run) -> None:
    """The evaluations read the policy and the problems only (not the selections or the selection state that
    hold the hints), and the problems' prompts carry none."""
    parents = rows(
        hinted_run,
        "SELECT DISTINCT a.kind FROM lineage l JOIN artifacts e ON e.artifact_id = l.child_id "
        "JOIN artifacts a ON a.artifact_id = l.parent_id WHERE e.kind = 'evals'",
    )
    assert {p["kind"] for p in parents} <= {"problems", "checkpoints", "train_steps"}
    assert rows(hinted_run, "SELECT count(*) AS n FROM problems WHERE prompt LIKE '%beginning of a solution%'") == [
        {"n": 0}
    ]
    assert rows(hinted_run, "SELECT count(*) AS n FROM evals WHERE phase = 'rl'") == [{"n": 2}]


def test_solutions_of_a_table_with_and_without_the_column() -> None:
    two_steps = "2 + 3 = 5. 5 + 4 = 9."
    with_column = pa.table(
        {"problem_id": ["a", "b", "c", "d"], "answer": ["9"] * 4, "solution": [two_steps, None, "", "5 + 4 = 9."]}
    )
    assert solutions_of(with_column) == {"a": Solution(two_steps, ("9",))}  # d's one step states the answer
    assert solutions_of(with_column)["a"].hintable == "2 + 3 = 5."
    assert solutions_of(pa.table({"problem_id": ["a"], "prompt": ["2+3="]})) == {}  # a table from before the column


def test_a_run_whose_problems_have_no_solution_is_warned(tmp_path) -> None:
    """What the progress display shows (a `warning` event), once, and only with hints on."""
    from rlvr.flows.config import load_config
    from rlvr.flows.run_preflight import warn_without_solutions
    from rlvr.progress import listen, stop_listening
    from rlvr.storage.stage import rows_to_table
    from rlvr.storage.store import Store

    store = Store.open(str(tmp_path / "store"), create=True)
    table = rows_to_table("problems", [{"problem_id": "a", "prompt": "2+3="}, {"problem_id": "b", "prompt": "4+4="}])
    common = {"run_id": "r", "code_version": "1", "config": {}, "stage": "data", "parents": []}
    store.write_artifact("problems", "problems-plain", table, **common)
    seen: list[tuple[str, dict]] = []
    listener = lambda event, fields: seen.append((event, fields))  # noqa: E731
    listen(listener)
    try:
        warn_without_solutions(
            str(tmp_path / "store"),
            load_config(None, ["select.hints.enabled=true", "select.hints.template={prompt}{hint}"]),
            "problems-plain",
        )
        warn_without_solutions(str(tmp_path / "store"), load_config(None, []), "problems-plain")  # hints off: silent
    finally:
        stop_listening(listener)
    assert [event for event, _ in seen] == ["warning"]
    assert seen[0][1]["message"].startswith("select.hints is on but none of the run's 2 problems has a solution")
