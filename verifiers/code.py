"""The `code` verifier: a Python program from the response, run in the sandbox against the reference's tests.

Response: the program is the last fenced block tagged python, py or python3, or untagged; a block
left open at the end of the text (a truncated generation) counts; a block indented as a whole (inside
a list item) is dedented. Without such a block the whole text is the program.

Reference (a dict or its JSON text), at least one check in all:
    {"tests": [{"input": STDIN, "output": EXPECTED_STDOUT}, ...],
     "asserts": [STATEMENT, ...],
     "timeout_s": 2, "memory_mb": 256}
- a test passes when the program exits 0 within `timeout_s` and its stdout equals the expected one
  once trailing whitespace on each line and trailing empty lines are dropped;
- an assert passes when a process that runs the program, then that one statement in the program's
  namespace, exits 0 within `timeout_s` (stdin empty). The program runs as a module named
  `solution`, not as `__main__`, so an `if __name__ == "__main__":` block that reads stdin does not
  run; code at top level does. One process per assert keeps each verdict independent: a failing
  assert cannot hide the others, and the program cannot print a fake "passed" marker.
Checks run in order, tests first. After the first check that times out the rest are not run and
count as timed out too: a program that hangs costs one timeout, not one per check. A pool running
this verifier needs a call timeout above the time its slowest reference can take.

Score: value = 0.5 * pass_fraction + 0.5 * all_passed, with both kept in `components`. Status ok
when all passed, timeout when every failed check timed out, wrong otherwise; unparseable when the
response holds no program text; error for a bad reference or a sandbox that could not start.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from typing import Any, NamedTuple

from rlvr.verifiers.base import MISSING_REFERENCE, Score, Status, Verifier, is_missing, non_text_error, one_line
from rlvr.verifiers.sandbox import ProgramResult, SandboxError, run_program

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MEMORY_MB = 256
MAX_TIMEOUT_S = 60.0
MIN_MEMORY_MB, MAX_MEMORY_MB = 64, 8192
MAX_OUTPUT_BYTES = 1_000_000  # per run; raised to 4x the expected output when that is larger
EXTRACTED_CHARS = 4000
SHOWN_CHARS = 80  # of outputs and error lines quoted in a reason
PYTHON_TAGS = ("", "python", "py", "python3")
CANDIDATE_FILE, CHECK_FILE = "candidate.py", "check.py"
ASSERT_RUNNER = f"""import sys, types
solution = types.ModuleType("solution")
solution.__file__ = "{CANDIDATE_FILE}"
sys.modules["solution"] = solution
for path in ("{CANDIDATE_FILE}", "{CHECK_FILE}"):
    with open(path, encoding="utf-8") as file:
        exec(compile(file.read(), path, "exec"), solution.__dict__)
"""


def extract_program(response: str) -> str:
    """The last fenced python (or untagged) block of `response`, else the whole text."""
    blocks: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in response.splitlines():
        fence = line.strip()
        if current is None:
            if fence.startswith("```"):
                tag = fence[3:].strip().lower()
                current = []
                blocks.append((tag, current))
        elif fence == "```":
            current = None
        else:
            current.append(line)
    python_blocks = [lines for tag, lines in blocks if tag in PYTHON_TAGS]
    if python_blocks:
        return textwrap.dedent("\n".join(python_blocks[-1]) + "\n")
    return response


@dataclass(frozen=True)
class CodeReference:
    tests: list[tuple[str, str]]  # (stdin, expected stdout)
    asserts: list[str]
    timeout_s: float
    memory_mb: int


def parse_reference(reference: Any) -> CodeReference:
    """Read a reference; ValueError says what is wrong with it."""
    if isinstance(reference, str):
        try:
            reference = json.loads(reference)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"reference is not valid JSON: {exc}") from exc
    if not isinstance(reference, dict):
        raise ValueError(f"reference must be an object with 'tests' and/or 'asserts', got {type(reference).__name__}")
    unknown = set(reference) - {"tests", "asserts", "timeout_s", "memory_mb"}
    if unknown:
        raise ValueError(f"unknown reference keys: {', '.join(sorted(unknown))}")

    tests = reference.get("tests", [])
    if not isinstance(tests, list):
        raise ValueError("'tests' must be a list")
    parsed_tests = []
    for index, test in enumerate(tests, 1):
        if not isinstance(test, dict) or not isinstance(test.get("output"), str):
            raise ValueError(f"test {index} must be an object with a string 'output'")
        stdin = test.get("input", "")
        if not isinstance(stdin, str):
            raise ValueError(f"test {index}: 'input' must be a string")
        parsed_tests.append((stdin, test["output"]))

    asserts = reference.get("asserts", [])
    if not isinstance(asserts, list) or not all(isinstance(a, str) and a.strip() for a in asserts):
        raise ValueError("'asserts' must be a list of non-empty statements")
    if not parsed_tests and not asserts:
        raise ValueError("reference has no tests and no asserts")

    timeout_s = reference.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"'timeout_s' must be a number in (0, {MAX_TIMEOUT_S:g}]")
    memory_mb = reference.get("memory_mb", DEFAULT_MEMORY_MB)
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or not MIN_MEMORY_MB <= memory_mb <= MAX_MEMORY_MB:
        raise ValueError(f"'memory_mb' must be an integer in [{MIN_MEMORY_MB}, {MAX_MEMORY_MB}]")
    return CodeReference(parsed_tests, list(asserts), float(timeout_s), memory_mb)


class Check(NamedTuple):
    """One sandboxed run: a stdin/stdout test (expected is the stdout) or an assert (expected None)."""

    label: str
    source: str
    stdin: str
    expected: str | None
    files: dict[str, str]


def checks_for(program: str, spec: CodeReference) -> list[Check]:
    checks = [Check(f"test {i}", program, stdin, expected, {}) for i, (stdin, expected) in enumerate(spec.tests, 1)]
    for i, statement in enumerate(spec.asserts, 1):
        checks.append(Check(f"assert {i}", ASSERT_RUNNER, "", None, {CANDIDATE_FILE: program, CHECK_FILE: statement}))
    return checks


def normalize_output(text: str) -> list[str]:
    """Lines without trailing whitespace, trailing empty lines dropped."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _short(text: str) -> str:
    return repr(text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "...")


def _last_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return _short(lines[-1].strip()) if lines else "no stderr"


def _failure(check: Check, result: ProgramResult, timeout_s: float) -> tuple[str, bool] | None:
    """(why the check failed, whether that was a timeout), or None when it passed."""
    if result.timed_out:
        return f"timed out after {timeout_s:g} s", True
    if result.output_truncated:
        return "output exceeded the limit", False
    if result.returncode != 0:
        return f"exit code {result.returncode}: {_last_error_line(result.stderr)}", False
    if check.expected is not None and normalize_output(result.stdout) != normalize_output(check.expected):
        return f"wrong output: expected {_short(check.expected)}, got {_short(result.stdout)}", False
    return None


def _output_cap(check: Check) -> int:
    if check.expected is None:
        return MAX_OUTPUT_BYTES
    return max(MAX_OUTPUT_BYTES, 4 * len(check.expected.encode("utf-8", "surrogatepass")))


class CodeVerifier(Verifier):
    name = "code"
    domain = "code"
    version = "1"

    def reference_error(self, reference: Any) -> str | None:
        """The reference must parse and its asserts compile; nothing is run, so the check stays cheap and
        never executes code from the data."""
        if is_missing(reference):
            return MISSING_REFERENCE
        try:
            spec = parse_reference(reference)
        except ValueError as exc:
            return one_line(f"bad code reference: {exc}")
        for index, statement in enumerate(spec.asserts, 1):
            try:
                compile(statement, CHECK_FILE, "exec", dont_inherit=True)
            except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
                return one_line(f"bad code reference: assert {index} does not compile: {type(exc).__name__}: {exc}")
        return None

    def score(self, response: str, reference: Any) -> Score:
        if (problem := non_text_error(response)) is not None:
            return problem
        try:
            spec = parse_reference(reference)
        except ValueError as exc:
            return Score(0.0, "error", reason=f"bad code reference: {exc}")
        program = extract_program(response)
        if not program.strip():
            return Score(0.0, "unparseable", {"pass_fraction": 0.0, "all_passed": 0.0}, reason="no program text")
        extracted = program[:EXTRACTED_CHARS]

        checks = checks_for(program, spec)
        passed = timeouts = skipped = 0
        first_failure: str | None = None
        for position, check in enumerate(checks):
            try:
                result = run_program(
                    check.source,
                    check.stdin,
                    timeout_s=spec.timeout_s,
                    memory_mb=spec.memory_mb,
                    max_output_bytes=_output_cap(check),
                    extra_files=check.files,
                )
            except SandboxError as exc:
                return Score(0.0, "error", extracted=extracted, reason=f"{check.label}: sandbox failed: {exc}")
            failure = _failure(check, result, spec.timeout_s)
            if failure is None:
                passed += 1
                continue
            why, timed_out = failure
            if first_failure is None:
                first_failure = f"{check.label}: {why}"
            if timed_out:
                skipped = len(checks) - position - 1
                timeouts += 1 + skipped  # a check not run after a timeout counts as timed out
                break

        total = len(checks)
        fraction = passed / total
        all_passed = passed == total
        components = {"pass_fraction": fraction, "all_passed": 1.0 if all_passed else 0.0}
        value = 0.5 * fraction + 0.5 * components["all_passed"]
        if all_passed:
            return Score(value, "ok", components, extracted, f"all {total} checks passed")
        status: Status = "timeout" if timeouts == total - passed else "wrong"
        reason = f"{passed}/{total} passed; first failure: {first_failure}"
        if skipped:
            reason += f"; {skipped} checks not run after the timeout"
        return Score(value, status, components, extracted, reason)
