"""What the endpoints share (``ServingBase``): building, queueing, reading and ending a request's engine
requests, and the limits (``ServerLimits``) and logging (``RequestLog``) around them.

A streamed request's engine outputs are deltas (what is new since the previous one, merged by the
stream when the reader falls behind); concatenated they equal the non-streamed text, for which the
engine hands over only the final output. Every engine request is aborted (its KV blocks freed) as
soon as its HTTP request goes away, and logged and counted in the metrics when it ends.

Nothing heavy runs on the event loop: a large input (over ``_OFF_LOOP_CHARS`` characters or token
ids) is tokenized, templated or detokenized in a worker thread, after the tokenizer's lower bound on
its length (``Tokenizer.min_num_tokens``) has refused it if it surely cannot fit. A request's
prompts are queued in one engine call and aborted in one, whenever the client leaves, even while
they are being tokenized or queued. ``ServerLimits`` bounds what one request may take.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request as HTTPRequest

from jaxpaged.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
    RequestStream,
)
from jaxpaged.request import Request, RequestOutput
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.server.errors import APIError
from jaxpaged.server.event_stream import STREAM_ERRORS
from jaxpaged.server.metrics import ServerMetrics
from jaxpaged.server.request_models import ChatMessage, SamplingRequest, Tool
from jaxpaged.server.response_models import UsageInfo
from jaxpaged.server.structured_requests import constraint_field, structured_outputs_of
from jaxpaged.server.tool_parsers import ToolParser
from jaxpaged.tokenizer import GIL_HELD_CHARS

logger = logging.getLogger("jaxpaged.server")

T = TypeVar("T")
_ENGINE_ERRORS = (ValueError, EngineOverloadedError, EngineDeadError, RequestFailedError)
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


class ClientDisconnected(Exception):
    """The client went away before a non-streamed response was ready."""


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


@dataclass(eq=False)
class Job:
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

    def usage_chunk(
        self, include: bool, created: int, chunk_type: Callable[..., Any]
    ) -> Callable[[], Any] | None:
        """A stream's closing usage-only chunk, built by ``chunk_type`` when called; None unless ``include``."""
        if not include:
            return None
        return lambda: chunk_type(
            id=self.request_id, created=created, model=self.model, choices=[], usage=self.usage
        )


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


class ServingBase:
    """What the endpoints share, over one ``AsyncLLMEngine``. ``model_names``: the
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
        self._jobs: set[Job] = set()
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

    # ---- shared ------------------------------------------------------------------------------

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

    async def _submit(self, request_id: str, requests: list[Request], sp: SamplingParams) -> Job:
        """Queue a request's prompts all together, or none (raises ``APIError``); refused while draining."""
        if self.draining:
            raise shutting_down_error()
        job = Job(request_id, self.model_name, sp.n, requests[0].arrival_time)
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

    async def _merged(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
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

    async def _end(self, job: Job) -> None:
        """Abort the job's unfinished engine requests, all in one command, then log and count each
        one (once)."""
        if job.ended:
            return
        job.ended = True
        self._jobs.discard(job)
        await self.engine.abort(s.request_id for s in job.streams if not s.finished)
        for stream in job.streams:
            self._log_end(stream, job.arrival_time)

    async def _collect(self, job: Job) -> None:
        try:
            async for _ in self._merged(job):
                pass
        except STREAM_ERRORS as e:
            raise APIError.from_engine(e) from None
        if len(job.finals) < len(job.streams):
            raise APIError(503, "The request was aborted by the server.", type="server_error")

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


def text_size(messages: Sequence[ChatMessage]) -> int:
    """Characters of the messages' text: how large a conversation is to template and tokenize."""
    return sum(len(m.to_template_dict()["content"]) for m in messages)


def random_id() -> str:
    """A request id: 128 random bits, as ``uuid4().hex`` has, without its ``os.urandom`` call (a syscall
    that releases the GIL, which the event loop then waits to take back from the engine thread)."""
    return f"{random.getrandbits(128):032x}"
