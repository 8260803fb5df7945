"""Server-sent events: ``sse`` writes one, ``TextDeltaEvents`` a stream's common text chunk without
pydantic, ``framed`` ends a stream's events, and ``EventStream`` is a streamed response."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from json.encoder import encode_basestring as json_string

from pydantic import BaseModel

from jaxpaged.async_engine import EngineDeadError, EngineOverloadedError, RequestFailedError
from jaxpaged.server.errors import APIError
from jaxpaged.server.response_models import ErrorResponse

STREAM_ERRORS = (EngineDeadError, EngineOverloadedError, RequestFailedError)
"""What ends a request's stream with an error: the engine stopped, the request waited past
``max_queue_time``, or its own processing failed."""


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


@dataclass
class EventStream:
    """A streamed response: its server-sent events, and ``close``, to call when the response ends
    however it ends (even before the first event): aborts and records what is unfinished."""

    events: AsyncGenerator[str, None]
    close: Callable[[], Awaitable[None]]


async def framed(
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
    except STREAM_ERRORS as e:
        yield sse(ErrorResponse(error=APIError.from_engine(e).info))
    yield sse("[DONE]")
