"""The reward-server client (verifiers/reward_client.py) against servers that fail: 500s, one that sleeps past the
timeout, one that trickles its answer, garbage JSON, the wrong number of rewards, one that dies mid-call, none
listening. Each raises `RewardServerError` with one line naming the endpoint, after exactly the configured retries
and within the time they allow; a 4xx is not retried. (The real servers: tests/test_reward_server.py.)"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from pydantic import ValidationError

from rlvr.verifiers.reward_client import Classification, RewardClientConfig, RewardModelClient, RewardServerError


class FaultyServer(ThreadingHTTPServer):
    """Answers every POST the way `mode` says, and counts the requests it got."""

    daemon_threads = True

    def __init__(self, mode: str) -> None:
        super().__init__(("127.0.0.1", 0), FaultyHandler)
        self.mode = mode
        self.requests: list[dict[str, Any]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class FaultyHandler(BaseHTTPRequestHandler):
    server: FaultyServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def reply(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        rows = len(body.get("query") or body.get("input") or [])
        mode = self.server.mode
        if mode == "keyed" and self.headers.get("Authorization") != "Bearer s3cret":
            self.reply(401, b'{"error": {"message": "invalid API key"}}')
        elif mode in ("ok", "keyed"):
            self.reply(200, json.dumps({"rewards": [float(len(q)) for q in body["query"]]}).encode())
        elif mode == "500":
            self.reply(500, b'{"error": {"message": "CUDA out of memory\\nsecond line", "code": 500}}')
        elif mode == "422":
            self.reply(422, b'{"detail": "query: field required"}')
        elif mode == "sleep":
            time.sleep(3)
            self.reply(200, json.dumps({"rewards": [0.0] * rows}).encode())
        elif mode == "trickle":  # each byte well within the read timeout, the whole answer far past it
            data = json.dumps({"rewards": [0.0] * rows}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            for byte in data:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.1)
        elif mode == "huge":  # over the 64 MiB cap
            self.send_response(200)
            self.send_header("Content-Length", str(65 << 20))
            self.end_headers()
            try:
                for _ in range(65):
                    self.wfile.write(b" " * (1 << 20))
            except OSError:
                pass  # the client hung up at the cap
        elif mode == "garbage":
            self.reply(200, b"<html>502 Bad Gateway</html>")
        elif mode == "wrong_count":
            self.reply(200, json.dumps({"rewards": [1.0] * (rows + 1)}).encode())
        elif mode == "nan":
            self.reply(200, b'{"rewards": [NaN]}')
        elif mode == "dies":  # the connection closes with no answer
            self.close_connection = True
        elif mode == "dies_mid_answer":
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b'{"rewards": [0.')
            self.close_connection = True


@pytest.fixture
def faulty() -> Iterator[Any]:
    started: list[FaultyServer] = []

    def start(mode: str) -> FaultyServer:
        server = FaultyServer(mode)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def client(*urls: str, **settings: Any) -> RewardModelClient:
    values = {"timeout_s": 0.5, "max_retries": 2, "backoff_s": 0.05, **settings}
    return RewardModelClient(RewardClientConfig(urls=list(urls), **values))


@pytest.mark.parametrize(
    ("mode", "problem"),
    [
        ("500", "failed 3 times; the last time: HTTP 500: CUDA out of memory second line"),
        ("sleep", "failed 3 times; the last time: timed out after 0.5 s"),
        ("trickle", "failed 3 times; the last time: no whole answer within 0.5 s"),
        ("garbage", "failed 3 times; the last time: answer is not JSON: '<html>502 Bad Gateway</html>'"),
        ("wrong_count", "failed 3 times; the last time: answered 3 rewards for 2 queries"),
        ("nan", "failed 3 times; the last time: reward 0 is nan, not a finite number"),
        ("dies", "failed 3 times; the last time: RemoteProtocolError: Server disconnected without sending a response."),
        ("dies_mid_answer", "failed 3 times; the last time: RemoteProtocolError: peer closed connection"),
    ],
)
def test_a_failing_server_raises_one_line_after_its_retries(faulty, mode: str, problem: str) -> None:
    server = faulty(mode)
    started = time.monotonic()
    with client(server.url) as reward_client, pytest.raises(RewardServerError) as raised:
        reward_client.get_reward(["1+1=2", "2+2=4"][: 1 if mode == "nan" else 2])
    elapsed = time.monotonic() - started
    message = str(raised.value)
    assert message.startswith(f"reward server {server.url}/get_reward: {problem}"), message
    assert "\n" not in message and raised.value.url == f"{server.url}/get_reward"
    assert len(server.requests) == 3  # one try and two retries
    assert elapsed < 3 * (0.5 + 0.2) + 0.05 + 0.1 + 1.0  # three budgets (+ a read's slack), the backoffs, set-up


def test_a_refused_request_is_not_retried(faulty) -> None:
    server = faulty("422")
    with client(server.url) as reward_client, pytest.raises(RewardServerError) as raised:
        reward_client.get_reward(["1"])
    assert str(raised.value) == (
        f"reward server {server.url}/get_reward: refused the request: HTTP 422: query: field required"
    )
    assert len(server.requests) == 1


def test_an_answer_over_the_size_cap_fails_and_is_not_asked_again(faulty) -> None:
    server = faulty("huge")
    with client(server.url, timeout_s=30) as reward_client, pytest.raises(RewardServerError) as raised:
        reward_client.get_reward(["1"])
    assert str(raised.value) == f"reward server {server.url}/get_reward: answer over {64 << 20} bytes"
    assert len(server.requests) == 1


def test_the_api_key_goes_as_a_bearer_token_from_the_named_environment_variable(faulty, monkeypatch) -> None:
    server = faulty("keyed")
    monkeypatch.setenv("RLVR_TEST_RM_KEY", "s3cret")
    with client(server.url, api_key_env="RLVR_TEST_RM_KEY") as reward_client:
        assert reward_client.get_reward(["1+1=2"]) == [5.0]
    with client(server.url) as reward_client, pytest.raises(RewardServerError) as raised:
        reward_client.get_reward(["1+1=2"])
    assert str(raised.value) == f"reward server {server.url}/get_reward: refused the request: HTTP 401: invalid API key"
    assert len(server.requests) == 2  # the 401 is not asked again
    monkeypatch.delenv("RLVR_TEST_RM_KEY")
    with pytest.raises(ValidationError, match="the environment variable RLVR_TEST_RM_KEY is not set: export it"):
        RewardClientConfig(urls=[server.url], api_key_env="RLVR_TEST_RM_KEY")


def test_no_server_listening_is_retried_then_one_line() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"  # bound, not listening: connections are refused
        started = time.monotonic()
        with client(url) as reward_client, pytest.raises(RewardServerError) as raised:
            reward_client.get_reward(["1"])
    assert str(raised.value).startswith(f"reward server {url}/get_reward: failed 3 times; the last time: ConnectError")
    assert time.monotonic() - started < 2


def test_one_bad_shard_fails_the_batch_and_names_its_server(faulty) -> None:
    good, bad = faulty("ok"), faulty("500")
    failing = pytest.raises(RewardServerError, match=f"^reward server {bad.url}/get_reward: failed 2 times;")
    with client(good.url, bad.url, max_retries=1) as reward_client, failing:
        reward_client.get_reward(["1", "22", "333", "4444"])
    assert [r["query"] for r in good.requests] == [["1", "22"]]
    assert [r["query"] for r in bad.requests] == [["333", "4444"]] * 2


def test_rewards_come_back_in_input_order_over_many_requests(faulty) -> None:
    servers = [faulty("ok") for _ in range(3)]
    queries = ["x" * n for n in range(1, 12)]
    labels = [str(n) for n in range(11)]
    with client(*(s.url for s in servers), rows_per_request=2, max_concurrency=3) as reward_client:
        assert reward_client.get_reward(queries, labels=labels) == [float(n) for n in range(1, 12)]
    # contiguous shares of ceil(11 / 3) = 4 rows, each sent in requests of at most 2 (arriving in any order)
    shares = [sorted((r["query"], r["labels"]) for r in s.requests) for s in servers]
    assert shares == [
        [(queries[0:2], labels[0:2]), (queries[2:4], labels[2:4])],
        [(queries[4:6], labels[4:6]), (queries[6:8], labels[6:8])],
        [(queries[8:10], labels[8:10]), (queries[10:11], labels[10:11])],
    ]


def test_classify_parses_vllms_answer_in_index_order() -> None:
    from rlvr.verifiers.reward_client import _classifications

    answer = {"data": [{"index": 1, "label": "b", "probs": [0.2, 0.8]}, {"index": 0, "label": None, "probs": [1, 0]}]}
    assert _classifications(answer, 2) == [Classification(None, [1.0, 0.0]), Classification("b", [0.2, 0.8])]
    for broken, problem in [
        ({"data": [{"index": 0, "probs": [1.0]}]}, "answered 1 classifications for 2 inputs"),
        ({"data": [{"index": 0, "probs": [1.0]}] * 2}, "classification index 0 is not one of 0..1 once each"),
        ({"data": [{"index": 0, "probs": []}, {"index": 1, "probs": [1.0]}]}, "classification 0 has no 'probs' list"),
        ({"rewards": []}, "answer has no 'data' list"),
    ]:
        with pytest.raises(ValueError, match=f"^{problem}$"):
            _classifications(broken, 2)


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"urls": []}, "urls\n  List should have at least 1 item"),
        ({"urls": ["localhost:8000"]}, "must start with http:// or https://"),
        ({"urls": ["http://a"], "timeout_s": 0}, "timeout_s\n  Input should be greater than 0"),
        ({"urls": ["http://a"], "timeout_s": float("inf")}, "timeout_s\n  Input should be a finite number"),
        ({"urls": ["http://a"], "max_retries": -1}, "max_retries\n  Input should be greater than or equal to 0"),
    ],
)
def test_the_config_refuses_unbounded_or_malformed_settings(settings: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        RewardClientConfig(**settings)
