"""The reward server that `rlvr serve-rm` runs: a local model (serving/reward_models.py) behind the HTTP shapes that
RL trainers and inference servers already speak, so the whole path of model-given rewards runs on one machine.

Shapes, as read from their sources (2026-11-29):

- `POST /get_reward`, OpenRLHF's remote reward model (openrlhf/cli/serve_rm.py, and the client in
  openrlhf/utils/agent.py, OpenRLHF 0.11.0, commit 3c3be62): request `{"query": [str], "prompts": [str],
  "labels": [...]}` (`query` is the prompt and response as one text; OpenRLHF's server reads only `query`), answer
  `{"rewards": [float], "scores": [float], "extra_logs": {}}`, one reward per query in order. Here `prompts` and
  `labels` are optional, and a judge (a causal LM) reads each label as the reference answer.
- `POST /classify` (also at `/v1/classify`, SGLang's path for the same shape), vLLM's classification API
  (vllm/entrypoints/pooling/classify/protocol.py and serving.py, vLLM main, commit dff4cad): request
  `{"model": str, "input": str | [str]}`, answer `{"id", "object": "list", "created", "model", "data": [{"index",
  "label", "probs", "num_classes"}], "usage": {"prompt_tokens", "total_tokens", "completion_tokens"}}`, the label
  being id2label of the most probable class. Token-id inputs and vLLM's chat-style `messages` are not taken.
- `POST /v1/chat/completions`, a subset of OpenAI's: `model`, `messages` ({role, content} with string content),
  `max_tokens`, `temperature` (0: greedy), `top_p`, `seed`, `n` (1 only); answer `{"id", "object":
  "chat.completion", "created", "model", "choices": [{"index": 0, "message": {"role": "assistant", "content"},
  "finish_reason": "stop" | "length"}], "usage": {...}}`. `GET /v1/models` lists the one model.
- `GET /health`: the model, its kind, and how many rows each endpoint has served.

A request body over `max_body_bytes` is a 413; bad JSON or a wrong shape a 400, and a request naming another model
a 404, each with OpenAI's error body `{"error": {"message", "type", "code"}}` holding one line. With an API key
(`rlvr serve-rm --api-key-env NAME`), every request without `Authorization: Bearer KEY` is a 401, /health included.
Requests run one at a time on the model; each is scored in padded batches.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlvr.errors import UserError
from rlvr.serving.reward_models import ScoringError, ServedModel, class_probabilities, complete_chat, rewards

MAX_BODY_BYTES = 16 << 20
MAX_ROWS = 4096  # texts per request; a client sends bigger batches in several requests
DEFAULT_MAX_TOKENS = 256  # a chat request without max_tokens

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class RewardRequest(BaseModel):
    """OpenRLHF's /get_reward body."""

    query: list[str] = Field(max_length=MAX_ROWS)
    prompts: list[str] | None = Field(default=None, max_length=MAX_ROWS)
    labels: list[str | None] | None = Field(default=None, max_length=MAX_ROWS)

    @model_validator(mode="after")
    def _one_per_query(self) -> RewardRequest:
        for key in ("prompts", "labels"):
            given = getattr(self, key)
            if given is not None and len(given) != len(self.query):
                raise ValueError(f"{len(given)} {key} for {len(self.query)} queries; give one per query or none")
        return self


class ClassifyRequest(BaseModel):
    """vLLM's /classify body (text inputs)."""

    model: str | None = None
    input: str | list[str] = Field(max_length=MAX_ROWS)


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(BaseModel):
    """The subset of OpenAI's chat completions body this server honours; other keys are refused, not ignored,
    so a client never believes a setting took effect."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_ROWS)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = Field(default=False, description="false only")

    @model_validator(mode="after")
    def _no_streaming(self) -> ChatRequest:
        if self.stream:
            raise ValueError("streaming is not served; send stream: false")
        return self


class UnknownModel(Exception):
    """A request naming a model this server does not serve: a 404, as vLLM answers it."""


def error_body(status: int, message: str) -> JSONResponse:
    kind = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        413: "RequestTooLargeError",
    }.get(status, "ServerError")
    line = " ".join(message.split())
    return JSONResponse({"error": {"message": line, "type": kind, "code": status}}, status_code=status)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 before the app sees it (a declared
    Content-Length at once, a chunked body as soon as it passes the limit); the rest is replayed to the app."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length", b"0")
        chunks: list[bytes] = []
        size = int(declared) if declared.isdigit() else 0
        more = size <= self.limit
        received = 0
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            size = max(size, received)
            more = message.get("more_body", False) and size <= self.limit
        if size > self.limit:
            response = error_body(413, f"request body over {self.limit} bytes; send fewer rows per request")
            return await response(scope, receive, send)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)


class BearerKey:
    """ASGI middleware: a request whose `Authorization` header is not `Bearer KEY` is answered 401 before anything
    reads its body (the key compared in constant time)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_body(401, "missing or wrong API key: send the header Authorization: Bearer KEY")
                response.headers["WWW-Authenticate"] = "Bearer"
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def reward_app(served: ServedModel, max_body_bytes: int = MAX_BODY_BYTES, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `served` (routes: the module docstring), behind `api_key` when one is given. Its
    handlers are plain functions, which FastAPI runs in worker threads, so /health answers while a batch is being
    scored."""
    app = FastAPI(title=f"rlvr reward server: {served.name}", docs_url=None, redoc_url=None, openapi_url=None)
    counts: Counter[str] = Counter()
    counts_lock = threading.Lock()

    def count(endpoint: str, rows: int) -> None:
        with counts_lock:
            counts[endpoint] += rows

    def check_model(name: str | None) -> None:
        if name is not None and name != served.name:
            raise UnknownModel(f"model {name!r} is not served here; this server serves {served.name!r}")

    add_error_handlers(app)

    @app.get("/health")
    def health() -> dict[str, Any]:
        with counts_lock:
            served_rows = dict(counts)
        return {"status": "ok", "model": served.name, "kind": served.kind, "served": served_rows}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served.name, "object": "model", "owned_by": "rlvr"}]}

    @app.post("/get_reward")
    def get_reward(body: RewardRequest) -> dict[str, Any]:
        scores = rewards(served, body.query, body.labels)
        count("get_reward", len(body.query))
        return {"rewards": scores, "scores": scores, "extra_logs": {}}

    @app.post("/classify")
    @app.post("/v1/classify")
    def classify(body: ClassifyRequest) -> dict[str, Any]:
        check_model(body.model)
        texts = [body.input] if isinstance(body.input, str) else body.input
        answer = classify_answer(served, texts)
        count("classify", len(texts))
        return answer

    @app.post("/v1/chat/completions")
    def chat_completions(body: ChatRequest) -> dict[str, Any]:
        check_model(body.model)
        answer = chat_answer(served, body)
        count("chat_completions", 1)
        return answer

    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key is not None:
        app.add_middleware(BearerKey, key=api_key)  # added last, so it runs first: no body is read without the key
    return app


def add_error_handlers(app: FastAPI) -> None:
    """A bad request's 400, a text the model cannot score's 400 and another model's name's 404, each one line."""

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_body(400, validation_line(exc))

    @app.exception_handler(ScoringError)
    async def cannot_score(request: Request, exc: ScoringError) -> JSONResponse:
        return error_body(400, str(exc))

    @app.exception_handler(UnknownModel)
    async def other_model(request: Request, exc: UnknownModel) -> JSONResponse:
        return error_body(404, str(exc))


def classify_answer(served: ServedModel, texts: list[str]) -> dict[str, Any]:
    """vLLM's /classify answer for `texts`: each one's class probabilities and most probable label."""
    probs = class_probabilities(served, texts)
    labels = served.labels
    tokens = sum(len(ids) for ids in served.tokenizer(texts)["input_ids"]) if texts else 0
    data = [
        {"index": i, "label": labels[max(range(len(p)), key=p.__getitem__)], "probs": p, "num_classes": len(p)}
        for i, p in enumerate(probs)
    ]
    return {
        "id": f"classify-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": served.name,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }


def chat_answer(served: ServedModel, body: ChatRequest) -> dict[str, Any]:
    """An OpenAI chat completion of `body`'s messages by the served model."""
    done = complete_chat(
        served,
        [m.model_dump() for m in body.messages],
        max_tokens=body.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
    )
    message = {"role": "assistant", "content": done.text}
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served.name,
        "choices": [{"index": 0, "message": message, "finish_reason": done.finish_reason}],
        "usage": {
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
        },
    }


def validation_line(exc: RequestValidationError) -> str:
    """FastAPI's validation errors as one line: `where: what` for each, `;`-separated."""
    parts = []
    for error in exc.errors():
        location = tuple(error.get("loc", ()))
        if error.get("type") == "json_invalid":
            parts.append(f"body is not valid JSON (at character {location[-1]})")
            continue
        if error.get("type") == "model_attributes_type" and location == ("body",):
            parts.append("body must be a JSON object (sent as Content-Type: application/json)")
            continue
        where = ".".join(str(part) for part in location if part != "body") or "body"
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return "bad request: " + "; ".join(parts)


# --- serving ------------------------------------------------------------------------------------------------


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), port 0 meaning any free one; a taken port is a one-line UserError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise UserError(f"cannot listen on {host}:{port}: {reason}; choose another --host or --port") from None


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _server(app: FastAPI) -> uvicorn.Server:
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=5))


def serve(app: FastAPI, sock: socket.socket) -> None:
    """Serve `app` on the bound `sock` until Ctrl-C or SIGTERM (uvicorn's own handling: open requests finish)."""
    with sock:
        _server(app).run(sockets=[sock])


@contextmanager
def serving_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve `app` from a background thread inside the block, which gets the base URL; stopped on leaving."""
    sock = listening_socket(host, port)
    server = _server(app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="reward-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the reward server did not start")
            time.sleep(0.01)
        yield url_of(sock)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
