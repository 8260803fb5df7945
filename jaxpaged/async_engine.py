"""``AsyncLLMEngine``: the synchronous ``LLMEngine`` driven by a background thread, for servers.

It has its own module so that ``engine.py`` stays the synchronous core, free of threads and asyncio.

``LLMEngine`` is not thread-safe, so one thread, the loop thread, is the only one that adds,
aborts or steps. Callers on any asyncio event loop hand it work through a locked command list
and read outputs from per-request ``RequestStream``s, fed with ``call_soon_threadsafe``. The
jitted step releases the GIL, so an event loop keeps serving HTTP while the model runs.
Validation (``LLMEngine.make_request``: tokenization, parameter and length checks) runs in the
caller's thread, so a bad request is refused at once without waiting for a step. The prompts of one
API request are added in one command (``add_requests``) and aborted in one (``abort`` with their
ids); the loop thread applies commands outside the lock, so an event loop queueing more never waits
while a thousand adds are applied.

The loop thread takes the GIL back several times per step (after each device call). With
Python's default 5 ms switch interval it can wait that long each time while the event loop
serializes JSON, which more than doubled step time under load; so the interval is lowered
(process-wide) to ``_SWITCH_INTERVAL``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections import defaultdict, deque
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from jaxpaged.config import DEFAULT_MAX_WAITING_REQUESTS, AsyncEngineArgs, EngineArgs
from jaxpaged.generation_config import GenerationDefaults
from jaxpaged.prompts import PromptInput, parse_prompt
from jaxpaged.request import Request, RequestOutput, RequestStatus
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from jaxpaged.spec_decode.metrics import SpecDecodingStats
from jaxpaged.step_stats import StepStats

if TYPE_CHECKING:  # the engine pulls in JAX; importing this module should not
    from jaxpaged.engine import LLMEngine
    from jaxpaged.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_SWITCH_INTERVAL = 0.0005


class EngineDeadError(RuntimeError):
    """The loop thread has stopped (an error in a step, or shutdown); nothing more is served."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full, or a request waited in it past ``max_queue_time``; the caller
    should retry later."""


class RequestFailedError(RuntimeError):
    """The engine failed while processing this one request (finish reason "error"); it serves the others."""

    def __init__(self, request_id: str) -> None:
        super().__init__(
            f"the engine failed while processing request {request_id}; it keeps serving the others."
        )


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot of the engine, taken by the loop thread between steps."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    """Fraction of usable KV blocks in use (1.0 = full)."""
    num_free_blocks: int
    num_usable_blocks: int
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache so far."""
    prefix_cache_hits: int
    """Of those, tokens found cached (not recomputed)."""
    num_preemptions: int
    """Preemptions so far (a request preempted twice counts twice)."""
    steps: StepStats
    """The steps' histograms so far."""
    spec_decode: SpecDecodingStats | None
    """Speculative decoding's counters so far (None without it)."""
    alive: bool


class RequestStream:
    """Async iterator over one request's ``RequestOutput``s; ends after the finished one.

    A reader that falls behind gets one output for the several it missed: the newest of
    ``CUMULATIVE`` ones (each carries everything so far), or the ``DELTA`` ones merged into one
    (``RequestOutput.add``), so nothing is lost and a stream holds at most one output. Leaving
    ``async with stream`` before the request finished aborts it, freeing its KV blocks. A request
    the engine ended with finish reason "error" raises ``RequestFailedError`` after what it output.
    """

    def __init__(self, request: Request, engine: AsyncLLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request.request_id
        self.num_prompt_tokens = request.num_prompt_tokens
        self.loop = loop
        self.last: RequestOutput | None = None
        """The newest output handed to the reader."""
        self.num_output_tokens: dict[int, int] = {}
        """Tokens of each sample (by ``CompletionOutput.index``) in the outputs handed to the reader."""
        self._delta = request.sampling_params.output_kind is RequestOutputKind.DELTA
        self._engine = engine
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._done = False
        self._event = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    def _put(self, output: RequestOutput) -> None:
        if output.finished and any(c.finish_reason == "error" for c in output.outputs):
            self._fail(RequestFailedError(self.request_id))
            return
        if self._delta and self._pending is not None:
            self._pending.add(output)
        else:
            self._pending = output
        self._done = output.finished
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._done = True
        self._event.set()

    def _close(self) -> None:
        self._done = True
        self._event.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._pending is not None:
                self.last, self._pending = self._pending, None
                counts = self.num_output_tokens
                for c in self.last.outputs:
                    before = counts.get(c.index, 0) if self._delta else 0
                    counts[c.index] = before + len(c.token_ids)
                return self.last
            if self._error is not None:
                raise self._error
            if self._done:
                raise StopAsyncIteration
            self._event.clear()
            await self._event.wait()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        if not self.finished:
            await self._engine.abort(self.request_id)


@dataclass
class _Add:
    requests: list[Request]
    streams: list[RequestStream]
    admitted: asyncio.Future


@dataclass
class _Abort:
    request_ids: list[str]


class AsyncLLMEngine:
    """Runs an ``LLMEngine`` in a daemon thread; safe to call from any thread or event loop.

    ``max_waiting_requests`` bounds the requests queued but not running: past it,
    ``add_request`` raises ``EngineOverloadedError`` instead of letting memory grow.
    ``max_queue_time`` (seconds; None: no limit) bounds how long an added request may wait for its
    first step: one whose prompts have none started by then ends with ``EngineOverloadedError``, as
    a full queue at full load means minutes of waiting, better spent retrying elsewhere.
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
        max_queue_time: float | None = None,
    ) -> None:
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be at least 1, got {max_waiting_requests}.")
        if max_queue_time is not None and not max_queue_time > 0:
            raise ValueError(
                f"max_queue_time must be a positive number of seconds (or None), got {max_queue_time}."
            )
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.max_queue_time = max_queue_time
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._commands: deque[_Add | _Abort] = deque()
        self._num_pending_adds = 0
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        self._queued: deque[tuple[float, list[Request]]] = deque()
        """(deadline, requests) of the adds subject to ``max_queue_time``, oldest first (loop thread only)."""
        self._error: EngineDeadError | None = None
        self._stopping = False
        self.stats = self._snapshot()
        sys.setswitchinterval(min(sys.getswitchinterval(), _SWITCH_INTERVAL))
        self._thread = threading.Thread(target=self._run, name="jaxpaged-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLMEngine:
        """Build the engine and start its loop thread; ``AsyncEngineArgs`` also bound the waiting queue."""
        from jaxpaged.engine import LLMEngine

        if isinstance(args, AsyncEngineArgs):
            return cls(LLMEngine.from_engine_args(args), args.max_waiting_requests, args.max_queue_time)
        return cls(LLMEngine.from_engine_args(args))

    # ---- read-only facts, safe from any thread -------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def generation_defaults(self) -> GenerationDefaults:
        return self.engine.generation_defaults

    @property
    def is_running(self) -> bool:
        """The loop thread runs and serves requests (vLLM's name)."""
        return self._error is None and self._thread.is_alive()

    @property
    def errored(self) -> bool:
        """The engine has stopped, by an error or ``shutdown``; ``dead_error`` says why."""
        return self._error is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._error

    async def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    async def check_health(self) -> None:
        """Raises ``EngineDeadError`` once the engine has stopped."""
        if self._error is not None:
            raise self._error

    # ---- requests ---------------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Validate and tokenize without queueing (raises ``ValueError``); see ``add_request``."""
        return self.engine.make_request(
            request_id, prompt, sampling_params, arrival_time, cache_salt, priority
        )

    async def add_request(self, request: Request) -> RequestStream:
        """Queue a request made by ``make_request``; returns once the scheduler accepted it
        (``add_requests``, for one request)."""
        return (await self.add_requests([request]))[0]

    async def add_requests(self, requests: Sequence[Request]) -> list[RequestStream]:
        """Queue requests made by ``make_request``, the prompts of one API request, together: one
        command, applied between two steps, all or none; they then take turns with other calls'
        requests. Returns their streams once the scheduler accepted them; cancelled meanwhile, aborts them.

        Raises ``ValueError`` if the scheduler refuses one (nothing is left behind) or they are more
        than the waiting queue holds, ``EngineOverloadedError`` if the waiting queue has no room for
        them now, ``EngineDeadError`` if the engine has stopped, ``RequestFailedError`` if adding them
        failed otherwise.
        """
        if len(requests) > self.max_waiting_requests:
            raise ValueError(
                f"{len(requests)} prompts in one request are more than the waiting queue holds "
                f"({self.max_waiting_requests}); send at most that many at once."
            )
        loop = asyncio.get_running_loop()
        streams = [RequestStream(r, self, loop) for r in requests]
        admitted = loop.create_future()
        with self._lock:
            if self._error is not None:
                raise self._error
            if self.stats.num_waiting + self._num_pending_adds + len(requests) > self.max_waiting_requests:
                raise EngineOverloadedError(
                    f"the server is overloaded: {self.stats.num_waiting + self._num_pending_adds} requests are "
                    f"already waiting (at most {self.max_waiting_requests}); retry later."
                )
            self._commands.append(_Add(list(requests), streams, admitted))
            self._num_pending_adds += len(requests)
        self._wakeup.set()
        try:
            await admitted
        except asyncio.CancelledError:
            await self.abort(r.request_id for r in requests)
            raise
        return streams

    async def generate(
        self, prompt: PromptInput, sampling_params: SamplingParams, request_id: str, *, priority: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        """vLLM's ``AsyncLLMEngine.generate``: the request's outputs as they come (kind per
        ``sampling_params.output_kind``), the finished one last. ``prompt`` is text, token ids or a prompt
        dict. Leaving the loop early, or cancelling the task iterating it, aborts the request. Raises as
        ``make_request`` and ``add_request`` do, and ``RequestFailedError`` if the engine failed on it."""
        parsed = parse_prompt(prompt)
        request = self.make_request(
            request_id, parsed.prompt, sampling_params, cache_salt=parsed.cache_salt, priority=priority
        )
        async with await self.add_request(request) as stream:
            async for output in stream:
                yield output

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Drop requests (an id, or several: vLLM's signature) wherever they are and free their
        blocks, in one command; a no-op for those that have finished. Returns at once: the loop thread
        drops them before its next step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            if self._error is not None or not ids:
                return
            self._commands.append(_Abort(ids))
        self._wakeup.set()

    def shutdown(self) -> None:
        """Stop the loop thread; unfinished streams end with ``EngineDeadError``."""
        with self._lock:
            self._stopping = True
        self._wakeup.set()
        self._thread.join()

    # ---- the loop thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._serve_commands():
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait()
                    continue
                outputs = self.engine.step()
                self._dispatch(outputs)
                with self._lock:
                    self.stats = self._snapshot()
        except Exception as e:
            logger.exception("engine loop failed; the engine is dead")
            self._die(
                EngineDeadError(f"the engine failed and stopped ({type(e).__name__}); restart the server.")
            )
            return
        for request_id in self._streams:  # shut down cleanly: the engine holds no requests after
            self.engine.abort_request(request_id)
        self._die(EngineDeadError("the engine has been shut down."))

    def _serve_commands(self) -> bool:
        """Apply the queued adds and aborts in order, each outside the lock (the event loop takes it to
        queue more), then time out what waited too long; False once shutdown has been asked for."""
        self._wakeup.clear()
        applied = 0
        while True:
            with self._lock:
                if not self._commands:
                    break
                command = self._commands.popleft()
            self._apply(command)
            applied += len(command.requests) if isinstance(command, _Add) else 0
        self._expire_queued()
        with self._lock:  # the stats now count the requests the pending count did
            self._num_pending_adds -= applied
            self.stats = self._snapshot()
            return not self._stopping

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            for request_id in command.request_ids:
                self.engine.abort_request(request_id)
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    _post(stream.loop, stream._close)
            return
        try:
            self.engine.add_prepared_requests(command.requests)
        except ValueError as e:
            _resolve(command.admitted, e)
            return
        except Exception:  # these requests' failure: adding is all or nothing
            logger.exception("adding request %s failed; the engine goes on", command.requests[0].request_id)
            _resolve(command.admitted, RequestFailedError(command.requests[0].request_id))
            return
        except BaseException:
            _resolve(command.admitted, EngineDeadError("the engine failed while adding a request."))
            raise
        self._streams.update((r.request_id, s) for r, s in zip(command.requests, command.streams))
        if self.max_queue_time is not None:
            self._queued.append((time.monotonic() + self.max_queue_time, command.requests))
        _resolve(command.admitted, None)

    def _expire_queued(self) -> None:
        """End the added requests none of whose prompts has started within ``max_queue_time``
        (``EngineOverloadedError``), freeing their place in the queue."""
        now = time.monotonic()
        while self._queued and self._queued[0][0] <= now:
            _, requests = self._queued.popleft()
            if any(r.status is not RequestStatus.WAITING for r in requests):
                continue  # started, or ended already
            error = EngineOverloadedError(
                f"the request waited {self.max_queue_time:g} s without starting: "
                f"the server is overloaded; retry later."
            )
            for r in requests:
                self.engine.abort_request(r.request_id)
                stream = self._streams.pop(r.request_id, None)
                if stream is not None:
                    _post(stream.loop, stream._fail, error)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their streams: one callback per event loop per step."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = defaultdict(
            list
        )
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            batches[stream.loop].append((stream, out))
        for loop, batch in batches.items():
            if not _post(loop, _deliver, batch):  # nobody is left to read these streams
                for stream, _ in batch:
                    self.engine.abort_request(stream.request_id)
                    self._streams.pop(stream.request_id, None)

    def _die(self, error: EngineDeadError) -> None:
        with self._lock:
            self._error = error
            commands, self._commands = self._commands, deque()
            self.stats = self._snapshot()
        for command in commands:
            if isinstance(command, _Add):
                _resolve(command.admitted, error)
        for stream in self._streams.values():
            _post(stream.loop, stream._fail, error)
        self._streams.clear()

    def _snapshot(self) -> EngineStats:
        kv = self.engine.kv_cache_manager
        return EngineStats(
            num_running=self.engine.scheduler.num_running,
            num_waiting=self.engine.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_usable_blocks=self.engine.cache_info.num_usable_blocks,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            num_preemptions=self.engine.scheduler.num_preemptions,
            steps=self.engine.step_stats.copy(),
            spec_decode=None if (spec := self.engine.spec_decode_stats) is None else spec.copy(),
            alive=self._error is None,
        )


def _deliver(batch: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in batch:
        stream._put(out)


def _post(loop: asyncio.AbstractEventLoop, callback, *args) -> bool:
    """Schedule ``callback`` on ``loop`` from the loop thread; False if that loop has closed."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    """Settle ``future`` from the loop thread (unless its caller already gave up)."""

    def settle() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    _post(future.get_loop(), settle)
