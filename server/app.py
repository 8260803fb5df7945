"""``build_app``: the FastAPI app of the OpenAI-compatible server over one ``AsyncLLMEngine``.

With an API key, everything under ``/v1`` and the tokenizer endpoints need
``Authorization: Bearer <key>``; ``/health`` and ``/metrics`` stay open for probes and scrapers.
Cross-origin requests are answered as ``CORSOptions`` says (vLLM's defaults: any origin, method and
header), preflights before the key is checked, as browsers send them without it.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from jaxpaged.async_engine import AsyncLLMEngine
from jaxpaged.server.errors import APIError, install_error_handlers
from jaxpaged.server.metrics import ServerMetrics
from jaxpaged.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                             ModelCard, ModelList, TokenizeChatRequest, TokenizeCompletionRequest,
                             TokenizeResponse)
from jaxpaged.server.serving import ClientDisconnected, EventStream, OpenAIServing, RequestLog


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
            self._stream.close()


def _api_key_checker(api_key: str) -> Callable[[Request], Awaitable[None]]:
    async def check(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "Missing API key: send it as 'Authorization: Bearer <key>'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not secrets.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
    return check


@dataclass(frozen=True)
class CORSOptions:
    """Which cross-origin browser requests are allowed (vLLM's ``--allowed-origins``, ``--allowed-methods``,
    ``--allowed-headers``, ``--allow-credentials``, with its defaults)."""

    allowed_origins: Sequence[str] = ("*",)
    allowed_methods: Sequence[str] = ("*",)
    allowed_headers: Sequence[str] = ("*",)
    allow_credentials: bool = False


def build_app(engine: AsyncLLMEngine, served_model_name: str | Sequence[str], api_key: str | None = None,
              log_prompts: bool = False, *, log_requests: bool = True, max_log_len: int | None = None,
              chat_template: str | None = None, cors: CORSOptions = CORSOptions()) -> FastAPI:
    """The app serving ``engine`` under ``served_model_name`` (or several names: requests may use any,
    responses and metrics report the first); the caller owns the engine (starts it before serving,
    shuts it down after). ``log_requests``, ``log_prompts``, ``max_log_len``: see ``RequestLog``;
    ``chat_template``: Jinja text used instead of the tokenizer's."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names:
        raise ValueError("served_model_name must give at least one name.")
    app = FastAPI(title="jaxpaged", summary="OpenAI-compatible LLM server on JAX")
    app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                       allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers),
                       allow_credentials=cors.allow_credentials)
    install_error_handlers(app)
    metrics = ServerMetrics(engine, names[0])
    serving = OpenAIServing(engine, names, metrics, RequestLog(log_requests, log_prompts, max_log_len), chat_template)
    guarded = APIRouter(dependencies=[Depends(_api_key_checker(api_key))] if api_key else [])

    def respond(result: BaseModel | EventStream) -> Response:
        if isinstance(result, EventStream):
            return EventStreamResponse(result)
        return Response(result.model_dump_json(), media_type="application/json")

    @guarded.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        try:
            return respond(await serving.create_completion(body, request))
        except ClientDisconnected:
            return Response(status_code=499)

    @guarded.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
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
        serving.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            tokens = serving.apply_chat_template(body.messages, body.add_generation_prompt)
        else:
            tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens)

    @guarded.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        serving.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < engine.tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {engine.tokenizer.vocab_size}); got {bad[:5]}.",
                           param="tokens")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))

    app.include_router(guarded)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine runs; 503 once it has died (restart the server)."""
        if not engine.is_alive:
            raise APIError(503, "The engine is dead.", type="server_error", code="engine_dead")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
