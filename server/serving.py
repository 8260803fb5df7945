"""The completion and chat endpoints: requests -> engine requests -> OpenAI responses or SSE.

A completion with several prompts is one engine request per prompt; choice ``i * n + j`` is
prompt ``i``'s ``j``-th sample. A streamed request's engine outputs are deltas (what is new since
the previous one, merged by the stream when the reader falls behind); concatenated they equal the
non-streamed text, for which the engine hands over only the final output. Every engine request is
aborted (its KV blocks freed) as soon as its HTTP request goes away, and logged and counted in the
metrics when it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from json.encoder import encode_basestring as json_string
from typing import TypeVar

from fastapi import Request as HTTPRequest
from pydantic import BaseModel

from jaxpaged.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError, RequestStream
from jaxpaged.request import CompletionOutput, RequestOutput, TokenLogprobs
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.server.errors import APIError
from jaxpaged.server.metrics import ServerMetrics
from jaxpaged.server.protocol import (ChatChoice, ChatChoiceLogprobs, ChatChunkChoice, ChatCompletionChunk,
                             ChatCompletionRequest, ChatCompletionResponse, ChatMessage, ChatResponseMessage,
                             ChatTokenLogprob, CompletionChoice, CompletionLogprobs, CompletionRequest,
                             CompletionResponse, DeltaMessage, ErrorResponse, SamplingRequest, TopLogprob,
                             UsageInfo)

logger = logging.getLogger("jaxpaged.server")

T = TypeVar("T")
_ENGINE_ERRORS = (ValueError, EngineOverloadedError, EngineDeadError)


def _named_param(error: ValueError, body: SamplingRequest) -> str | None:
    """The request field an engine error is about: its messages start with the parameter's name."""
    name = str(error).split(" ", 1)[0]
    return name if name in type(body).model_fields else None


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
    as ``json.dumps(text, ensure_ascii=False)`` has it) and that suffix. ~0.5 us an event against
    ~16 us for building and dumping a chat chunk's models (``benchmarks/stream_events.py``): ~4 ms
    of event loop per step at 256 streams. The same bytes as ``sse(chunk(index, text))`` (a test
    compares them)."""

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
        task.cancel()                           # a no-op once it is done
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


@dataclass
class _Job:
    """The engine requests behind one HTTP request."""

    request_id: str
    model: str
    n: int
    arrival_time: float
    streams: list[RequestStream]
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
    close: Callable[[], None]


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
        return prompt if self.max_len is None else prompt[:self.max_len]


class OpenAIServing:
    """Completion and chat logic over one ``AsyncLLMEngine``; the app routes to it. ``model_names``: the
    names requests may use (vLLM's ``--served-model-name``); responses report the first.
    ``chat_template``: Jinja text used instead of the tokenizer's template."""

    def __init__(self, engine: AsyncLLMEngine, model_names: Sequence[str], metrics: ServerMetrics,
                 log: RequestLog = RequestLog(), chat_template: str | None = None) -> None:
        self.engine = engine
        self.model_names = tuple(model_names)
        self.model_name = self.model_names[0]
        self.metrics = metrics
        self.log = log
        self.chat_template = chat_template

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    # ---- /v1/completions ---------------------------------------------------------------------

    async def create_completion(self, body: CompletionRequest,
                                raw: HTTPRequest) -> CompletionResponse | EventStream:
        """The whole completion, or its event stream when ``body.stream``."""
        self.check_model(body.model)
        prompts = body.prompts
        if not prompts:
            raise APIError(400, "prompt must not be empty.", param="prompt")
        echo_logprobs = body.logprobs if body.echo else None
        sp = self._sampling_params(body, max_tokens=body.max_tokens, logprobs=body.logprobs,
                                   prompt_logprobs=echo_logprobs)
        job = await self._submit(f"cmpl-{uuid.uuid4().hex}", prompts, sp, body, prompt_param="prompt")
        if body.stream:
            return EventStream(self._completion_events(job, body), lambda: self._end(job))
        await run_until_disconnect(raw, self._collect(job))
        choices = []
        for i in range(len(job.streams)):
            out = job.finals[i]
            for j, c in enumerate(out.outputs):
                text, logprobs = self._completion_piece(out, c, _ChoiceState(), body)
                choices.append(CompletionChoice(index=i * job.n + j, text=text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return CompletionResponse(id=job.request_id, model=job.model, choices=choices, usage=job.usage)

    @staticmethod
    async def _framed(events: AsyncIterator[str], usage_chunk: Callable[[], BaseModel] | None
                      ) -> AsyncIterator[str]:
        """Frame a stream's choice events: the usage chunk when asked for, an error event if the
        engine died, and always the closing ``[DONE]``."""
        try:
            async with aclosing(events) as inner:
                async for event in inner:
                    yield event
            if usage_chunk is not None:
                yield sse(usage_chunk())
        except EngineDeadError as e:
            yield sse(ErrorResponse(error=APIError.from_engine(e).info))
        yield sse("[DONE]")

    def _completion_events(self, job: _Job, body: CompletionRequest) -> AsyncIterator[str]:
        created = int(time.time())
        usage = (lambda: CompletionResponse(id=job.request_id, created=created, model=job.model, choices=[],
                                            usage=job.usage)) if body.include_usage_in_stream else None
        return self._framed(self._completion_choices(job, body, created), usage)

    async def _completion_choices(self, job: _Job, body: CompletionRequest, created: int) -> AsyncIterator[str]:
        def chunk(index: int, text: str, logprobs: CompletionLogprobs | None = None, finish_reason: str | None = None,
                  stop_reason: int | str | None = None) -> CompletionResponse:
            return CompletionResponse(id=job.request_id, created=created, model=job.model, choices=[CompletionChoice(
                index=index, text=text, logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)])

        states: dict[int, _ChoiceState] = {}
        text_events = TextDeltaEvents(chunk)
        async with aclosing(self._merged(job)) as outputs:
            async for i, out in outputs:
                for j, c in enumerate(out.outputs):
                    index = i * job.n + j
                    text, logprobs = self._completion_piece(out, c, states.setdefault(index, _ChoiceState()), body)
                    if logprobs is None and c.finish_reason is None:
                        if text:
                            yield text_events.event(index, text)
                    elif text or (logprobs is not None and logprobs.tokens) or c.finish_reason is not None:
                        yield sse(chunk(index, text, logprobs, c.finish_reason, c.stop_reason))

    def _completion_piece(self, out: RequestOutput, c: CompletionOutput, state: _ChoiceState,
                          body: CompletionRequest) -> tuple[str, CompletionLogprobs | None]:
        """``c`` (a delta, or the whole output) as a choice's text and, if asked for, logprobs; the
        first piece starts with the prompt when ``echo``."""
        echo = body.echo and not state.started
        text = (self._prompt_text(out) if echo else "") + c.text
        logprobs = None
        if body.logprobs is not None:
            logprobs = CompletionLogprobs()
            if echo:
                self._add_completion_logprobs(logprobs, out.prompt_token_ids, out.prompt_logprobs, state)
            self._add_completion_logprobs(logprobs, c.token_ids, c.logprobs, state)
        state.started = True
        return text, logprobs

    def _add_completion_logprobs(self, logprobs: CompletionLogprobs, token_ids: Sequence[int],
                                 positions: Sequence[TokenLogprobs | None], state: _ChoiceState) -> None:
        """OpenAI's legacy format: per token its text, logprob, offset, and alternatives by text."""
        for token, entries in zip(token_ids, positions):
            if entries is None:                     # the prompt's first token has no logprob
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

    async def create_chat_completion(self, body: ChatCompletionRequest,
                                     raw: HTTPRequest) -> ChatCompletionResponse | EventStream:
        """The whole chat completion, or its event stream when ``body.stream``."""
        self.check_model(body.model)
        prompt = self.apply_chat_template(body.messages, body.add_generation_prompt)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        sp = self._sampling_params(body, max_tokens=max_tokens, logprobs=body.num_logprobs)
        job = await self._submit(f"chatcmpl-{uuid.uuid4().hex}", [prompt], sp, body, prompt_param="messages")
        if body.stream:
            return EventStream(self._chat_events(job, body), lambda: self._end(job))
        await run_until_disconnect(raw, self._collect(job))
        choices = []
        for j, c in enumerate(job.finals[0].outputs):
            text, logprobs = self._chat_piece(c, body)
            choices.append(ChatChoice(index=j, message=ChatResponseMessage(content=text), logprobs=logprobs,
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=job.request_id, model=job.model, choices=choices, usage=job.usage)

    def _chat_events(self, job: _Job, body: ChatCompletionRequest) -> AsyncIterator[str]:
        created = int(time.time())
        usage = (lambda: ChatCompletionChunk(id=job.request_id, created=created, model=job.model, choices=[],
                                             usage=job.usage)) if body.include_usage_in_stream else None
        return self._framed(self._chat_choices(job, body, created), usage)

    async def _chat_choices(self, job: _Job, body: ChatCompletionRequest, created: int) -> AsyncIterator[str]:
        def chunk(choice: ChatChunkChoice) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=job.request_id, created=created, model=job.model, choices=[choice])

        text_events = TextDeltaEvents(lambda j, text: chunk(ChatChunkChoice(index=j, delta=DeltaMessage(content=text))))
        for j in range(job.n):
            yield sse(chunk(ChatChunkChoice(index=j, delta=DeltaMessage(role="assistant", content=""))))
        async with aclosing(self._merged(job)) as outputs:
            async for _, out in outputs:
                for j, c in enumerate(out.outputs):
                    text, logprobs = self._chat_piece(c, body)
                    if logprobs is None and c.finish_reason is None:
                        if text:
                            yield text_events.event(j, text)
                    elif text or (logprobs is not None and logprobs.content) or c.finish_reason is not None:
                        yield sse(chunk(ChatChunkChoice(index=j, delta=DeltaMessage(content=text or None),
                                                        logprobs=logprobs, finish_reason=c.finish_reason,
                                                        stop_reason=c.stop_reason)))

    @staticmethod
    def _chat_piece(c: CompletionOutput, body: ChatCompletionRequest) -> tuple[str, ChatChoiceLogprobs | None]:
        """``c`` (a delta, or the whole output) as text and, if asked for, logprobs in the chat
        format (each token with its ``top_logprobs`` most likely alternatives)."""
        text = c.text
        logprobs = None
        if body.logprobs:
            content = []
            for token, entries in zip(c.token_ids, c.logprobs):
                top = sorted(entries.values(), key=lambda lp: lp.logprob, reverse=True)[:body.top_logprobs or 0]
                chosen = entries[token]
                content.append(ChatTokenLogprob(
                    token=chosen.decoded_token, logprob=chosen.logprob, bytes=list(chosen.decoded_token.encode()),
                    top_logprobs=[TopLogprob(token=lp.decoded_token, logprob=lp.logprob,
                                             bytes=list(lp.decoded_token.encode())) for lp in top]))
            logprobs = ChatChoiceLogprobs(content=content)
        return text, logprobs

    def apply_chat_template(self, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> list[int]:
        try:
            return self.engine.tokenizer.apply_chat_template([m.to_template_dict() for m in messages],
                                                             add_generation_prompt=add_generation_prompt,
                                                             chat_template=self.chat_template)
        except ValueError as e:          # no chat template
            raise APIError(400, str(e), param="messages") from None

    # ---- shared ------------------------------------------------------------------------------

    def _sampling_params(self, body: SamplingRequest, **resolved) -> SamplingParams:
        try:
            return body.to_sampling_params(self.engine.generation_defaults.sampling, **resolved)
        except ValueError as e:
            raise APIError(400, str(e), param=_named_param(e, body)) from None

    async def _submit(self, request_id: str, prompts: list[str | list[int]], sp: SamplingParams,
                      body: SamplingRequest, prompt_param: str) -> _Job:
        """Validate every prompt, then queue them all, or none (raises ``APIError``; an error
        that names no request field is blamed on ``prompt_param``)."""
        arrival = time.time()
        try:
            requests = [self.engine.make_request(f"{request_id}-{i}", p, sp, arrival, body.cache_salt)
                        for i, p in enumerate(prompts)]
        except ValueError as e:
            raise APIError(400, str(e), param=_named_param(e, body) or prompt_param) from None
        streams: list[RequestStream] = []
        try:
            for req in requests:
                streams.append(await self.engine.add_request(req))
                if self.log.enabled and self.log.prompts:
                    logger.info("%s: prompt %r", req.request_id, self.log.excerpt(req.prompt or req.prompt_token_ids))
        except BaseException as e:                  # also when the client left (cancelled) meanwhile
            for stream in streams:
                self.engine.abort(stream.request_id)
            if isinstance(e, _ENGINE_ERRORS):
                raise APIError.from_engine(e) from None
            raise
        return _Job(request_id, self.model_name, sp.n, arrival, streams)

    async def _merged(self, job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(prompt index, output)`` from all the job's streams as they come; on exit, however
        early, ends the job (``_end``).

        Only one output per stream is taken ahead of the reader, so a slow reader leaves the
        streams coalescing outputs instead of queueing them.
        """
        pending: dict[asyncio.Future, int] = {}
        try:
            if len(job.streams) == 1:           # one prompt: its stream is read directly, no task per output
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
            self._end(job)

    def _end(self, job: _Job) -> None:
        """Abort the job's unfinished engine requests, then log and count each one (once)."""
        if job.ended:
            return
        job.ended = True
        for stream in job.streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)
            self._log_end(stream, job.arrival_time)

    async def _collect(self, job: _Job) -> None:
        try:
            async for _ in self._merged(job):
                pass
        except EngineDeadError as e:
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
            logger.info("%s: %d prompt tokens, %d generated tokens, %.3f s, finish=%s", stream.request_id,
                        stream.num_prompt_tokens, generated, time.time() - arrival_time, reason)
