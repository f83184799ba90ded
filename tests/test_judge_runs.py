"""Whole runs rewarded by a judge (reward.judge, docs/rewards.md): the rewards rows carry the judge's words and
provenance, a failed verdict is left out of the update and counted in train_steps, a re-run with the same judge
asks it only what it never answered, a changed template asks it everything again, a judge whose calls keep failing
(at once, or by timing out on a server that sends a byte a second) stops the run in bounded time with one line
naming it, and a judge behind an API key gets it from the environment variable the config names (a run without it
stops in one line, and the key is nowhere in the store).

The judge is a small local endpoint whose verdict is a rule (the answer equals the reference) and which fails on
every answer holding a 3: these tests are about what the pipeline does with a judge's verdicts and failures; a
real model as the judge is tests/test_reward_server.py's and benchmarks/judge_agreement.py's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rlvr.errors import UserError
from rlvr.serving.server import serving_in_thread
from rlvr.storage.store import Store
from rlvr.storage.views import query
from rlvr.verifiers.cache import RewardCache, entry_key
from tests.cli_helpers import REPO, SMALL_RUN, cli_env, rlvr, rlvr_command
from tests.fork_server import ForkServer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_prefect")]

# 160 skills problems (32 held out, 128 that the difficulty stage asks about) instead of ~770: what the tests count
# still happens (the held-out evaluation asks more than the 21 failures that trip a breaker, the difficulty stage more
# than announce_calls' 100 calls, and the tiny model's label verdicts are right, wrong and failed)
SMALL = [*SMALL_RUN, "synthesize.source.per_category=20", "synthesize.source.verifier=judge"]
KEY, KEY_ENV = "s3cret-judge-key", "RLVR_TEST_JUDGE_KEY"  # the module's judge wants this key, read from KEY_ENV


class RuleJudge:
    """Says yes when the answer is the reference; answers 503 to every answer holding a 3; counts its calls."""

    def __init__(self, key: str | None = None) -> None:
        self.calls = 0
        self.key = key
        self.app = FastAPI()
        self.app.post("/get_reward")(self.reward)
        self.app.post("/v1/chat/completions")(self.complete)
        self.app.post("/down/v1/chat/completions")(self.down)
        self.app.post("/down/get_reward")(self.down)

    async def complete(self, request: Request) -> Any:
        if self.key is not None and request.headers.get("authorization") != f"Bearer {self.key}":
            return JSONResponse({"error": {"message": "invalid API key"}}, status_code=401)
        self.calls += 1
        text = (await request.json())["messages"][0]["content"]
        reference = re.search(r"^Reference answer: (.*)$", text, re.M).group(1)  # type: ignore[union-attr]
        answer = re.search(r"^<(ANSWER-[0-9a-f]{12})>\n(.*)\n</\1>$", text, re.M | re.S).group(2)  # type: ignore[union-attr]
        if "3" in answer:
            return JSONResponse({"error": {"message": "busy"}}, status_code=503)
        verdict = "yes" if answer.strip() == reference.strip() else "no"
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": verdict}}]}

    async def reward(self, request: Request) -> Any:
        """OpenRLHF's /get_reward by the same rule: 1.0 when the answer (after the question's line) is the label."""
        self.calls += 1
        body = await request.json()
        answers = [query.split("\n", 1)[1].strip() for query in body["query"]]
        return {"rewards": [float(a == (label or "").strip()) for a, label in zip(answers, body["labels"])]}

    async def down(self, request: Request) -> Any:
        return JSONResponse({"error": {"message": "down for maintenance"}}, status_code=500)


@pytest.fixture(scope="module")
def judge() -> Iterator[tuple[RuleJudge, str]]:
    """The rule judge behind an API key (KEY): a judged run gets it from KEY_ENV."""
    rule = RuleJudge(key=KEY)
    with serving_in_thread(rule.app) as url:
        yield rule, url


def judged(url: str, **extra: Any) -> list[str]:
    endpoint = {
        "base_url": f"{url}/v1",
        "model": "rule",
        "retries": 0,
        "timeout_s": 10,
        "api_key_env": KEY_ENV,
        **extra,
    }
    return [f"reward.judge={json.dumps(endpoint)}", "reward.max_error_rate=1.0"]


def run(forks: ForkServer, store: str, run_id: str, overrides: list[str]) -> subprocess.CompletedProcess:
    """A whole `rlvr run` process, the judge's key in KEY_ENV."""
    sets = [arg for o in [*SMALL, *overrides] for arg in ("--set", o)]
    result = rlvr(
        "run", "--store", store, "--run-id", run_id, *sets, env=cli_env(**{KEY_ENV: KEY}), timeout=600, forks=forks
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def run_here(store: str, run_id: str, overrides: list[str]) -> dict[str, Any]:
    """A whole run in this process, for a test that reads its store or the error it stops with (the CLI's path of
    that error, one line and exit status 2, is a subprocess's test): a subprocess would cost ~7 CPU-s of imports."""
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute

    return execute(store, load_config(None, [*SMALL, *overrides, f"run_id={run_id}"]))


def rows(store: str, sql: str) -> list[dict[str, Any]]:
    return query(Store.open(store), sql).to_pylist()


@pytest.fixture(scope="module")
def judged_store(judge, tmp_path_factory, rlvr_forks) -> tuple[str, dict[str, int], subprocess.CompletedProcess]:
    """One store, three runs of the same config: the judge, the same judge again, then a changed template; with
    the judge's call counts after each, and the first run's output (its warnings, for the key's test). The first is
    `rlvr run` in a subprocess, the key in its environment, as a user runs it; the other two, read only from the
    store, run in this process with the key in its environment."""
    rule, url = judge
    store = str(tmp_path_factory.mktemp("judged") / "store")
    calls: dict[str, int] = {}
    before = rule.calls
    first = run(rlvr_forks, store, "first", judged(url))
    calls["first"] = rule.calls - before
    with pytest.MonkeyPatch.context() as env:
        env.setenv(KEY_ENV, KEY)
        for run_id, extra in [
            ("again", {}),
            (
                "retemplated",
                {"template": "Question: {question}\nReference answer: {reference}\nAnswer to grade:\n{response}"},
            ),
        ]:
            before = rule.calls
            run_here(store, run_id, judged(url, **extra))
            calls[run_id] = rule.calls - before
    return store, calls, first


def test_a_judges_verdicts_are_stored_with_its_words_and_provenance(judge, judged_store) -> None:
    _, url = judge
    store, calls, _ = judged_store
    verdicts = rows(store, "SELECT * FROM rewards WHERE run_id = 'first'")
    assert {v["verifier"] for v in verdicts} == {"judge"}
    assert {v["status"] for v in verdicts} == {"ok", "wrong", "error"}  # the tiny model answers 3s and misses
    for v in verdicts:
        provenance = json.loads(v["provenance"])
        assert provenance["endpoint"] == f"{url}/v1" and provenance["model"] == "rule"
        if v["status"] == "error":
            assert v["reason"] == f"judge {url}/v1/chat/completions: HTTP 503: busy"
        else:
            assert v["reason"] == ("yes" if v["status"] == "ok" else "no")  # the judge's own words
            assert v["score"] == (1.0 if v["status"] == "ok" else 0.0)
    assert calls["first"] >= sum(1 for v in verdicts if not v["cache_hit"])  # label's misses (difficulty's, eval's)


def test_a_failed_verdict_is_left_out_of_the_update_and_counted(judged_store) -> None:
    store, _, _ = judged_store
    steps = rows(
        store,
        """SELECT t.step, t.rollouts, t.reward_errors, count(*) AS judged, count(*) FILTER (w.status = 'error') AS failed
           FROM train_steps t JOIN rewards w USING (run_id, step) WHERE t.run_id = 'first' GROUP BY ALL ORDER BY 1""",
    )
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["reward_errors"] == s["failed"]
        assert s["rollouts"] == s["judged"] - s["failed"]  # the update's rows: the failed ones are not among them
    assert sum(s["failed"] for s in steps) > 0


def test_the_same_judge_again_is_asked_only_what_it_never_answered(judged_store) -> None:
    store, _, _ = judged_store
    first, again = (
        rows(
            store,
            "SELECT w.status, w.cache_hit FROM rewards w JOIN rollouts r USING (rollout_id) "
            f"WHERE w.run_id = '{run_id}' ORDER BY r.step, r.slot, r.sample_index",
        )
        for run_id in ("first", "again")
    )
    assert [v["status"] for v in again] == [v["status"] for v in first]  # the same rollouts, the same verdicts
    assert all(v["cache_hit"] == (v["status"] != "error") for v in again)  # failures are never cached


def test_a_changed_template_asks_the_judge_again(judged_store) -> None:
    store, calls, _ = judged_store
    verdicts = rows(store, "SELECT verifier_version, cache_hit FROM rewards WHERE run_id = 'retemplated'")
    versions = {
        r["verifier_version"] for r in rows(store, "SELECT verifier_version FROM rewards WHERE run_id = 'first'")
    }
    # a new version: no verdict of the first two runs can answer it (a hit here is one its own difficulty stage made)
    assert len(versions) == 1 and {v["verifier_version"] for v in verdicts}.isdisjoint(versions)
    assert calls["retemplated"] >= sum(1 for v in verdicts if not v["cache_hit"]) > 0


def test_a_judge_that_fails_every_call_stops_the_run_at_its_first_stage_in_one_line(
    judge, tmp_path, rlvr_forks
) -> None:
    """Its circuit breaker trips on the 21st failure (reward.max_error_rate 0.1 of a 200-verdict window): in the
    first stage that asks, the held-out evaluation before the warm start, not after a stage has asked everything."""
    _, url = judge
    endpoint = {"base_url": f"{url}/down/v1", "model": "rule", "retries": 1, "backoff_s": 0, "timeout_s": 10}
    sets = [arg for o in [*SMALL, f"reward.judge={json.dumps(endpoint)}"] for arg in ("--set", o)]
    result = rlvr("run", "--store", str(tmp_path / "store"), *sets, env=cli_env(), timeout=600, forks=rlvr_forks)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]  # after the progress bar's last state
    assert last == (
        f"error: the judge at {url}/down/v1 failed 21 of its last 21 verdicts (more than reward.max_error_rate 0.1 "
        f"of a 200-verdict window), so the run stops asking it; last: judge {url}/down/v1/chat/completions: HTTP "
        "500: down for maintenance after 2 tries"
    )
    (record,) = Store.open(str(tmp_path / "store")).list_runs()
    assert (record["failed_stage"], record["failed_step"]) == ("evaluate", 0)  # the evaluation before the warm start


def test_a_step_whose_failures_pass_the_threshold_stops_the_label_stage_in_one_line(judge) -> None:
    """The label stage's check of a step's share holds beside the breaker: 16 failures of 16 verdicts pass 0.1 while
    the breaker (21 failures in its window) has not tripped."""
    from rlvr.verifiers.cache import VerifierConfig
    from rlvr.verifiers.model_rewards import RewardConfig, model_verdicts

    _, url = judge
    endpoint = {"base_url": f"{url}/down/v1", "model": "rule", "retries": 0}
    reward = RewardConfig.model_validate({"judge": endpoint, "max_error_rate": 0.1})
    cfg = VerifierConfig(judge=reward.judge)
    rollouts = [{"rollout_id": f"r{i}", "problem_id": "p", "prompt": "2+2=", "response": str(i)} for i in range(16)]
    with pytest.raises(UserError) as raised:
        model_verdicts(None, cfg, {"judge": rollouts}, {"p": ("judge", "4")}, reward.max_error_rate)
    assert str(raised.value) == (
        f"the judge at {url}/down/v1 failed 16 of 16 verdicts this step (more than reward.max_error_rate 0.1); first: "
        f"judge {url}/down/v1/chat/completions: HTTP 500: down for maintenance"
    )


TRICKLE_S = 0.25  # between the bytes: each read returns well within the deadline, the whole answer never does


class TricklingJudge(BaseHTTPRequestHandler):
    """Reads the request, sends its headers, then one byte every TRICKLE_S seconds: never a whole answer."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "1000")
        self.end_headers()
        try:
            for _ in range(int(120 / TRICKLE_S)):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(TRICKLE_S)
        except OSError:
            pass  # the client gave up


@contextmanager
def trickling_judge() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), TricklingJudge)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_judge_that_times_out_on_every_call_stops_the_run_within_two_minutes(tmp_path) -> None:
    """The review's judge (headers, then a byte a second, with timeout_s 3 and retries 1), four times faster: a byte
    every 0.25 s, timeout_s 1, no backoff; a deadline on each read would never fire. Before the breaker the
    difficulty stage would have asked every verdict of 2 tries each before any threshold applied. The run is made in
    this process: the stop's one line through `rlvr run` is the test above's."""
    with trickling_judge() as url:
        endpoint = {"base_url": f"{url}/v1", "model": "slow", "timeout_s": 1, "retries": 1, "backoff_s": 0}
        started = time.monotonic()
        with pytest.raises(UserError) as raised:
            run_here(str(tmp_path / "store"), "slow", [f"reward.judge={json.dumps(endpoint)}"])
        seconds = time.monotonic() - started
    assert str(raised.value) == (
        f"the judge at {url}/v1 failed 21 of its last 21 verdicts (more than reward.max_error_rate 0.1 of a "
        f"200-verdict window), so the run stops asking it; last: judge {url}/v1/chat/completions: no whole answer "
        "within 1 s after 2 tries"
    )
    assert seconds < 120, seconds


def test_a_judge_behind_a_key_works_end_to_end_and_without_the_key_the_run_stops_in_one_line(
    judge, judged_store, tmp_path, rlvr_forks
) -> None:
    """The module's judge wants KEY: the judged store's first run got it from KEY_ENV (the rule judge's own verdicts,
    never a 401), and the key is nowhere in its output or the store; a run without KEY_ENV stops in one line."""
    rule, url = judge
    store, _, result = judged_store
    verdicts = rows(store, "SELECT status, reason FROM rewards WHERE run_id = 'first'")
    assert {v["status"] for v in verdicts} == {"ok", "wrong", "error"}  # the rule judge's verdicts: it got the key
    assert {v["reason"] for v in verdicts if v["status"] == "error"} == {
        f"judge {url}/v1/chat/completions: HTTP 503: busy"  # its failures are its own 503s, never a 401
    }
    assert rule.calls > 0 and KEY not in result.stdout + result.stderr
    # before the difficulty stage asks: how many verdicts, then the rest's time at the first 2 x concurrency calls' rate
    # (each line after the time since the run started, where stderr is not a terminal)
    for line in (
        rf"warning: difficulty will ask the judge at {re.escape(url)}/v1 for up to 256 verdicts \(128 problems x 2; "
        r"the reward cache answers the ones it holds\)",
        rf"warning: the judge at {re.escape(url)}/v1 answered difficulty's first 8 calls in \d+ s: its other 248 "
        r"will take about \d+ (s|min) at that rate",
    ):
        assert re.search(rf"^(\[[\d:]+\] )?{line}$", result.stderr, re.M), result.stderr[-3000:]
    (record,) = [r for r in Store.open(store).list_runs() if r["run_id"] == "first"]
    config = json.loads(record["config_json"])
    assert config["reward"]["judge"]["api_key_env"] == KEY_ENV  # the variable's name, not the key
    stored = [path for path in Path(store).rglob("*") if path.is_file()]
    assert stored and not [path for path in stored if KEY.encode() in path.read_bytes()]
    sets = [arg for o in [*SMALL, *judged(url)] for arg in ("--set", o)]
    unset = rlvr("run", "--store", str(tmp_path / "other"), *sets, env=cli_env(), timeout=300, forks=rlvr_forks)
    assert unset.returncode != 0 and "Traceback" not in unset.stderr
    assert unset.stderr.strip().splitlines()[-1] == (
        f"error: config key 'reward.judge.api_key_env': the environment variable {KEY_ENV} is not set: "
        f"export it with the API key (got '{KEY_ENV}')"
    )


def test_the_report_shows_the_judges_failed_share_and_latency(judged_store, tmp_path) -> None:
    """The page `rlvr report first again` writes, made in this process (a subprocess would cost its imports)."""
    from rlvr.flows.report import write_report

    store, _, _ = judged_store
    out = tmp_path / "report.html"
    write_report(Store.open(store), ["first", "again"], out)
    page = out.read_text()
    assert "Judge: failed verdicts and latency" in page
    for run_id in ("first", "again"):
        (counts,) = rows(
            store,
            f"SELECT count(*) AS n, count(*) FILTER (status = 'error') AS failed FROM rewards WHERE run_id = '{run_id}'",
        )
        share = counts["failed"] / counts["n"]
        assert f"{run_id}: {counts['failed']:,} of {counts['n']:,} failed ({share:.1%})" in page


def test_difficulty_and_evaluation_ask_the_judge_too(judged_store) -> None:
    """Without the judge there (the verifiers' pool has no endpoint), every judged answer scored `error`: no
    problem had a success and every held-out accuracy was 0."""
    store, _, _ = judged_store
    (difficulty,) = rows(store, "SELECT sum(successes) AS successes, count(*) AS n FROM difficulty")
    assert difficulty["n"] > 0 and difficulty["successes"] > 0
    evals = rows(store, "SELECT phase, accuracy FROM evals WHERE run_id = 'first' ORDER BY step, phase")
    assert [e["phase"] for e in evals] == ["init", "warmstart", "rl"] and max(e["accuracy"] for e in evals) > 0


def test_the_difficulty_stages_verdicts_are_in_the_stores_cache_for_a_resumed_run(judged_store) -> None:
    """The difficulty stage commits the judge's verdicts behind its pass rates as a `reward_cache` artifact: a fresh
    process (a resumed run, `rlvr relabel`) finds them without asking the judge, and the label stages that hit them
    do not commit them again."""
    store, _, _ = judged_store
    s = Store.open(store)
    (difficulty,) = s.manifests(kind="difficulty", run_id="first")
    caches = s.manifests(kind="reward_cache", run_id="first")
    (own,) = [m for m in caches if m.stage == "difficulty"]
    assert sorted(own.parents) == sorted(difficulty.parents)  # lineage: the problems and the policy it sampled
    entries = s.read_table(own.artifact_id).to_pylist()
    successes = sum(s.read_table(difficulty.artifact_id).column("successes").to_pylist())
    assert {e["verifier"] for e in entries} == {"judge"} and {e["status"] for e in entries} == {"ok", "wrong"}
    assert 0 < sum(e["status"] == "ok" for e in entries) <= successes  # distinct answers behind the successes
    keys = [entry_key(e) for e in entries]
    assert len(set(keys)) == len(keys)
    assert all(score is not None for score in RewardCache(s).lookup(keys))  # a fresh process's cache has them
    labelled = {
        entry_key(e) for m in caches if m.stage != "difficulty" for e in s.read_table(m.artifact_id).to_pylist()
    }
    assert labelled and labelled.isdisjoint(keys)


def test_a_judge_scores_pairs_with_their_questions_through_the_cache(judge, monkeypatch) -> None:
    from rlvr.verifiers.cache import VerifierConfig, score_cached, score_rollouts
    from rlvr.verifiers.judge import JudgeConfig

    rule, url = judge
    monkeypatch.setenv(KEY_ENV, KEY)
    cfg = VerifierConfig(judge=JudgeConfig(base_url=f"{url}/v1", model="rule", retries=0, api_key_env=KEY_ENV))
    pairs = [("12", "12"), ("7", "8"), ("13", "13")]  # right, wrong, and an answer the rule judge fails on
    before = rule.calls
    scores, hits, _ = score_cached(None, cfg, pairs, ["judge"] * 3, questions=["5+7=", "4+4=", "6+7="])
    assert [s.status for s in scores] == ["ok", "wrong", "error"] and hits == [False] * 3
    again, hits, _ = score_cached(None, cfg, pairs, ["judge"] * 3, questions=["5+7=", "4+4=", "6+7="])
    assert [s.status for s in again] == ["ok", "wrong", "error"] and hits == [True, True, False]
    assert rule.calls - before == 4  # the failure is asked again; the verdicts are not
    (alone,), _, _ = score_cached(None, cfg, [("12", "12")], ["judge"])  # no question given: no call
    assert alone.status == "error" and alone.reason == "the judge was given no question for this answer"
    # rollouts with their questions, as CLPO's check of its rewrites scores them: asked, one a new question
    rollouts = [{"problem_id": "p", "response": "12"}, {"problem_id": "p", "response": "11"}]
    verdicts, _ = score_rollouts(None, cfg, rollouts, {"p": ("judge", "12")}, questions=["7+5=", "7+5="])
    assert [v["status"] for v in verdicts] == ["ok", "wrong"] and rule.calls - before == 6


def test_a_reward_model_rewards_a_run_and_a_dead_one_stops_it(judge, tmp_path) -> None:
    """reward.model: the servers' /get_reward numbers are the rewards, with their provenance; a server answering
    500 stops the run in one line naming it. Both runs are made in this process (the CLI's line of a breaker's stop
    is test_a_judge_that_fails_every_call_stops_the_run_at_its_first_stage_in_one_line's)."""
    _, url = judge
    store = str(tmp_path / "store")
    model = {"urls": [url], "name": "rule", "threshold": 0.5, "max_retries": 0}
    rewarded = ["synthesize.source.verifier=reward_model"]
    run_here(store, "rm", [*rewarded, f"reward.model={json.dumps(model)}"])
    verdicts = rows(store, "SELECT * FROM rewards WHERE run_id = 'rm'")
    assert {v["verifier"] for v in verdicts} == {"reward_model"} and {v["status"] for v in verdicts} <= {"ok", "wrong"}
    assert all(v["score"] == (1.0 if v["status"] == "ok" else 0.0) for v in verdicts)
    assert {v["provenance"] for v in verdicts} == {json.dumps({"endpoints": [url], "model": "rule"}, sort_keys=True)}
    assert [r["reward_errors"] for r in rows(store, "SELECT reward_errors FROM train_steps ORDER BY step")] == [0, 0]

    dead = {"urls": [f"{url}/down"], "name": "rule", "max_retries": 0}
    with pytest.raises(UserError) as raised:
        run_here(str(tmp_path / "dead"), "dead", [*rewarded, f"reward.model={json.dumps(dead)}"])
    assert str(raised.value) == (  # its breaker, at its first stage: each answer of a failed batch is a failed verdict
        f"the reward model at {url}/down failed 21 of its last 21 verdicts (more than reward.max_error_rate "
        f"0.1 of a 200-verdict window), so the run stops asking it; last: reward server {url}/down/get_reward: HTTP "
        "500: down for maintenance"
    )


def test_relabelling_a_judged_run_asks_its_judge_again_only_what_failed(judge, judged_store, rlvr_forks) -> None:
    """`rlvr relabel` reads the run's reward.judge: the judge's cached verdicts stand, the failed ones are asked
    again with their questions (and fail again: the rule judge fails on every 3), so nothing flips. It reads only
    that section of the run's config, so it never imports torch (the whole config's type imports every stage)."""
    rule, url = judge
    store, _, _ = judged_store
    before, calls = rows(store, "SELECT rollout_id, status, reason FROM rewards WHERE run_id = 'again'"), rule.calls
    command = [sys.executable, "-X", "importtime", *rlvr_command("relabel", "again", "--store", store)[1:]]
    result = subprocess.run(
        command, capture_output=True, text=True, cwd=REPO, env=cli_env(**{KEY_ENV: KEY}), timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "0 verdicts flipped (0 up, 0 down)" in result.stdout
    imported = {
        line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    }
    assert "duckdb" in imported and "torch" not in imported
    after = rows(store, "SELECT rollout_id, status, reason FROM relabeled_rewards WHERE run_id = 'again'")
    assert sorted(after, key=str) == sorted(before, key=str)
    failed = [r for r in after if r["status"] == "error"]
    assert failed and {r["reason"] for r in failed} == {f"judge {url}/v1/chat/completions: HTTP 503: busy"}
    assert rule.calls - calls == len(failed)  # every other verdict is in the store, a difficulty shard's too

    # scoring them with a model the run was never given: the line a run says, without Prefect's log of the task
    result = rlvr(
        "relabel",
        "again",
        "--verifier",
        "reward_model",
        "--store",
        store,
        env=cli_env(**{KEY_ENV: KEY}),
        timeout=300,
        forks=rlvr_forks,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: problems name the 'reward_model' verifier but reward.model is not set (docs/rewards.md)"
    )
