"""Code verifier throughput: programs/s through our pool (2 workers, every program sandboxed) against
a plain sequential loop of subprocess.run with no sandbox, on the same 500 small programs.

Both sides run the same interpreter with the same flags (`-I -S`), so the difference is the price of
the sandbox (per-run uid, rlimits, bubblewrap where it works, cleanup) net of the pool's parallelism.

    .venv/bin/python benchmarks/code_verifier_throughput.py [N]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from rlvr.verifiers.code import normalize_output
from rlvr.verifiers.pool import VerifierPool
from rlvr.verifiers.sandbox import bubblewrap_available, interpreter

PROGRAMS = [
    # (program, input, expected stdout of a correct program) - the program is right or wrong as written
    ("a, b = map(int, input().split())\nprint(a + b)", "{a} {b}", "{sum}"),
    ("a, b = map(int, input().split())\nprint(a - b)", "{a} {b}", "{sum}"),
    ("s = input()\nprint(s[::-1])", "abc{a}", "{a_rev}cba"),
    ("n = int(input())\nprint(sum(range(n + 1)))", "{a}", "{triangle}"),
    ("n = int(input())\nprint(sum(range(n)))", "{a}", "{triangle}"),
    ("xs = list(map(int, input().split()))\nprint(max(xs))", "{a} {b} 7", "{maximum}"),
    ("n = int(input())\nprint('\\n'.join(str(i * i) for i in range(n % 5 + 1)))", "{a}", "{squares}"),
    ("import sys\nprint(len(sys.stdin.read().split()))", "{a} {b} x y", "4"),
]


def make_inputs(n: int) -> tuple[list[tuple[str, dict]], list[str]]:
    pairs, expected = [], []
    for i in range(n):
        a, b = i * 7 % 101, i % 13
        values = {
            "a": a,
            "b": b,
            "sum": a + b,
            "a_rev": str(a)[::-1],
            "triangle": a * (a + 1) // 2,
            "maximum": max(a, b, 7),
            "squares": "\n".join(str(k * k) for k in range(a % 5 + 1)),
        }
        program, stdin, output = PROGRAMS[i % len(PROGRAMS)]
        stdin, output = stdin.format(**values), output.format(**values)
        pairs.append((f"```python\n{program}\n```", {"tests": [{"input": stdin, "output": output}]}))
        expected.append(output)
    return pairs, expected


def plain_loop(pairs: list[tuple[str, dict]]) -> list[bool]:
    """The peer: write the program to a file, subprocess.run it, compare stdout. No isolation."""
    python = interpreter()
    passed = []
    with tempfile.TemporaryDirectory() as work_dir:
        path = os.path.join(work_dir, "solution.py")
        for response, reference in pairs:
            program = response.removeprefix("```python\n").removesuffix("\n```")
            test = reference["tests"][0]
            with open(path, "w") as file:
                file.write(program)
            try:
                run = subprocess.run(
                    [python, "-I", "-S", path], input=test["input"], capture_output=True, text=True, timeout=2
                )
                passed.append(run.returncode == 0 and normalize_output(run.stdout) == normalize_output(test["output"]))
            except subprocess.TimeoutExpired:
                passed.append(False)
    return passed


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    pairs, _ = make_inputs(n)
    isolation = "bubblewrap + rlimits" if bubblewrap_available() else "rlimits only"
    if os.geteuid() == 0:
        isolation += ", per-run uid"

    started = time.perf_counter()
    plain = plain_loop(pairs)
    plain_s = time.perf_counter() - started

    with VerifierPool("code", workers=2, timeout_s=10) as pool:
        pool.score_many(pairs[:4])  # workers started and their bubblewrap probe done
        started = time.perf_counter()
        scores = pool.score_many(pairs)
        pool_s = time.perf_counter() - started
    ours = [score.status == "ok" for score in scores]

    agree = sum(a == b for a, b in zip(ours, plain))
    print(f"{n} programs, {sum(plain)} passing; isolation: {isolation}; interpreter {interpreter()}")
    print(f"{'method':<44} {'seconds':>8} {'programs/s':>11}")
    print(f"{'plain subprocess.run loop, no sandbox':<44} {plain_s:>8.2f} {n / plain_s:>11.1f}")
    print(f"{'code verifier, VerifierPool(workers=2)':<44} {pool_s:>8.2f} {n / pool_s:>11.1f}")
    print(f"verdicts agree on {agree}/{n}")
    print(f"ratio (pool / plain loop, programs/s): {plain_s / pool_s:.2f}x")


if __name__ == "__main__":
    main()
