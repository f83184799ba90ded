"""The verifier pool: results stay aligned with inputs whatever a call does (sleep past the timeout,
os._exit, segfault, raise, exhaust its memory limit), timeouts return on time, workers are replaced,
and no worker outlives the pool."""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import time

import pytest

from rlvr.errors import UserError
from rlvr.verifiers.base import Score
from rlvr.verifiers.math import MathVerifier
from rlvr.verifiers.pool import VerifierPool

pytestmark = pytest.mark.serial  # timeouts must return within the limit + 2 s


class MisbehavingMathVerifier(MathVerifier):
    """The math verifier, except for responses that name a way to misbehave. Loaded by the
    workers from this module (the pool passes its import path "test_verifier_pool:...")."""

    name = "misbehaving-math"

    def score(self, response, reference):
        if response == "sleep":
            time.sleep(60)
        if response == "exit":
            os._exit(3)
        if response == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        if response == "raise":
            raise RuntimeError("boom")
        if response == "allocate":
            bytearray(1024 * 1024 * 1024)  # 1 GiB: over the 512 MiB limit, refused before use
        if response == "not a score":
            return 42
        if response == "memory limit":
            soft, _ = resource.getrlimit(resource.RLIMIT_AS)
            return Score(1.0, "ok", {"rlimit_as_mb": soft / (1024 * 1024)})
        return super().score(response, reference)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _ordinary(count: int) -> tuple[list[tuple[str, str]], list[str]]:
    pairs, expected = [], []
    for i in range(count):
        if i % 4 == 0:
            pairs.append((f"Adding up gives {i} apples.\n#### {i + 1}", str(i)))
            expected.append("wrong")
        elif i % 4 == 1:
            pairs.append(
                (f"So the result is $\\boxed{{\\frac{{{2 * i}}}{{{2 * i + 2}}}}}$", f"\\frac{{{i}}}{{{i + 1}}}")
            )
            expected.append("ok")
        elif i % 4 == 2:
            pairs.append((f"The answer is {i}.5", f"{2 * i + 1}/2"))
            expected.append("ok")
        else:
            pairs.append(("I cannot solve this.", str(i)))
            expected.append("unparseable")
    return pairs, expected


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(MisbehavingMathVerifier, workers=2, timeout_s=1.0, memory_mb=512) as started:
        yield started


def test_results_stay_aligned_through_every_kind_of_failure(pool):
    pairs = [
        ("#### 7", "7"),
        ("sleep", "1"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("exit", "1"),
        ("raise", "1"),
        ("#### 8", "9"),
        ("segfault", "1"),
        ("allocate", "1"),
        ("not a score", "1"),
        ("nothing to see", "1"),
        ("\\boxed{9^{9^{9^{9}}}}", "1"),
        ("#### 10", "10"),
    ]
    scores = pool.score_many(pairs)
    assert [s.status for s in scores] == [
        "ok",
        "timeout",
        "ok",
        "error",
        "error",
        "wrong",
        "error",
        "error",
        "error",
        "unparseable",
        "error",
        "ok",
    ]
    assert scores[1].reason == "call exceeded 1 s; worker killed and replaced"
    assert scores[3].reason == "worker died: exit code 3"
    assert scores[4].reason == "RuntimeError: boom"
    assert scores[6].reason == "worker died: killed by SIGSEGV"
    assert scores[7].reason.startswith("MemoryError")
    assert scores[8].reason == "verifier returned int, not a Score"
    assert [s.value for s in scores] == [1.0, 0, 1.0, 0, 0, 0, 0, 0, 0, 0, 0, 1.0]


def test_timeout_returns_within_the_limit_and_the_worker_is_replaced(pool):
    before = set(pool.worker_pids())
    start = time.monotonic()
    [score] = pool.score_many([("sleep", "1")])
    elapsed = time.monotonic() - start
    assert score.status == "timeout"
    assert elapsed < pool.timeout_s + 2.0
    after = set(pool.worker_pids())
    assert len(after) == 2 and len(before - after) == 1


def test_memory_limit_is_applied_in_each_worker(pool):
    scores = pool.score_many([("memory limit", "1")] * 4)
    assert {s.components["rlimit_as_mb"] for s in scores} == {512.0}


def test_ordinary_answers_after_the_failures_are_labelled_correctly(pool):
    pool.score_many([("exit", "1"), ("sleep", "1"), ("raise", "1")])
    pairs, expected = _ordinary(1000)
    scores = pool.score_many(pairs)
    assert [s.status for s in scores] == expected


def test_empty_input_gives_empty_output(pool):
    assert pool.score_many([]) == []


def test_no_worker_outlives_the_pool():
    seen: set[int] = set()
    with VerifierPool(MisbehavingMathVerifier, workers=2, timeout_s=1.0, memory_mb=512) as pool:
        seen.update(pool.worker_pids())
        pool.score_many([("exit", "1"), ("#### 1", "1")])
        seen.update(pool.worker_pids())
        assert len(seen) == 3
        assert all(_alive(pid) for pid in pool.worker_pids())
    ours = [p for p in multiprocessing.active_children() if p.pid in seen]
    assert ours == []
    assert not any(_alive(pid) for pid in seen)


class Interrupted(Exception):
    pass


def _interrupt(signum, frame):
    raise Interrupted


def test_close_after_an_interrupted_call_kills_the_busy_worker():
    """Ctrl-C during score_many: close() must not wait for the running call to finish."""
    pool = VerifierPool(MisbehavingMathVerifier, workers=1, timeout_s=30.0, memory_mb=512)
    pool.start()
    [pid] = pool.worker_pids()
    assert pool.score_many([("#### 1", "1")])[0].status == "ok"  # the worker is up and idle
    previous = signal.signal(signal.SIGALRM, _interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(Interrupted):
            pool.score_many([("sleep", "1")])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert _alive(pid)
    start = time.monotonic()
    pool.close()
    assert time.monotonic() - start < 1.0
    assert not _alive(pid)


def test_unknown_verifier_fails_before_any_worker_starts():
    with pytest.raises(UserError, match="unknown verifier 'nope'; registered: arithmetic, "):
        VerifierPool("nope")
