"""The completion and chat endpoints: requests -> engine requests -> OpenAI responses or SSE.

A completion with several prompts is one engine request per prompt; choice ``i * n + j`` is
prompt ``i``'s ``j``-th sample. Engine outputs carry the whole text so far, so streamed
deltas are what each output adds to what was already sent; concatenated they equal the
non-streamed text. Every engine request is aborted (its KV blocks freed) as soon as its
HTTP request goes away, and logged and counted in the metrics when it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request as HTTPRequest
from pydantic import BaseModel

from jaxpaged.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError, RequestStream
from jaxpaged.request import CompletionOutput, RequestOutput
from jaxpaged.sampling_params import SamplingParams
from server.errors import APIError
from server.metrics import ServerMetrics
from server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                             ChatCompletionResponse, ChatMessage, ChatResponseMessage, CompletionChoice,
                             CompletionRequest, CompletionResponse, DeltaMessage, ErrorResponse, UsageInfo)

logger = logging.getLogger("jaxpaged.server")

T = TypeVar("T")
_ENGINE_ERRORS = (ValueError, EngineOverloadedError, EngineDeadError)


class ClientDisconnected(Exception):
    """The client went away before a non-streamed response was ready."""


def sse(payload: BaseModel | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


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
    """What has been streamed of one choice so far."""

    num_chars: int = 0
    num_tokens: int = 0
    finished: bool = False


@dataclass
class _Job:
    """The engine requests behind one HTTP request."""

    request_id: str
    model: str
    n: int
    arrival_time: float
    streams: list[RequestStream]
    finals: dict[int, RequestOutput] = field(default_factory=dict)

    @property
    def usage(self) -> UsageInfo:
        prompt = sum(s.num_prompt_tokens for s in self.streams)
        completion = sum(len(c.token_ids) for s in self.streams if s.last is not None for c in s.last.outputs)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class OpenAIServing:
    """Completion and chat logic over one ``AsyncLLMEngine``; the app routes to it."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, metrics: ServerMetrics,
                 log_prompts: bool = False) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.log_prompts = log_prompts

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    # ---- /v1/completions ---------------------------------------------------------------------

    async def create_completion(self, body: CompletionRequest, raw: HTTPRequest):
        """A ``CompletionResponse``, or an SSE event stream when ``body.stream``."""
        self.check_model(body.model)
        prompts = body.prompts
        if not prompts:
            raise APIError(400, "prompt must not be empty.", param="prompt")
        sp = self._sampling_params(body, max_tokens=body.max_tokens, logprobs=body.logprobs)
        job = await self._submit(f"cmpl-{uuid.uuid4().hex}", prompts, sp, body.cache_salt, param="prompt")
        if body.stream:
            return self._completion_events(job, body)
        await run_until_disconnect(raw, self._collect(job))
        choices = []
        for i, stream in enumerate(job.streams):
            out = job.finals[i]
            echo = self._prompt_text(out) if body.echo else ""
            for c in out.outputs:
                choices.append(CompletionChoice(
                    index=i * job.n + c.index, text=echo + c.text, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=job.request_id, model=job.model, choices=choices, usage=job.usage)

    async def _completion_events(self, job: _Job, body: CompletionRequest) -> AsyncIterator[str]:
        states: dict[int, _ChoiceState] = {}
        created = int(time.time())
        try:
            async with aclosing(self._merged(job)) as outputs:
                async for i, out in outputs:
                    for c in out.outputs:
                        index = i * job.n + c.index
                        state = states.setdefault(index, _ChoiceState())
                        text = self._delta(c, state)
                        if state.num_tokens == 0 and body.echo:
                            text = self._prompt_text(out) + text
                        if text or c.finish_reason is not None:
                            yield sse(CompletionResponse(
                                id=job.request_id, created=created, model=job.model,
                                choices=[CompletionChoice(index=index, text=text, finish_reason=c.finish_reason,
                                                          stop_reason=c.stop_reason)]))
                        state.num_tokens = len(c.token_ids)
            if body.include_usage_in_stream:
                yield sse(CompletionResponse(id=job.request_id, created=created, model=job.model,
                                             choices=[], usage=job.usage))
        except EngineDeadError as e:
            yield sse(ErrorResponse(error=APIError.from_engine(e).info))
        yield sse("[DONE]")

    # ---- /v1/chat/completions ----------------------------------------------------------------

    async def create_chat_completion(self, body: ChatCompletionRequest, raw: HTTPRequest):
        """A ``ChatCompletionResponse``, or an SSE event stream when ``body.stream``."""
        self.check_model(body.model)
        prompt = self.apply_chat_template(body.messages, body.add_generation_prompt)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        sp = self._sampling_params(body, max_tokens=max_tokens, logprobs=body.num_logprobs)
        job = await self._submit(f"chatcmpl-{uuid.uuid4().hex}", [prompt], sp, body.cache_salt,
                                 param="messages")
        if body.stream:
            return self._chat_events(job, body)
        await run_until_disconnect(raw, self._collect(job))
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for c in job.finals[0].outputs]
        return ChatCompletionResponse(id=job.request_id, model=job.model, choices=choices, usage=job.usage)

    async def _chat_events(self, job: _Job, body: ChatCompletionRequest) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(index: int, delta: DeltaMessage, c: CompletionOutput | None = None) -> str:
            choice = ChatChunkChoice(index=index, delta=delta, finish_reason=c and c.finish_reason,
                                     stop_reason=c and c.stop_reason)
            return sse(ChatCompletionChunk(id=job.request_id, created=created, model=job.model, choices=[choice]))

        try:
            for index in range(job.n):
                yield chunk(index, DeltaMessage(role="assistant", content=""))
            states = [_ChoiceState() for _ in range(job.n)]
            async with aclosing(self._merged(job)) as outputs:
                async for _, out in outputs:
                    for c in out.outputs:
                        text = self._delta(c, states[c.index])
                        if text or c.finish_reason is not None:
                            yield chunk(c.index, DeltaMessage(content=text or None), c)
                        states[c.index].num_tokens = len(c.token_ids)
            if body.include_usage_in_stream:
                yield sse(ChatCompletionChunk(id=job.request_id, created=created, model=job.model,
                                              choices=[], usage=job.usage))
        except EngineDeadError as e:
            yield sse(ErrorResponse(error=APIError.from_engine(e).info))
        yield sse("[DONE]")

    def apply_chat_template(self, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> list[int]:
        try:
            return self.engine.tokenizer.apply_chat_template([m.to_template_dict() for m in messages],
                                                             add_generation_prompt=add_generation_prompt)
        except ValueError as e:          # no chat template
            raise APIError(400, str(e), param="messages") from None

    # ---- shared ------------------------------------------------------------------------------

    @staticmethod
    def _sampling_params(body: CompletionRequest | ChatCompletionRequest, **resolved) -> SamplingParams:
        try:
            return body.to_sampling_params(**resolved)
        except ValueError as e:
            raise APIError.from_engine(e) from None

    async def _submit(self, request_id: str, prompts: list[str | list[int]], sp: SamplingParams,
                      cache_salt: str | None, param: str) -> _Job:
        """Validate every prompt, then queue them all, or none (raises ``APIError``; a bad
        prompt names ``param``)."""
        arrival = time.time()
        try:
            requests = [self.engine.make_request(f"{request_id}-{i}", p, sp, arrival, cache_salt)
                        for i, p in enumerate(prompts)]
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None
        streams: list[RequestStream] = []
        try:
            for req in requests:
                streams.append(await self.engine.add_request(req))
                if self.log_prompts:
                    logger.info("%s: prompt %r", req.request_id, req.prompt or req.prompt_token_ids)
        except _ENGINE_ERRORS as e:
            for stream in streams:
                self.engine.abort(stream.request_id)
            raise APIError.from_engine(e) from None
        return _Job(request_id, self.model_name, sp.n, arrival, streams)

    async def _merged(self, job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(prompt index, output)`` from all the job's streams as they come; on exit, however
        early, aborts every unfinished engine request and records each one's end.

        Only one output per stream is taken ahead of the reader, so a slow reader leaves the
        streams coalescing outputs instead of queueing them.
        """
        pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(job.streams)}
        try:
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

    @staticmethod
    def _delta(c: CompletionOutput, state: _ChoiceState) -> str:
        text = c.text[state.num_chars:]
        state.num_chars = len(c.text)
        return text

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.engine.tokenizer.decode(out.prompt_token_ids)

    def _log_end(self, stream: RequestStream, arrival_time: float) -> None:
        last = stream.last
        self.metrics.record(stream.num_prompt_tokens, last)
        generated = sum(len(c.token_ids) for c in last.outputs) if last is not None else 0
        reason = last.outputs[0].finish_reason if stream.finished else "abort"
        logger.info("%s: %d prompt tokens, %d generated tokens, %.3f s, finish=%s", stream.request_id,
                    stream.num_prompt_tokens, generated, time.time() - arrival_time, reason)
