"""``build_app``: the FastAPI app of the OpenAI-compatible server over one ``AsyncLLMEngine``;
``GracefulServer``: uvicorn's server with a bounded drain on shutdown.

With an API key, everything under ``/v1`` and the tokenizer endpoints need
``Authorization: Bearer <key>``; ``/health``, ``/ping``, ``/version`` and ``/metrics`` stay open for probes
and scrapers.
Cross-origin requests are answered as ``CORSOptions`` says (vLLM's defaults: any origin, method and
header), preflights before the key is checked, as browsers send them without it. A body over
``ServerLimits.max_request_body_bytes`` gets 413 before it is read in full (``BodySizeLimit``); while
the server drains, every request but ``/metrics`` gets 503 (``RefuseWhileDraining``).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import FrameType

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxpaged.async_engine import AsyncLLMEngine
from jaxpaged.param_errors import excerpt
from jaxpaged.server.errors import APIError, install_error_handlers
from jaxpaged.server.metrics import ServerMetrics
from jaxpaged.server.event_stream import EventStream
from jaxpaged.server.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestModel,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from jaxpaged.server.response_models import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizerInfoResponse,
    TokenizeResponse,
    VersionResponse,
)
from jaxpaged.server.serving import OpenAIServing
from jaxpaged.server.serving_base import ClientDisconnected, RequestLog, ServerLimits, shutting_down_error
from jaxpaged.server.tool_parsers import get_tool_parser

logger = logging.getLogger("jaxpaged.server")

EXIT_GRACE = 2.0
"""Seconds the server waits, once the drain has ended what was in flight, for responses to be sent
before it closes their connections (a client that stops reading cannot hold it up longer)."""


class EventStreamResponse(StreamingResponse):
    """Server-sent events that end their job when the response ends, however it ends: a client
    that disconnects, even while an event is being sent, gets its engine requests aborted."""

    media_type = "text/event-stream"

    def __init__(self, stream: EventStream) -> None:
        super().__init__(stream.events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stream.events.aclose()
            await self._stream.close()


class BodySizeLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 (OpenAI's error body) before it is
    read in full (the server discards the rest as it arrives): at once when its Content-Length says
    so, else, for a chunked body, as soon as the bytes read pass it; such a body within the limit
    then reaches the app whole. The event loop never parses more than ``max_bytes`` of one body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        if length is not None or b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            return await self.app(scope, receive, send)  # (h11 reads exactly Content-Length bytes, or none)
        body = await self._read_chunked(receive)
        if body is None:
            return  # the client left
        if len(body) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        pending: Message | None = {"type": "http.request", "body": body, "more_body": False}

        async def replay() -> Message:
            nonlocal pending
            message, pending = pending, None
            return message if message is not None else await receive()

        await self.app(scope, replay, send)

    async def _read_chunked(self, receive: Receive) -> bytes | None:
        """The body, or its first bytes past ``max_bytes``; None if the client left meanwhile."""
        chunks, size = [], 0
        while size <= self.max_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            413,
            f"The request body is larger than {self.max_bytes} bytes, the server's limit "
            f"(--max-request-body-bytes); send less.",
            code="request_too_large",
        )
        await error.to_response()(scope, receive, send)


class RefuseWhileDraining:
    """ASGI middleware: while ``serving`` drains (``GracefulServer``), every request but ``/metrics``
    gets 503 before it is read: ``/health`` too, so load balancers stop sending any."""

    def __init__(self, app: ASGIApp, serving: OpenAIServing) -> None:
        self.app = app
        self.serving = serving

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")[len(scope.get("root_path", "")) :]
        if scope["type"] == "http" and self.serving.draining and path != "/metrics":
            return await shutting_down_error().to_response()(scope, receive, send)
        await self.app(scope, receive, send)


class GracefulServer(uvicorn.Server):
    """uvicorn's server for ``build_app``'s app, with a bounded drain on shutdown (vLLM's
    ``--shutdown-timeout``): the first SIGTERM or SIGINT stops taking requests (503) and lets those
    in flight finish for up to ``shutdown_timeout`` seconds; then the engine shuts down, ending the
    rest with an error (a stream's last event, a non-streamed request's error body), and the server
    exits, exit code 0. A second signal exits at once. (uvicorn alone would wait for every
    connection without a limit, then re-raise the signal: exit code 143.)"""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._serving: OpenAIServing = config.app.state.serving
        self._deadline: float | None = None
        """When the drain ends what is still in flight; None until a signal came."""
        self._exit_at: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._deadline is None:
            self._deadline = time.monotonic() + self.shutdown_timeout
            self._serving.draining = True
            logger.info(
                "shutting down: refusing new requests, draining %d for up to %g s (a second signal "
                "exits at once)",
                self._serving.num_in_flight,
                self.shutdown_timeout,
            )
        else:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        """Every 0.1 s while draining: exit once nothing is in flight; past the deadline, shut the
        engine down first, and exit ``EXIT_GRACE`` seconds later at the latest."""
        now = time.monotonic()
        if self._deadline is not None and not self.should_exit:
            if not self._serving.num_in_flight or (self._exit_at is not None and now >= self._exit_at):
                self.should_exit = True
            elif now >= self._deadline and self._exit_at is None:
                self._exit_at = now + EXIT_GRACE
                logger.warning(
                    "%d requests still in flight after %g s: ending them",
                    self._serving.num_in_flight,
                    self.shutdown_timeout,
                )
                await asyncio.to_thread(self.engine.shutdown)
        return await super().on_tick(counter)


def warn_ignored_fields(body: RequestModel) -> None:
    """One warning naming the fields of ``body`` that were ignored (vLLM's rule: served, not refused)."""
    ignored = body.ignored_fields()
    if ignored:
        logger.warning(
            "The following fields were present in the request but ignored: %s", excerpt(sorted(ignored))
        )


def _api_key_checker(api_key: str) -> Callable[[Request], Awaitable[None]]:
    async def check(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(
                401,
                "Missing API key: send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not secrets.compare_digest(token.encode(), api_key.encode()):
            raise APIError(
                401,
                "Incorrect API key provided.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check


@dataclass(frozen=True)
class CORSOptions:
    """Which cross-origin browser requests are allowed (vLLM's ``--allowed-origins``, ``--allowed-methods``,
    ``--allowed-headers``, ``--allow-credentials``, with its defaults)."""

    allowed_origins: Sequence[str] = ("*",)
    allowed_methods: Sequence[str] = ("*",)
    allowed_headers: Sequence[str] = ("*",)
    allow_credentials: bool = False


def build_app(
    engine: AsyncLLMEngine,
    served_model_name: str | Sequence[str],
    api_key: str | None = None,
    log_prompts: bool = False,
    *,
    log_requests: bool = True,
    max_log_len: int | None = None,
    chat_template: str | None = None,
    cors: CORSOptions = CORSOptions(),
    limits: ServerLimits = ServerLimits(),
    also_jaxpaged_metric_names: bool = False,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The app serving ``engine`` under ``served_model_name`` (or several names: requests may use any,
    responses and metrics report the first); the caller owns the engine (starts it before serving,
    shuts it down after). ``log_requests``, ``log_prompts``, ``max_log_len``: see ``RequestLog``;
    ``chat_template``: Jinja text used instead of the tokenizer's; ``limits``: what one request may
    take; ``also_jaxpaged_metric_names``: ``/metrics`` also names each ``vllm:`` metric ``jaxpaged:``
    (``ServerMetrics``); ``tool_call_parser``: the parser (``tool_parsers.TOOL_PARSERS``) that finds tool calls
    when a request leaves the choice to the model (None: such requests get 400, as in vLLM without
    ``--enable-auto-tool-choice``). ``app.state.serving`` is its ``OpenAIServing`` (``GracefulServer`` drains it)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names:
        raise ValueError("served_model_name must give at least one name.")
    app = FastAPI(title="jaxpaged", summary="OpenAI-compatible LLM server on JAX")
    metrics = ServerMetrics(engine, names[0], also_jaxpaged_metric_names)
    parser = get_tool_parser(tool_call_parser) if tool_call_parser is not None else None
    serving = OpenAIServing(
        engine,
        names,
        metrics,
        RequestLog(log_requests, log_prompts, max_log_len),
        chat_template,
        limits,
        parser,
    )
    app.state.serving = serving
    # Added first, so inside CORS: a 413 or 503 carries its headers, as a browser needs to read it.
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_body_bytes)
    app.add_middleware(RefuseWhileDraining, serving=serving)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(cors.allowed_origins),
        allow_methods=list(cors.allowed_methods),
        allow_headers=list(cors.allowed_headers),
        allow_credentials=cors.allow_credentials,
    )
    install_error_handlers(app)
    guarded = APIRouter(dependencies=[Depends(_api_key_checker(api_key))] if api_key else [])

    def respond(result: BaseModel | EventStream) -> Response:
        if isinstance(result, EventStream):
            return EventStreamResponse(result)
        return Response(result.model_dump_json(), media_type="application/json")

    @guarded.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        warn_ignored_fields(body)
        try:
            return respond(await serving.create_completion(body, request))
        except ClientDisconnected:
            return Response(status_code=499)

    @guarded.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        warn_ignored_fields(body)
        try:
            return respond(await serving.create_chat_completion(body, request))
        except ClientDisconnected:
            return Response(status_code=499)

    @guarded.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, max_model_len=engine.max_model_len) for name in names])

    @guarded.get("/v1/models/{model:path}")
    async def get_model(model: str) -> ModelCard:
        serving.check_model(model)
        return ModelCard(id=model, max_model_len=engine.max_model_len)

    @guarded.post("/tokenize")
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        warn_ignored_fields(body)
        tokens = await serving.tokenize(body)
        return TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens)

    @guarded.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        warn_ignored_fields(body)
        return DetokenizeResponse(prompt=await serving.detokenize(body))

    @guarded.get("/tokenizer_info")
    async def tokenizer_info() -> TokenizerInfoResponse:
        return serving.tokenizer_info()

    app.include_router(guarded)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine runs; 503 once it has died (restart the server)."""
        if not engine.is_running:
            raise APIError(503, "The engine is dead.", type="server_error", code="engine_dead")
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """``/health`` under SageMaker's name, as vLLM serves it."""
        return await health()

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=importlib.metadata.version("jaxpaged"))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
