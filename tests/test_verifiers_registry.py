"""Registry (built-ins, entry-point plugins, broken plugins), `verify_lines` for `rlvr verify`, and the
TRL / verl adapters called with the shapes those trainers use."""

from __future__ import annotations

import json
import textwrap

import pytest

from rlvr.errors import UserError
from rlvr.verifiers.adapters import compute_score, trl_reward_func
from rlvr.verifiers.arithmetic import ArithmeticVerifier
from rlvr.verifiers.math import MathVerifier
from rlvr.verifiers.pool import VerifierPool
from rlvr.verifiers.registry import BUILTIN, get_verifier, plugin_errors, registered, verifier_class
from rlvr.verifiers.verify_jsonl import verify_lines

# ----------------------------------------------------------------------------------------------
# Registry


def test_builtins_are_registered_sorted_with_versions():
    names = registered()
    assert names["arithmetic"] is ArithmeticVerifier
    assert names["math"] is MathVerifier
    assert list(names) == sorted(names)
    assert (MathVerifier.name, MathVerifier.domain, MathVerifier.version) == ("math", "math", "2")
    assert isinstance(get_verifier("math"), MathVerifier)


def test_unknown_verifier_names_the_registered_ones():
    with pytest.raises(UserError) as raised:
        get_verifier("maths")
    assert str(raised.value) == "unknown verifier 'maths'; registered: " + ", ".join(registered())
    assert {"arithmetic", "math"} <= set(registered())


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A distribution on sys.path declaring rlvr.verifiers entry points: one good, three bad."""
    (tmp_path / "echo_plugin.py").write_text(
        textwrap.dedent(
            """
            from rlvr.verifiers.base import Score, Verifier

            class EchoVerifier(Verifier):
                name = "echo"
                domain = "test"
                version = "3"

                def score(self, response, reference):
                    same = response.strip() == str(reference)
                    return Score(float(same), "ok" if same else "wrong", extracted=response.strip())

            class NotAVerifier:
                pass
            """
        )
    )
    dist_info = tmp_path / "echo_plugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-plugin\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(
        "[rlvr.verifiers]\n"
        "echo = echo_plugin:EchoVerifier\n"
        "broken = module_that_does_not_exist:Verifier\n"
        "notverifier = echo_plugin:NotAVerifier\n"
        "math = echo_plugin:EchoVerifier\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_entry_point_plugin_is_registered_and_bad_ones_are_reported(plugin_dir):
    names = registered()
    assert list(names) == sorted([*BUILTIN, "echo"])
    assert names["echo"].version == "3"
    assert names["math"] is MathVerifier  # a plugin cannot shadow a built-in
    assert get_verifier("echo").score(" 7 ", 7).status == "ok"
    errors = plugin_errors()
    assert len(errors) == 3
    assert errors[0].startswith(
        "plugin 'broken' (module_that_does_not_exist:Verifier) failed to load: ModuleNotFoundError"
    )
    assert errors[1].startswith("plugin 'notverifier' (echo_plugin:NotAVerifier) rejected: ")
    assert errors[2] == "plugin 'math' (echo_plugin:EchoVerifier) ignored: 'math' is a built-in verifier"
    with pytest.raises(UserError, match="^plugin 'broken' .* failed to load"):
        get_verifier("broken")


def test_entry_points_are_scanned_again_only_when_sys_path_changes(plugin_dir, monkeypatch):
    import rlvr.verifiers.registry as registry

    scans = []
    real_scan = registry.PLUGINS.scan
    monkeypatch.setattr(registry.PLUGINS, "scan", lambda: scans.append(1) or real_scan())
    monkeypatch.setattr(registry.PLUGINS, "cached", None)
    for _ in range(3):
        assert "echo" in registered()
    assert len(scans) == 1
    monkeypatch.syspath_prepend(str(plugin_dir / "elsewhere"))  # a new path entry may hold new plugins
    registered().pop("echo")  # callers get a copy: the cached registry keeps it
    assert "echo" in registered() and len(scans) == 2
    (plugin_dir / "another-0.1.dist-info").mkdir()  # an install into a folder already on sys.path
    registered()
    assert len(scans) == 3


def test_plugin_runs_in_the_pool(plugin_dir):
    with VerifierPool("echo", workers=1, timeout_s=5.0) as pool:
        assert [s.status for s in pool.score_many([("7", 7), ("8", 7)])] == ["ok", "wrong"]


def test_import_path_names_a_verifier_class():
    assert verifier_class("rlvr.verifiers.math:MathVerifier") is MathVerifier
    with pytest.raises(UserError, match="cannot import verifier 'rlvr.verifiers.math:Nope'"):
        verifier_class("rlvr.verifiers.math:Nope")
    with pytest.raises(UserError, match="is not a subclass of rlvr.verifiers.base.Verifier"):
        verifier_class("rlvr.verifiers.math:Score")


# ----------------------------------------------------------------------------------------------
# verify_lines (rlvr verify)


def test_verify_lines_labels_every_line_in_order_and_survives_malformed_ones():
    lines = [
        json.dumps({"response": "So \\boxed{\\frac{1}{2}}", "reference": "0.5"}),
        "{not json",
        json.dumps({"response": 5, "reference": "5"}),
        json.dumps({"reference": "5"}),
        "",
        json.dumps([1, 2]),
        json.dumps({"response": "#### 8", "reference": 9}),
        json.dumps({"response": "#### 8", "reference": None}),
        json.dumps({"response": "no idea", "reference": "3"}),
    ]
    rows = list(verify_lines("math", lines, workers=2, timeout_s=5.0))
    assert [row["line"] for row in rows] == list(range(1, 10))
    assert [row["status"] for row in rows] == [
        "ok",
        "error",
        "error",
        "error",
        "error",
        "error",
        "wrong",
        "error",
        "unparseable",
    ]
    assert rows[0] == {
        "line": 1,
        "score": 1.0,
        "status": "ok",
        "extracted": "\\frac{1}{2}",
        "reason": "boxed: equivalent to the reference",
        "components": {"correct": 1.0},
    }
    assert rows[1]["reason"].startswith("malformed input line: not valid JSON")
    assert rows[2]["reason"] == "malformed input line: 'response' must be a string, got int"
    assert rows[3]["reason"] == "malformed input line: missing key(s): response"
    assert rows[4]["reason"] == "malformed input line: empty line"
    assert rows[5]["reason"] == "malformed input line: expected a JSON object, got list"
    assert rows[7]["reason"] == "malformed input line: 'reference' is null"
    assert all(isinstance(row["score"], float) for row in rows)
    assert all(json.loads(json.dumps(row)) == row for row in rows)


def test_verify_lines_streams_more_than_one_chunk():
    lines = (json.dumps({"response": f"#### {i}", "reference": i if i % 2 else i + 1}) for i in range(1100))
    rows = list(verify_lines("arithmetic", lines, workers=2))
    assert len(rows) == 1100
    assert [row["line"] for row in rows] == list(range(1, 1101))
    # the arithmetic verifier wants the bare number, so "#### i" is unparseable for it
    assert {row["status"] for row in rows} == {"unparseable"}


# ----------------------------------------------------------------------------------------------
# TRL adapter


def test_trl_reward_func_with_plain_string_completions():
    reward = trl_reward_func("math", reference_column="answer")
    assert reward.__name__ == "math_reward"
    rewards = reward(
        prompts=["What is 6*7?", "Half of 1?", "Say 3"],
        completions=["6*7 = 42.\n#### 42", "The answer is 0.25", "I don't know"],
        completion_ids=[[1], [2], [3]],
        answer=["42", "\\frac{1}{2}", "3"],
        trainer_state=None,
    )
    assert rewards == [1.0, 0.0, 0.0]
    assert all(isinstance(r, float) for r in rewards)


def test_trl_reward_func_with_conversational_completions():
    reward = trl_reward_func("math", reference_column="solution")
    prompts = [[{"role": "user", "content": "What is 2+2?"}]] * 3
    completions = [
        [{"role": "assistant", "content": "2+2 = \\boxed{4}"}],
        [{"role": "assistant", "content": "\\boxed{5}"}],
        [
            {"role": "assistant", "content": "Let me call a tool."},
            {"role": "tool", "content": "4"},
            {"role": "assistant", "content": [{"type": "text", "text": "So the answer is 4."}]},
        ],
    ]
    assert reward(prompts, completions, solution=["4", "4", "4"]) == [1.0, 0.0, 1.0]


def test_trl_reward_func_through_a_pool():
    with VerifierPool("math", workers=2, timeout_s=5.0) as pool:
        reward = trl_reward_func("math", reference_column="answer", pool=pool)
        assert reward(prompts=["p", "p"], completions=["#### 3", "#### 4"], answer=[3, 3]) == [1.0, 0.0]
        with pytest.raises(UserError, match="the pool runs verifier 'math', not 'arithmetic'"):
            trl_reward_func("arithmetic", pool=pool)


def test_trl_reward_func_missing_column_is_a_user_error():
    reward = trl_reward_func("math", reference_column="answer")
    with pytest.raises(UserError, match="reward column 'answer' is not in the dataset; columns passed: solution"):
        reward(prompts=["p"], completions=["#### 1"], solution=["1"], completion_ids=[[1]])


# ----------------------------------------------------------------------------------------------
# verl adapter


@pytest.mark.parametrize(
    "data_source, solution_str, ground_truth, expected",
    [
        ("openai/gsm8k", "Natalia sold 48+24 = 72 clips.\n#### 72", "72", 1.0),
        ("openai/gsm8k", "#### 71", "72", 0.0),
        ("lighteval/MATH", "So $x = \\boxed{\\frac{\\pi}{2}}$", "\\frac{\\pi}{2}", 1.0),
        ("HuggingFaceH4/MATH-500", "\\boxed{(1, 2)}", "(2, 1)", 0.0),
        ("aime2024", "The answer is 033.", "33", 1.0),
        ("numina_olympiads", "\\boxed{\\frac{1}{2006!}}", "\\frac{1}{2004!}", 0.0),
        ("math", "\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("arithmetic", "12", "12", 1.0),
    ],
)
def test_verl_compute_score(data_source, solution_str, ground_truth, expected):
    score = compute_score(
        data_source=data_source,
        solution_str=solution_str,
        ground_truth=ground_truth,
        extra_info={"split": "test", "index": 0},
    )
    assert score == expected
    assert isinstance(score, float)


def test_verl_unknown_data_source_is_a_user_error():
    with pytest.raises(UserError, match="no verifier for verl data source 'codecontests'; known: arithmetic, "):
        compute_score("codecontests", "print(1)", "1")
