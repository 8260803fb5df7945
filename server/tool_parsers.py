"""Tool-call parsers: a model's text -> OpenAI ``tool_calls`` (``--tool-call-parser``, vLLM's names).

``get_tool_parser(name)`` gives the class; make one instance per choice, as streaming keeps state.
``extract_tool_calls(text)`` parses a whole output; ``extract_tool_calls_streaming(delta)`` is fed each
new piece of text and ``finish()`` flushes what it held back at the end. Both follow the same rules, so the
streamed content and tool calls (names, argument strings, order) equal the non-streamed ones; only the
random ids differ. A call is streamed once it is known whole (its block closed, or its object complete), as
one ``DeltaToolCall`` with its index, id, type and name (arguments ``""``) and one with its arguments string.

Rules shared by the parsers:

- A call is a JSON object with a non-empty string ``"name"`` and an object of arguments; the arguments are
  sent as ``json.dumps(arguments, ensure_ascii=False)``.
- Calls are parsed in order and parsing stops at the first malformed one: if nothing valid came before it,
  the whole output is plain content (vLLM's rule); else the calls before it stand, as a stream cannot take
  back calls it has sent, and the rest is dropped, as a model that wrote a malformed call is off the format.

``hermes`` (Qwen2.5, SmolLM2/3, Hermes): calls are ``<tool_call>...</tool_call>`` blocks, each holding one
call object or a JSON array of them (SmolLM2's format; ``[]`` holds none); a last block may lack its closing
tag (generation stopped there). The content is the text before the first block, or None if blank; text
between and after blocks is dropped. ``llama3_json`` (alias ``llama4_json``): the output, after optional
whitespace and ``<|python_tag|>``, is call objects separated by ``;``, whose arguments are ``"parameters"``
(or ``"arguments"``); content is then None.

Hermes tags must reach the parser: detokenize with special tokens kept where a tokenizer marks them special.
"""

from __future__ import annotations

import enum
import json
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

# ---------------------------------------------------------------------------------------------------------
# Data objects: OpenAI's field names, so ``dataclasses.asdict`` gives the wire shape (drop None in deltas).


def make_tool_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: str
    """The arguments object as JSON text."""


@dataclass(frozen=True)
class ToolCall:
    function: FunctionCall
    id: str = field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"


@dataclass(frozen=True)
class ExtractedToolCalls:
    """A whole output, parsed: its tool calls and the message content that goes with them."""

    tool_calls: list[ToolCall]
    content: str | None

    @property
    def tools_called(self) -> bool:
        """Whether the output called tools (then finish_reason is ``"tool_calls"``)."""
        return bool(self.tool_calls)


@dataclass(frozen=True)
class DeltaFunctionCall:
    name: str | None = None
    arguments: str | None = None


@dataclass(frozen=True)
class DeltaToolCall:
    """One piece of the call at ``index``: the first carries id, type and name, the next the arguments."""

    index: int
    function: DeltaFunctionCall
    id: str | None = None
    type: Literal["function"] | None = None


@dataclass(frozen=True)
class DeltaMessage:
    """What a stream chunk adds to the message: a content fragment and/or tool call pieces, in that order."""

    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------
# Parsing helpers.

_JSON_WHITESPACE = " \t\n\r"


def _reject_constant(name: str) -> Any:
    # json accepts NaN and Infinity, which are not JSON: json.dumps would send them back as invalid JSON.
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _JSON_WHITESPACE:
        pos += 1
    return pos


def _is_blank(text: str) -> bool:
    return not text.strip()


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` without completing it (0 if none)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


def _function_call(obj: Any, argument_keys: tuple[str, ...]) -> FunctionCall | None:
    """The call ``obj`` describes (arguments under the first of ``argument_keys`` it has), or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((key for key in argument_keys if key in obj), None)
    if key is None or not isinstance(obj[key], dict):
        return None
    call = FunctionCall(obj["name"], json.dumps(obj[key], ensure_ascii=False))
    try:
        # JSON escapes can spell lone surrogates ("\ud800"), which cannot be sent as UTF-8.
        (call.name + call.arguments).encode()
    except UnicodeEncodeError:
        return None
    return call


def _message(content: list[str], tool_calls: list[DeltaToolCall]) -> DeltaMessage | None:
    text = "".join(content)
    return DeltaMessage(text or None, tool_calls) if text or tool_calls else None


class _Mode(enum.Enum):
    """Where a stream stands; the parsers' rules (module docstring) say what each mode does with new text."""

    CONTENT = enum.auto()  # nothing valid parsed yet
    CALLS = enum.auto()  # something valid parsed: text outside calls is dropped
    PLAIN = enum.auto()  # the output proved to be plain text: all of it is content
    DONE = enum.auto()  # a malformed call followed valid ones: the rest is dropped


class ToolParser(ABC):
    """Parses one choice's output into tool calls; an instance keeps one stream's state."""

    def __init__(self) -> None:
        self._calls_sent = 0

    @property
    def tools_called(self) -> bool:
        """Whether the stream has sent a tool call so far (at the end: finish_reason ``"tool_calls"``)."""
        return self._calls_sent > 0

    @abstractmethod
    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        """Parse a whole output (stateless: any instance may do it)."""

    @abstractmethod
    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage | None:
        """Take the next piece of the output; return what can be sent now, or None if nothing."""

    @abstractmethod
    def finish(self) -> DeltaMessage | None:
        """End the stream: return what was held back (content or a last call), or None."""

    def _call_deltas(self, call: FunctionCall) -> list[DeltaToolCall]:
        """A whole call as a stream sends it: its header with the name, then its arguments."""
        index = self._calls_sent
        self._calls_sent += 1
        return [
            DeltaToolCall(
                index, DeltaFunctionCall(name=call.name, arguments=""), make_tool_call_id(), "function"
            ),
            DeltaToolCall(index, DeltaFunctionCall(arguments=call.arguments)),
        ]


# ---------------------------------------------------------------------------------------------------------
# Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>


def _hermes_block(body: str) -> list[FunctionCall] | None:
    """The calls in a block's body (a call object, or an array of them), or None if it is malformed."""
    try:
        obj = _DECODER.decode(body)
    except (ValueError, RecursionError):  # RecursionError: a model can nest brackets past the decoder's limit
        return None
    calls = [_function_call(item, ("arguments",)) for item in (obj if isinstance(obj, list) else [obj])]
    return None if None in calls else calls


class HermesToolParser(ToolParser):
    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._mode = _Mode.CONTENT
        self._buffer = ""  # text neither sent nor dropped: a possible start tag's beginning, or an open block
        self._in_block = False  # the buffer is an open block, from its start tag on
        self._blank = ""  # leading blank content, held back: a block right after it makes the content None
        self._content_sent = False

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        first = model_output.find(self.START)
        calls: list[FunctionCall] = []
        any_valid = False
        start = first
        while start != -1:
            body = start + len(self.START)
            end = model_output.find(self.END, body)
            block = _hermes_block(model_output[body:] if end == -1 else model_output[body:end])
            if block is None:
                break
            calls += block
            any_valid = True
            start = -1 if end == -1 else model_output.find(self.START, end + len(self.END))
        if not any_valid:
            return ExtractedToolCalls([], model_output)
        content = model_output[:first]
        return ExtractedToolCalls([ToolCall(call) for call in calls], None if _is_blank(content) else content)

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage | None:
        self._buffer += delta_text
        content: list[str] = []
        tool_calls: list[DeltaToolCall] = []
        while self._buffer:
            if self._mode is _Mode.PLAIN:
                content.append(self._buffer)
                self._buffer = ""
            elif self._mode is _Mode.DONE:
                self._buffer = ""
            elif self._in_block:
                end = self._buffer.find(self.END, len(self.START))
                if end == -1:
                    break
                self._close_block(self._buffer[len(self.START) : end], content, tool_calls)
                if self._mode is _Mode.CALLS:
                    self._buffer = self._buffer[end + len(self.END) :]
            else:
                start = self._buffer.find(self.START)
                sendable = (
                    len(self._buffer) - _partial_tag(self._buffer, self.START) if start == -1 else start
                )
                if self._mode is _Mode.CONTENT:
                    self._send_content(self._buffer[:sendable], content)
                self._buffer = self._buffer[sendable:]
                if start == -1:
                    break
                self._in_block = True
        return _message(content, tool_calls)

    def finish(self) -> DeltaMessage | None:
        content: list[str] = []
        tool_calls: list[DeltaToolCall] = []
        if self._in_block:
            self._close_block(self._buffer[len(self.START) :], content, tool_calls)
        if self._mode in (_Mode.CONTENT, _Mode.PLAIN):
            content += [self._blank, self._buffer]
        self._blank = self._buffer = ""
        return _message(content, tool_calls)

    def _send_content(self, text: str, content: list[str]) -> None:
        self._blank += text
        if self._content_sent or not _is_blank(self._blank):
            content.append(self._blank)
            self._blank = ""
            self._content_sent = True

    def _close_block(self, body: str, content: list[str], tool_calls: list[DeltaToolCall]) -> None:
        """Parse a block; if valid send its calls, else switch to PLAIN (buffer kept) or DONE."""
        self._in_block = False
        block = _hermes_block(body)
        if block is not None:
            self._mode = _Mode.CALLS
            self._blank = ""
            tool_calls += [delta for call in block for delta in self._call_deltas(call)]
        elif self._mode is _Mode.CONTENT:
            self._mode = _Mode.PLAIN
            content.append(self._blank)
            self._blank = ""
        else:
            self._mode = _Mode.DONE


# ---------------------------------------------------------------------------------------------------------
# Llama 3 JSON: <|python_tag|>{"name": ..., "parameters": {...}}; {"name": ..., "parameters": {...}}


class _Halt(enum.Enum):
    NOT_A_CALL = enum.auto()  # the text there is not a call, whatever follows
    INCOMPLETE = enum.auto()  # more text could complete a call


def _llama_call(text: str, pos: int, first: bool) -> tuple[FunctionCall, int] | _Halt:
    """The call at ``text[pos:]`` (after ``;`` unless it is the first) and where it ends, or why there is none."""
    pos = _skip_whitespace(text, pos)
    if not first:
        if pos == len(text):
            return _Halt.INCOMPLETE
        if text[pos] != ";":
            return _Halt.NOT_A_CALL
        pos = _skip_whitespace(text, pos + 1)
    if pos == len(text):
        return _Halt.INCOMPLETE
    if text[pos] != "{":
        return _Halt.NOT_A_CALL
    try:
        obj, end = _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):  # an object is complete only once its closing brace has come
        return _Halt.INCOMPLETE
    call = _function_call(obj, ("arguments", "parameters"))
    return _Halt.NOT_A_CALL if call is None else (call, end)


class Llama3JsonToolParser(ToolParser):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._mode = _Mode.CONTENT
        self._text = ""  # the output from where the next call may start; all of it until one is parsed
        self._pos: int | None = None  # where calls start in _text, once past the leading python tag

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        pos = _skip_whitespace(model_output, 0)
        if model_output.startswith(self.PYTHON_TAG, pos):
            pos += len(self.PYTHON_TAG)
        calls: list[ToolCall] = []
        while not isinstance(parsed := _llama_call(model_output, pos, not calls), _Halt):
            call, pos = parsed
            calls.append(ToolCall(call))
        return ExtractedToolCalls(calls, None if calls else model_output)

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage | None:
        if self._mode is _Mode.PLAIN:
            return _message([delta_text], [])
        if self._mode is _Mode.DONE:
            return None
        self._text += delta_text
        if self._pos is None:
            start = _skip_whitespace(self._text, 0)
            lead = self._text[start:]
            if len(lead) < len(self.PYTHON_TAG) and self.PYTHON_TAG.startswith(lead):
                return None  # blank so far, or the tag may still be coming
            self._pos = start + len(self.PYTHON_TAG) if lead.startswith(self.PYTHON_TAG) else start
        tool_calls: list[DeltaToolCall] = []
        while not isinstance(
            parsed := _llama_call(self._text, self._pos, self._mode is _Mode.CONTENT), _Halt
        ):
            call, end = parsed
            tool_calls += self._call_deltas(call)
            self._mode = _Mode.CALLS
            self._text, self._pos = self._text[end:], 0
        if parsed is _Halt.NOT_A_CALL:
            if self._mode is _Mode.CONTENT:
                self._mode = _Mode.PLAIN
                return _message([self._text], tool_calls)
            self._mode = _Mode.DONE
            self._text = ""
        return _message([], tool_calls)

    def finish(self) -> DeltaMessage | None:
        # Held text at the end is an incomplete call: the whole output if no call came before it, else dropped.
        content = [self._text] if self._mode is _Mode.CONTENT else []
        self._text = ""
        return _message(content, [])


# ---------------------------------------------------------------------------------------------------------
# Registry.

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,  # vLLM's name for Llama 4 with its JSON tool template
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class ``--tool-call-parser name`` selects."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; valid names: {', '.join(TOOL_PARSERS)}"
        ) from None
