"""Tool calls in chat answers: how one choice's text becomes ``tool_calls``, whole or streamed.

The request's tool choice decides (vLLM's rules): "none" answers text; "auto" lets the server's tool parser
(``--tool-call-parser``) find calls in the text; "required" constrained the output to a JSON list of
``{"name", "parameters"}`` calls, and a named function to that function's arguments
(``structured_requests.tool_call_schema``). A streamed answer and a whole one hold the same calls (names,
arguments, order) and the same content; ids are random.
"""

from __future__ import annotations

import dataclasses
import json

from jaxpaged.server import tool_parsers
from jaxpaged.server.request_models import ChatCompletionRequest
from jaxpaged.server.response_models import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ResponseFunctionCall,
    ResponseToolCall,
)
from jaxpaged.server.tool_parsers import ToolParser, make_tool_call_id


@dataclasses.dataclass(frozen=True)
class ToolAnswer:
    """A whole choice's message: its content and its tool calls."""

    content: str | None
    tool_calls: list[ResponseToolCall]


class ChoiceTools:
    """One choice's text turned into tool calls, for a request whose tool choice is not "none"."""

    def __init__(self, body: ChatCompletionRequest, parser: type[ToolParser] | None) -> None:
        self.mode = body.effective_tool_choice
        self._name = body.named_tool.function.name if self.mode == "named" else None
        self._parser = parser() if self.mode == "auto" else None
        self._held: list[str] = []  # "required": the JSON list, sent once whole
        self._call_id: str | None = None  # named: the one call's id, once its first piece is sent
        self._called = False

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """vLLM's: "tool_calls" when the parser found calls, or a required call ended normally."""
        if engine_reason is None:
            return None
        if self._called and (self.mode == "auto" or (self.mode == "required" and engine_reason == "stop")):
            return "tool_calls"
        return engine_reason

    def whole(self, text: str) -> ToolAnswer:
        if self.mode == "named":
            self._called = True
            return ToolAnswer(None, [_call(make_tool_call_id(), self._name, text)])
        if self.mode == "required":
            calls = _required_calls(text)
            self._called = calls is not None
            return (
                ToolAnswer(None, [_call(make_tool_call_id(), n, a) for n, a in calls])
                if calls
                else ToolAnswer(text, [])
            )
        found = self._parser.extract_tool_calls(text)
        self._called = found.tools_called
        return ToolAnswer(
            found.content,
            [
                ResponseToolCall(
                    id=c.id,
                    function=ResponseFunctionCall(name=c.function.name, arguments=c.function.arguments),
                )
                for c in found.tool_calls
            ],
        )

    def delta(self, text: str) -> DeltaMessage | None:
        """What a stream sends for the choice's next ``text``, or None."""
        if self.mode == "named":
            if not text and self._call_id is not None:
                return None
            first = self._call_id is None
            self._call_id = self._call_id or make_tool_call_id()
            self._called = True
            return DeltaMessage(
                tool_calls=[
                    DeltaToolCall(
                        index=0,
                        id=self._call_id if first else None,
                        type="function" if first else None,
                        function=DeltaFunctionCall(name=self._name if first else None, arguments=text),
                    )
                ]
            )
        if self.mode == "required":
            self._held.append(text)
            return None
        return _from_parser(self._parser.extract_tool_calls_streaming(text)) if text else None

    def finish(self) -> DeltaMessage | None:
        """What a stream sends at the choice's end, or None."""
        if self.mode == "named":
            return None
        if self.mode == "required":
            text = "".join(self._held)
            calls = _required_calls(text)
            if calls is None:
                return DeltaMessage(content=text) if text else None
            self._called = True
            pieces = []
            for i, (name, arguments) in enumerate(calls):
                pieces += [
                    DeltaToolCall(
                        index=i,
                        id=make_tool_call_id(),
                        type="function",
                        function=DeltaFunctionCall(name=name, arguments=""),
                    ),
                    DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=arguments)),
                ]
            return DeltaMessage(tool_calls=pieces)
        delta = _from_parser(self._parser.finish())
        self._called = self._parser.tools_called
        return delta


def _call(call_id: str, name: str, arguments: str) -> ResponseToolCall:
    return ResponseToolCall(id=call_id, function=ResponseFunctionCall(name=name, arguments=arguments))


def _required_calls(text: str) -> list[tuple[str, str]] | None:
    """``(name, arguments)`` of the calls a "required" output lists, or None when it is not such a list
    (generation cut short): then the text is the answer's content."""
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not (
        isinstance(calls, list)
        and calls
        and all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("parameters"), dict)
            for c in calls
        )
    ):
        return None
    return [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]


def _from_parser(delta: tool_parsers.DeltaMessage | None) -> DeltaMessage | None:
    if delta is None or (delta.content is None and not delta.tool_calls):
        return None
    return DeltaMessage(
        content=delta.content,
        tool_calls=[
            DeltaToolCall(
                index=c.index,
                id=c.id,
                type=c.type,
                function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments),
            )
            for c in delta.tool_calls
        ]
        or None,
    )
