"""The LLM judge (verifiers/judge.py): its reply parsers, and its calls against servers that fail. A failed call is a
verdict with status `error` and one line naming the endpoint, never a 0 that looks earned; retries back off and
every call ends within its deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from rlvr.trainer.reward_server import serving_in_thread
from rlvr.verifiers.judge import JudgeClient, JudgeConfig, JudgeItem, parse_reply, render

ITEM = JudgeItem("What is 2+2?", "4", "It is 4.")


@pytest.mark.parametrize(
    ("parser", "reply", "value", "status", "extracted"),
    [
        ("yes_no", "Yes, it agrees.", 1.0, "ok", "yes"),
        ("yes_no", "The answer is NO.", 0.0, "wrong", "no"),
        ("yes_no", "yesterday it was nothing", None, "error", None),  # no whole word yes or no
        ("score_10", "Score: 7/10", 0.7, "ok", "7"),
        ("score_10", "10", 1.0, "ok", "10"),
        ("score_10", "2.5 of ten", 0.25, "wrong", "2.5"),
        ("score_10", "11 points", None, "error", None),
        ("json", 'Verdict: {"score": 0.25}', 0.25, "wrong", '{"score": 0.25}'),
        ("json", '{"correct": true, "why": "same number"}', 1.0, "ok", '{"correct": true, "why": "same number"}'),
        ("json", '{"score": 3}', None, "error", None),
        ("json", "{not json}", None, "error", None),
    ],
)
def test_a_reply_is_parsed_or_is_an_error_never_a_zero_it_did_not_give(parser, reply, value, status, extracted) -> None:
    score = parse_reply(reply, parser)
    assert (score.status, score.extracted) == (status, extracted)
    if status == "error":
        assert score.reason is not None and repr(reply[:20])[1:-1][:10] in score.reason
    else:
        assert score.value == pytest.approx(value)


def test_the_template_reads_the_question_the_reference_and_the_response() -> None:
    text = render("Q={question} R={reference} A={response}", JudgeItem("q?", {"x": 1}, "a."))
    assert text == 'Q=q? R={"x": 1} A=a.'


def chat(content: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}


def judge_app(behaviour: str, calls: list[float]) -> FastAPI:
    """A judge endpoint that behaves as `behaviour` says, noting when each call came."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> Any:
        calls.append(time.monotonic())
        await request.json()
        if behaviour == "500" or (behaviour == "500-then-yes" and len(calls) <= 2):
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=500)
        if behaviour == "400":
            return JSONResponse({"error": {"message": "no such model"}}, status_code=400)
        if behaviour == "hang":
            await asyncio.sleep(5)
        if behaviour == "garbage":
            return PlainTextResponse("<html>gateway</html>")
        if behaviour == "unparseable":
            return chat("I would rather not say.")
        if behaviour == "trickle":

            async def slowly() -> AsyncIterator[bytes]:
                for _ in range(50):
                    yield b" "
                    await asyncio.sleep(0.1)

            return StreamingResponse(slowly(), media_type="application/json")
        return chat("yes")

    return app


def ask(url: str, items: list[JudgeItem], **settings: Any) -> tuple[list[Any], float]:
    cfg = JudgeConfig(base_url=f"{url}/v1", model="stub", **{"backoff_s": 0.05, **settings})
    started = time.monotonic()
    verdicts = JudgeClient(cfg).verdicts(items)
    return verdicts, time.monotonic() - started


@pytest.mark.parametrize(
    ("behaviour", "tries", "problem"),
    [
        ("500", 3, 'HTTP 500: {"error":{"message":"overloaded"}} after 3 tries'),
        ("hang", 3, "timed out after 0.5s after 3 tries"),
        ("trickle", 3, "no whole answer within 0.5s after 3 tries"),
        ("garbage", 3, "the answer is not a chat completion: '<html>gateway</html>' after 3 tries"),
        ("400", 1, 'HTTP 400: {"error":{"message":"no such model"}}'),  # not retried: asking again cannot help
    ],
)
def test_a_failing_server_gives_an_error_verdict_naming_it_after_its_retries(behaviour, tries, problem) -> None:
    calls: list[float] = []
    with serving_in_thread(judge_app(behaviour, calls)) as url:
        (verdict,), seconds = ask(url, [ITEM], timeout_s=0.5, retries=2)
    assert verdict.score.status == "error" and verdict.raw is None
    assert verdict.score.reason == f"judge {url}/v1/chat/completions: {problem}"
    assert len(calls) == tries
    assert calls[-1] - calls[0] >= 0.05 * (2 ** (tries - 1) - 1)  # the backoff: 0.05 s, then 0.1 s
    assert seconds < tries * (0.5 + 0.5) + 2  # every try within its deadline, plus the waits between them


def test_a_server_that_recovers_is_asked_again_and_its_verdict_kept() -> None:
    calls: list[float] = []
    with serving_in_thread(judge_app("500-then-yes", calls)) as url:
        (verdict,), _ = ask(url, [ITEM], retries=2)
    assert len(calls) == 3 and (verdict.score.status, verdict.score.value, verdict.raw) == ("ok", 1.0, "yes")
    assert verdict.score.reason == "yes"  # the judge's own words travel with the verdict (and into the cache)


def test_a_reply_without_a_verdict_is_an_error_and_not_asked_again() -> None:
    calls: list[float] = []
    with serving_in_thread(judge_app("unparseable", calls)) as url:
        (verdict,), _ = ask(url, [ITEM], retries=2)
    assert len(calls) == 1 and verdict.raw == "I would rather not say."
    assert verdict.score.status == "error" and "has no yes or no" in str(verdict.score.reason)


def test_a_server_that_is_gone_is_an_error_for_every_item() -> None:
    calls: list[float] = []
    with serving_in_thread(judge_app("yes", calls)) as url:
        pass  # stopped: nothing listens there any more
    verdicts, seconds = ask(url, [ITEM] * 3, retries=1, timeout_s=2)
    assert [v.score.status for v in verdicts] == ["error"] * 3 and not calls
    assert all("ConnectError" in str(v.score.reason) and "after 2 tries" in str(v.score.reason) for v in verdicts)
    assert seconds < 10


def test_calls_run_side_by_side_and_keep_to_the_requests_per_minute() -> None:
    calls: list[float] = []
    with serving_in_thread(judge_app("yes", calls)) as url:
        verdicts, seconds = ask(url, [ITEM] * 5, concurrency=5, requests_per_minute=600)  # a start every 0.1 s
    assert [v.score.status for v in verdicts] == ["ok"] * 5 and len(calls) == 5
    assert seconds >= 0.4  # the fifth call started 0.4 s after the first
