"""The completion and chat endpoints: requests -> engine requests -> OpenAI responses or SSE.

A completion with several prompts is one engine request per prompt; choice ``i * n + j`` is
prompt ``i``'s ``j``-th sample. A streamed request's engine outputs are deltas (what is new since
the previous one, merged by the stream when the reader falls behind); concatenated they equal the
non-streamed text, for which the engine hands over only the final output. Every engine request is
aborted (its KV blocks freed) as soon as its HTTP request goes away, and logged and counted in the
metrics when it ends.

Nothing heavy runs on the event loop: a large input (over ``_OFF_LOOP_CHARS`` characters or token
ids) is tokenized, templated or detokenized in a worker thread, after the tokenizer's lower bound on
its length (``Tokenizer.min_num_tokens``) has refused it if it surely cannot fit. A request's
prompts are queued in one engine call and aborted in one, whenever the client leaves, even while
they are being tokenized or queued. ``ServerLimits`` bounds what one request may take.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from json.encoder import encode_basestring as json_string
from typing import Any, TypeVar

from fastapi import Request as HTTPRequest
from pydantic import BaseModel

from jaxpaged.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
    RequestStream,
)
from jaxpaged.request import CompletionOutput, Request, RequestOutput, TokenLogprobs
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.server.chat_tools import ChoiceTools
from jaxpaged.server.errors import APIError
from jaxpaged.server.metrics import ServerMetrics
from jaxpaged.server.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    ErrorResponse,
    SamplingRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizerInfoResponse,
    Tool,
    TopLogprob,
    UsageInfo,
)
from jaxpaged.server.structured_requests import constraint_field, structured_outputs_of
from jaxpaged.server.tool_parsers import ToolParser
from jaxpaged.tokenizer import GIL_HELD_CHARS

logger = logging.getLogger("jaxpaged.server")

T = TypeVar("T")
_ENGINE_ERRORS = (ValueError, EngineOverloadedError, EngineDeadError, RequestFailedError)
_STREAM_ERRORS = (EngineDeadError, EngineOverloadedError, RequestFailedError)
"""What ends a request's stream with an error: the engine stopped, the request waited past
``max_queue_time``, or its own processing failed."""
_OFF_LOOP_CHARS = GIL_HELD_CHARS
"""Inputs larger than this (characters of text, or token ids) are handled in a worker thread. A text
this short is tokenized quickly holding the GIL; a longer one's tokenizing releases the GIL, and the
event loop would be blocked meanwhile, waiting to take it back from the engine thread."""
DEFAULT_MAX_SEQS_PER_REQUEST = 1024


@dataclass(frozen=True)
class ServerLimits:
    """What one request may take, a deployment's choice (``jaxpaged serve``'s flags)."""

    max_request_body_bytes: int = 4 * 2**20
    """Larger bodies get 413 before they are read in full (``app.BodySizeLimit``)."""
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST
    """Prompts x ``best_of`` (``n``) of one request: more is refused (400)."""
    max_tokens_per_request: int | None = None
    """The largest ``max_tokens`` a request gets: larger or unset ones are capped to it, as a model's
    ``max_new_tokens`` caps them (vLLM's rule). None: only ``max_model_len`` bounds it."""


def shutting_down_error() -> APIError:
    """The answer to a request that arrives while the server drains (``app.GracefulServer``)."""
    return APIError(
        503,
        "The server is shutting down; send the request to another replica.",
        type="server_error",
        code="shutting_down",
    )


def _named_param(error: ValueError, body: SamplingRequest) -> str | None:
    """The request field an engine error is about: its ``param`` (``ParamError``) when this request type has
    that field, else None (never read from the message: rewording one must not change the API)."""
    name = getattr(error, "param", None)
    return name if name in type(body).model_fields else None


def _joined(first: DeltaMessage | None, second: DeltaMessage | None) -> DeltaMessage | None:
    """One delta saying what ``first`` then ``second`` say."""
    if first is None or second is None:
        return first or second
    content = (
        None
        if first.content is None and second.content is None
        else (first.content or "") + (second.content or "")
    )
    return DeltaMessage(
        content=content, tool_calls=(first.tool_calls or []) + (second.tool_calls or []) or None
    )


class ClientDisconnected(Exception):
    """The client went away before a non-streamed response was ready."""


def sse(payload: BaseModel | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


class TextDeltaEvents:
    """The events of a stream's common chunk, a choice's text with nothing else (no logprobs, no
    finish), without pydantic: the chunk's models are dumped once per choice with a marker text and
    split around it, so an event is that prefix, the text as a JSON string (``json``'s C encoder,
    as ``json.dumps(text, ensure_ascii=False)`` has it) and that suffix: far cheaper than building and
    dumping a chunk's models at every step of every stream (``benchmarks/stream_events.py``). The same
    bytes as ``sse(chunk(index, text))`` (a test compares them)."""

    _MARK = "\x00jaxpaged-text\x00"

    def __init__(self, chunk: Callable[[int, str], BaseModel]) -> None:
        self._chunk = chunk
        """(choice index, text) -> that choice's chunk with that text."""
        self._frames: dict[int, tuple[str, str]] = {}

    def event(self, index: int, text: str) -> str:
        frame = self._frames.get(index)
        if frame is None:
            encoded = json_string(self._MARK)
            prefix, mark, suffix = sse(self._chunk(index, self._MARK)).partition(encoded)
            if not mark or encoded in suffix:
                raise RuntimeError(f"a chunk's text is not one JSON string of its own: {prefix}")
            frame = self._frames[index] = (prefix, suffix)
        return frame[0] + json_string(text) + frame[1]


async def run_until_disconnect(request: HTTPRequest, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (which aborts its engine requests) if the client disconnects.

    The request body has been read by then, so the next ASGI message is the disconnect.
    """

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()  # a no-op once it is done
    try:
        return await task
    except asyncio.CancelledError:
        raise ClientDisconnected from None


@dataclass
class _ChoiceState:
    """What has been sent of one choice so far."""

    started: bool = False
    text_offset: int = 0
    """Where the next token's text starts (the completions API's ``logprobs.text_offset``)."""


@dataclass(eq=False)
class _Job:
    """The engine requests behind one HTTP request."""

    request_id: str
    model: str
    n: int
    arrival_time: float
    streams: list[RequestStream] = field(default_factory=list)
    finals: dict[int, RequestOutput] = field(default_factory=dict)
    ended: bool = False

    @property
    def usage(self) -> UsageInfo:
        prompt = sum(s.num_prompt_tokens for s in self.streams)
        completion = sum(sum(s.num_output_tokens.values()) for s in self.streams)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


@dataclass
class EventStream:
    """A streamed response: its server-sent events, and ``close``, to call when the response ends
    however it ends (even before the first event): aborts and records what is unfinished."""

    events: AsyncGenerator[str, None]
    close: Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class RequestLog:
    """What is logged of each engine request: a line when it ends (token counts, latency), unless
    ``enabled`` is off (vLLM's ``--disable-log-requests``); its prompt when it starts only with
    ``prompts`` (prompts may be private), at most ``max_len`` characters or token ids of it (vLLM's
    ``--max-log-len``)."""

    enabled: bool = True
    prompts: bool = False
    max_len: int | None = None

    def excerpt(self, prompt: str | Sequence[int]) -> str | Sequence[int]:
        return prompt if self.max_len is None else prompt[: self.max_len]


class OpenAIServing:
    """Completion and chat logic over one ``AsyncLLMEngine``; the app routes to it. ``model_names``: the
    names requests may use (vLLM's ``--served-model-name``); responses report the first.
    ``chat_template``: Jinja text used instead of the tokenizer's template. ``tool_parser``: finds tool
    calls in the text of requests whose tool choice is "auto" (``--tool-call-parser``; None: such
    requests are refused, as in vLLM without ``--enable-auto-tool-choice``). Once ``draining`` is set
    (shutdown), new requests are refused; ``num_in_flight`` counts those still being served."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_names: Sequence[str],
        metrics: ServerMetrics,
        log: RequestLog = RequestLog(),
        chat_template: str | None = None,
        limits: ServerLimits = ServerLimits(),
        tool_parser: type[ToolParser] | None = None,
    ) -> None:
        self.engine = engine
        self.tool_parser = tool_parser
        self.model_names = tuple(model_names)
        self.model_name = self.model_names[0]
        self.metrics = metrics
        self.log = log
        self.chat_template = chat_template
        self.limits = limits
        self.draining = False
        self._jobs: set[_Job] = set()
        self._defaults = dict(engine.generation_defaults.sampling)
        """Request defaults: the model's, with ``max_tokens`` capped to ``limits.max_tokens_per_request``."""
        cap = limits.max_tokens_per_request
        if cap is not None:
            self._defaults["max_tokens"] = min(self._defaults.get("max_tokens", cap), cap)

    @property
    def num_in_flight(self) -> int:
        """Requests queued or running in the engine, or being answered."""
        return len(self._jobs)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    # ---- /v1/completions ---------------------------------------------------------------------

    async def create_completion(
        self, body: CompletionRequest, raw: HTTPRequest
    ) -> CompletionResponse | EventStream:
        """The whole completion, or its event stream when ``body.stream``; the client leaving at any
        point, even while its prompts are tokenized or queued, aborts them all."""
        return await run_until_disconnect(raw, self._completion(body))

    async def _completion(self, body: CompletionRequest) -> CompletionResponse | EventStream:
        self.check_model(body.model)
        prompts = body.prompts
        if not prompts:
            raise APIError(400, "prompt must not be empty.", param="prompt")
        if body.max_tokens == 0 and not body.echo:
            raise APIError(
                400,
                "max_tokens may be 0 only with echo (to score the prompt); else at least 1.",
                param="max_tokens",
            )
        echo_logprobs = body.logprobs if body.echo else None
        # Echo only: one token is generated (the engine needs a step), then left out of the answer, as vLLM.
        sp = self._sampling_params(
            body,
            max_tokens=1 if body.echo_only else body.max_tokens,
            logprobs=body.logprobs,
            prompt_logprobs=echo_logprobs,
        )
        request_id = f"cmpl-{_random_id()}"
        self._check_size(len(prompts), sp, body)
        requests = await self._off_loop(
            sum(map(len, prompts)), self._make_requests, request_id, prompts, sp, body, "prompt"
        )
        job = await self._submit(request_id, requests, sp)
        if body.stream:
            return EventStream(self._completion_events(job, body), functools.partial(self._end, job))
        await self._collect(job)
        choices = []
        for i in range(len(job.streams)):
            out = job.finals[i]
            for j, c in enumerate(out.outputs):
                text, logprobs = self._completion_piece(out, c, _ChoiceState(), body)
                choices.append(
                    CompletionChoice(
                        index=i * job.n + j,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        return CompletionResponse(id=job.request_id, model=job.model, choices=choices, usage=job.usage)

    @staticmethod
    async def _framed(
        events: AsyncIterator[str], usage_chunk: Callable[[], BaseModel] | None
    ) -> AsyncIterator[str]:
        """Frame a stream's choice events: the usage chunk when asked for, an error event if the
        engine died, failed this request or timed it out in its queue, and always the closing ``[DONE]``."""
        try:
            async with aclosing(events) as inner:
                async for event in inner:
                    yield event
            if usage_chunk is not None:
                yield sse(usage_chunk())
        except _STREAM_ERRORS as e:
            yield sse(ErrorResponse(error=APIError.from_engine(e).info))
        yield sse("[DONE]")

    def _completion_events(self, job: _Job, body: CompletionRequest) -> AsyncIterator[str]:
        created = int(time.time())
        usage = (
            (
                lambda: CompletionResponse(
                    id=job.request_id, created=created, model=job.model, choices=[], usage=job.usage
                )
            )
            if body.include_usage_in_stream
            else None
        )
        return self._framed(self._completion_choices(job, body, created), usage)

    async def _completion_choices(
        self, job: _Job, body: CompletionRequest, created: int
    ) -> AsyncIterator[str]:
        def chunk(
            index: int,
            text: str,
            logprobs: CompletionLogprobs | None = None,
            finish_reason: str | None = None,
            stop_reason: int | str | None = None,
        ) -> CompletionResponse:
            return CompletionResponse(
                id=job.request_id,
                created=created,
                model=job.model,
                choices=[
                    CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=finish_reason,
                        stop_reason=stop_reason,
                    )
                ],
                usage=job.usage if body.usage_on_every_chunk else None,
            )

        states: dict[int, _ChoiceState] = {}
        text_events = TextDeltaEvents(chunk)
        async with aclosing(self._merged(job)) as outputs:
            async for i, out in outputs:
                for j, c in enumerate(out.outputs):
                    index = i * job.n + j
                    text, logprobs = self._completion_piece(
                        out, c, states.setdefault(index, _ChoiceState()), body
                    )
                    if logprobs is None and c.finish_reason is None and not body.usage_on_every_chunk:
                        if text:
                            yield text_events.event(index, text)
                    elif text or (logprobs is not None and logprobs.tokens) or c.finish_reason is not None:
                        yield sse(chunk(index, text, logprobs, c.finish_reason, c.stop_reason))

    def _completion_piece(
        self, out: RequestOutput, c: CompletionOutput, state: _ChoiceState, body: CompletionRequest
    ) -> tuple[str, CompletionLogprobs | None]:
        """``c`` (a delta, or the whole output) as a choice's text and, if asked for, logprobs; the
        first piece starts with the prompt when ``echo``."""
        echo = body.echo and not state.started
        generated = not body.echo_only
        text = (self._prompt_text(out) if echo else "") + (c.text if generated else "")
        logprobs = None
        if body.logprobs is not None:
            logprobs = CompletionLogprobs()
            if echo:
                self._add_completion_logprobs(logprobs, out.prompt_token_ids, out.prompt_logprobs, state)
            if generated:
                self._add_completion_logprobs(logprobs, c.token_ids, c.logprobs, state)
        state.started = True
        return text, logprobs

    def _add_completion_logprobs(
        self,
        logprobs: CompletionLogprobs,
        token_ids: Sequence[int],
        positions: Sequence[TokenLogprobs | None],
        state: _ChoiceState,
    ) -> None:
        """OpenAI's legacy format: per token its text, logprob, offset, and alternatives by text."""
        for token, entries in zip(token_ids, positions):
            if entries is None:  # the prompt's first token has no logprob
                text = self.engine.tokenizer.decode([token], skip_special_tokens=False)
                logprobs.token_logprobs.append(None)
                logprobs.top_logprobs.append(None)
            else:
                text = entries[token].decoded_token
                logprobs.token_logprobs.append(entries[token].logprob)
                top: dict[str, float] = {}
                for lp in sorted(entries.values(), key=lambda lp: lp.logprob, reverse=True):
                    top.setdefault(lp.decoded_token, lp.logprob)
                logprobs.top_logprobs.append(top)
            logprobs.tokens.append(text)
            logprobs.text_offset.append(state.text_offset)
            state.text_offset += len(text)

    # ---- /v1/chat/completions ----------------------------------------------------------------

    async def create_chat_completion(
        self, body: ChatCompletionRequest, raw: HTTPRequest
    ) -> ChatCompletionResponse | EventStream:
        """The whole chat completion, or its event stream when ``body.stream``; the client leaving at
        any point aborts it."""
        return await run_until_disconnect(raw, self._chat_completion(body))

    async def _chat_completion(self, body: ChatCompletionRequest) -> ChatCompletionResponse | EventStream:
        self.check_model(body.model)
        if body.effective_tool_choice == "auto" and self.tool_parser is None:
            raise APIError(
                400,
                '"auto" tool choice (the default with tools) needs the server started with '
                '--enable-auto-tool-choice and --tool-call-parser; or send tool_choice "none", '
                '"required" or a named function.',
                param="tool_choice",
            )
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        # The tool parser reads tags that some tokenizers mark special, so they stay in the text (vLLM's rule).
        keep_tags = body.effective_tool_choice == "auto" and body.skip_special_tokens is None
        sp = self._sampling_params(
            body,
            max_tokens=max_tokens,
            logprobs=body.num_logprobs,
            **({"skip_special_tokens": False} if keep_tags else {}),
        )
        request_id = f"chatcmpl-{_random_id()}"
        self._check_size(1, sp, body)

        def make() -> list[Request]:
            prompt = self.chat_prompt(
                body.messages, body.add_generation_prompt, body.chat_template_kwargs, body.tools
            )
            return self._make_requests(request_id, [prompt], sp, body, "messages")

        requests = await self._off_loop(_text_size(body.messages), make)
        job = await self._submit(request_id, requests, sp)
        if body.stream:
            return EventStream(self._chat_events(job, body), functools.partial(self._end, job))
        await self._collect(job)
        choices = []
        for j, c in enumerate(job.finals[0].outputs):
            text, logprobs = self._chat_piece(c, body)
            message, finish_reason = ChatResponseMessage(content=text), c.finish_reason
            if body.effective_tool_choice != "none":
                tools = ChoiceTools(body, self.tool_parser)
                answer = tools.whole(text)
                message = ChatResponseMessage(content=answer.content, tool_calls=answer.tool_calls)
                finish_reason = tools.finish_reason(c.finish_reason)
            choices.append(
                ChatChoice(
                    index=j,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        return ChatCompletionResponse(id=job.request_id, model=job.model, choices=choices, usage=job.usage)

    def _chat_events(self, job: _Job, body: ChatCompletionRequest) -> AsyncIterator[str]:
        created = int(time.time())
        usage = (
            (
                lambda: ChatCompletionChunk(
                    id=job.request_id, created=created, model=job.model, choices=[], usage=job.usage
                )
            )
            if body.include_usage_in_stream
            else None
        )
        return self._framed(self._chat_choices(job, body, created), usage)

    async def _chat_choices(self, job: _Job, body: ChatCompletionRequest, created: int) -> AsyncIterator[str]:
        def chunk(choice: ChatChunkChoice) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=job.request_id,
                created=created,
                model=job.model,
                choices=[choice],
                usage=job.usage if body.usage_on_every_chunk else None,
            )

        text_events = TextDeltaEvents(
            lambda j, text: chunk(ChatChunkChoice(index=j, delta=DeltaMessage(content=text)))
        )
        for j in range(job.n):
            yield sse(chunk(ChatChunkChoice(index=j, delta=DeltaMessage(role="assistant", content=""))))
        if body.effective_tool_choice != "none":
            async for event in self._tool_chat_choices(job, body, chunk):
                yield event
            return
        async with aclosing(self._merged(job)) as outputs:
            async for _, out in outputs:
                for j, c in enumerate(out.outputs):
                    text, logprobs = self._chat_piece(c, body)
                    if logprobs is None and c.finish_reason is None and not body.usage_on_every_chunk:
                        if text:
                            yield text_events.event(j, text)
                    elif text or (logprobs is not None and logprobs.content) or c.finish_reason is not None:
                        yield sse(
                            chunk(
                                ChatChunkChoice(
                                    index=j,
                                    delta=DeltaMessage(content=text or None),
                                    logprobs=logprobs,
                                    finish_reason=c.finish_reason,
                                    stop_reason=c.stop_reason,
                                )
                            )
                        )

    async def _tool_chat_choices(
        self, job: _Job, body: ChatCompletionRequest, chunk: Callable[[ChatChunkChoice], ChatCompletionChunk]
    ) -> AsyncIterator[str]:
        """The choices' events when the answer may call tools: each choice's text goes through its
        ``ChoiceTools``, which sends content and tool-call pieces as it can tell them apart."""
        tools = [ChoiceTools(body, self.tool_parser) for _ in range(job.n)]
        async with aclosing(self._merged(job)) as outputs:
            async for _, out in outputs:
                for j, c in enumerate(out.outputs):
                    text, logprobs = self._chat_piece(c, body)
                    delta = tools[j].delta(text)
                    if c.finish_reason is not None:
                        delta = _joined(delta, tools[j].finish())
                    if (
                        delta is not None
                        or c.finish_reason is not None
                        or body.usage_on_every_chunk
                        or (logprobs is not None and logprobs.content)
                    ):
                        yield sse(
                            chunk(
                                ChatChunkChoice(
                                    index=j,
                                    delta=delta or DeltaMessage(),
                                    logprobs=logprobs,
                                    finish_reason=tools[j].finish_reason(c.finish_reason),
                                    stop_reason=c.stop_reason,
                                )
                            )
                        )

    @staticmethod
    def _chat_piece(
        c: CompletionOutput, body: ChatCompletionRequest
    ) -> tuple[str, ChatChoiceLogprobs | None]:
        """``c`` (a delta, or the whole output) as text and, if asked for, logprobs in the chat
        format (each token with its ``top_logprobs`` most likely alternatives)."""
        text = c.text
        logprobs = None
        if body.logprobs:
            content = []
            for token, entries in zip(c.token_ids, c.logprobs):
                top = sorted(entries.values(), key=lambda lp: lp.logprob, reverse=True)[
                    : body.top_logprobs or 0
                ]
                chosen = entries[token]
                content.append(
                    ChatTokenLogprob(
                        token=chosen.decoded_token,
                        logprob=chosen.logprob,
                        bytes=list(chosen.decoded_token.encode()),
                        top_logprobs=[
                            TopLogprob(
                                token=lp.decoded_token,
                                logprob=lp.logprob,
                                bytes=list(lp.decoded_token.encode()),
                            )
                            for lp in top
                        ],
                    )
                )
            logprobs = ChatChoiceLogprobs(content=content)
        return text, logprobs

    def chat_prompt(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Tool] | None = None,
    ) -> list[int]:
        """The conversation's token ids: rendered by the chat template (given ``template_kwargs`` as extra
        variables, and ``tools``), then tokenized unless its text is surely longer than ``max_model_len``
        (``APIError``)."""
        try:
            text = self.engine.tokenizer.render_chat(
                [m.to_template_dict() for m in messages],
                add_generation_prompt=add_generation_prompt,
                chat_template=self.chat_template,
                chat_template_kwargs=template_kwargs,
                tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
            )
        except ValueError as e:  # no chat template, or kwargs naming its own parameters
            raise APIError(
                400, str(e), param="chat_template_kwargs" if template_kwargs else "messages"
            ) from None
        return self._encode(text, False, "messages")

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """``text``'s token ids, unless the tokenizer's bound says they are more than ``max_model_len``:
        then a 400 at once, without tokenizing (seconds for megabytes)."""
        at_least, limit = self.engine.tokenizer.min_num_tokens(text), self.engine.max_model_len
        if at_least > limit:
            raise APIError(
                400,
                f"{param} has at least {at_least} tokens, but max_model_len is {limit}; shorten it.",
                param=param,
            )
        return self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # ---- /tokenize, /detokenize --------------------------------------------------------------

    async def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
        """The token ids of a prompt or a conversation, at most ``max_model_len`` of them (as a
        request's prompt: vLLM has no limit, but a 20 MB call took 33 s and 5.7 GB)."""
        self.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            tokens = await self._off_loop(
                _text_size(body.messages),
                self.chat_prompt,
                body.messages,
                body.add_generation_prompt,
                body.chat_template_kwargs,
                body.tools,
            )
        else:
            tokens = await self._off_loop(
                len(body.prompt), self._encode, body.prompt, body.add_special_tokens, "prompt"
            )
        limit = self.engine.max_model_len
        if len(tokens) > limit:
            raise APIError(
                400,
                f"the input has {len(tokens)} tokens, but max_model_len is {limit}; shorten it.",
                param="messages" if isinstance(body, TokenizeChatRequest) else "prompt",
            )
        return tokens

    def tokenizer_info(self) -> TokenizerInfoResponse:
        """vLLM's ``/tokenizer_info``: the tokenizer's class, its settings as loaded (special tokens,
        ``model_max_length``...) and the chat template in use; file paths are left out, as they describe
        the server's disk, not the tokenizer."""
        hf = self.engine.tokenizer.hf
        info = {
            key: _jsonable(value)
            for key, value in hf.init_kwargs.items()
            if not key.endswith("_file") and key != "name_or_path"
        }
        template = self.chat_template or hf.chat_template
        if template:
            info["chat_template"] = template
        return TokenizerInfoResponse(**{**info, "tokenizer_class": type(hf).__name__})

    async def detokenize(self, body: DetokenizeRequest) -> str:
        """The text of at most ``max_model_len`` token ids of the vocabulary."""
        self.check_model(body.model)
        limit, vocab = self.engine.max_model_len, self.engine.tokenizer.vocab_size
        if len(body.tokens) > limit:
            raise APIError(
                400,
                f"tokens holds {len(body.tokens)} ids, but max_model_len is {limit}; send fewer.",
                param="tokens",
            )
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}.", param="tokens")
        return await self._off_loop(len(body.tokens), self.engine.tokenizer.decode, body.tokens)

    # ---- shared ------------------------------------------------------------------------------

    def _sampling_params(self, body: SamplingRequest, **resolved) -> SamplingParams:
        resolved["structured_outputs"] = structured_outputs_of(body)
        try:
            return body.to_sampling_params(self._defaults, **resolved)
        except ValueError as e:
            raise APIError(400, str(e), param=_named_param(e, body)) from None

    def _check_size(self, num_prompts: int, sp: SamplingParams, body: SamplingRequest) -> None:
        """Refuse a request running more sequences than ``limits.max_seqs_per_request``."""
        limit = self.limits.max_seqs_per_request
        if num_prompts * sp.best_of > limit:
            raise APIError(
                400,
                f"a request may run at most {limit} sequences (prompts x n, or best_of); this one "
                f"asks for {num_prompts} x {sp.best_of}. Send fewer prompts or samples.",
                param="prompt" if sp.best_of == 1 else "best_of" if body.best_of else "n",
            )

    @staticmethod
    async def _off_loop(size: int, fn: Callable[..., T], *args) -> T:
        """``fn(*args)``, in a worker thread when its input's ``size`` is over ``_OFF_LOOP_CHARS``."""
        return await asyncio.to_thread(fn, *args) if size > _OFF_LOOP_CHARS else fn(*args)

    def _make_requests(
        self,
        request_id: str,
        prompts: Sequence[str | list[int]],
        sp: SamplingParams,
        body: SamplingRequest,
        prompt_param: str,
    ) -> list[Request]:
        """Validate and tokenize every prompt (``APIError``; an error that names no request field is
        blamed on ``prompt_param``)."""
        arrival = time.time()
        try:
            return [
                self.engine.make_request(f"{request_id}-{i}", p, sp, arrival, body.cache_salt, body.priority)
                for i, p in enumerate(prompts)
            ]
        except ValueError as e:
            param = _named_param(e, body)
            if param == "structured_outputs":  # the grammar did not compile: blame the field it came from
                param = constraint_field(body)
            raise APIError(400, str(e), param=param or prompt_param) from None

    async def _submit(self, request_id: str, requests: list[Request], sp: SamplingParams) -> _Job:
        """Queue a request's prompts all together, or none (raises ``APIError``); refused while draining."""
        if self.draining:
            raise shutting_down_error()
        job = _Job(request_id, self.model_name, sp.n, requests[0].arrival_time)
        self._jobs.add(job)  # in flight from now: a drain waits for it
        try:
            job.streams = await self.engine.add_requests(requests)
        except BaseException as e:  # also when the client left (cancelled) meanwhile
            self._jobs.discard(job)
            if isinstance(e, _ENGINE_ERRORS):
                raise APIError.from_engine(e) from None
            raise
        if self.log.enabled and self.log.prompts:
            for req in requests:
                logger.info(
                    "%s: prompt %r", req.request_id, self.log.excerpt(req.prompt or req.prompt_token_ids)
                )
        return job

    async def _merged(self, job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(prompt index, output)`` from all the job's streams as they come; on exit, however
        early, ends the job (``_end``).

        Only one output per stream is taken ahead of the reader, so a slow reader leaves the
        streams coalescing outputs instead of queueing them.
        """
        pending: dict[asyncio.Future, int] = {}
        try:
            if len(job.streams) == 1:  # one prompt: its stream is read directly, no task per output
                async for out in job.streams[0]:
                    if out.finished:
                        job.finals[0] = out
                    yield 0, out
                return
            pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(job.streams)}
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    try:
                        out = fut.result()
                    except StopAsyncIteration:
                        continue
                    if out.finished:
                        job.finals[i] = out
                    yield i, out
                    pending[asyncio.ensure_future(anext(job.streams[i]))] = i
        finally:
            for fut in pending:
                fut.cancel()
            await self._end(job)

    async def _end(self, job: _Job) -> None:
        """Abort the job's unfinished engine requests, all in one command, then log and count each
        one (once)."""
        if job.ended:
            return
        job.ended = True
        self._jobs.discard(job)
        await self.engine.abort(s.request_id for s in job.streams if not s.finished)
        for stream in job.streams:
            self._log_end(stream, job.arrival_time)

    async def _collect(self, job: _Job) -> None:
        try:
            async for _ in self._merged(job):
                pass
        except _STREAM_ERRORS as e:
            raise APIError.from_engine(e) from None
        if len(job.finals) < len(job.streams):
            raise APIError(503, "The request was aborted by the server.", type="server_error")

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.engine.tokenizer.decode(out.prompt_token_ids)

    def _log_end(self, stream: RequestStream, arrival_time: float) -> None:
        last = stream.last
        self.metrics.record(stream.num_prompt_tokens, last, stream.num_output_tokens)
        generated = sum(stream.num_output_tokens.values())
        reason = last.outputs[0].finish_reason if stream.finished else "abort"
        if self.log.enabled:
            logger.info(
                "%s: %d prompt tokens, %d generated tokens, %.3f s, finish=%s",
                stream.request_id,
                stream.num_prompt_tokens,
                generated,
                time.time() - arrival_time,
                reason,
            )


def _jsonable(value: Any) -> Any:
    """A tokenizer setting as JSON: an ``AddedToken`` as its text (vLLM's rule), containers item by item,
    anything else not JSON as its ``str``."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value.content if hasattr(value, "content") else str(value)


def _text_size(messages: Sequence[ChatMessage]) -> int:
    """Characters of the messages' text: how large a conversation is to template and tokenize."""
    return sum(len(m.to_template_dict()["content"]) for m in messages)


def _random_id() -> str:
    """A request id: 128 random bits, as ``uuid4().hex`` has, without its ``os.urandom`` call (a syscall
    that releases the GIL, which the event loop then waits to take back from the engine thread)."""
    return f"{random.getrandbits(128):032x}"
