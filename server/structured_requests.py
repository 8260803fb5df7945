"""The one structured-output constraint a request asks for, from whichever field names it.

OpenAI's ``response_format``, vLLM's ``structured_outputs`` and its older ``guided_*`` fields, and a chat
request's ``tool_choice`` ("required", or a named function: the output must be a valid call, as in
vLLM) each name a constraint; a request may use one of them, as the engine applies one grammar.
"""

from __future__ import annotations

import json
from typing import Any

from jaxpaged.param_errors import ParamError
from jaxpaged.server.errors import APIError
from jaxpaged.server.request_models import ChatCompletionRequest, SamplingRequest
from jaxpaged.structured_outputs_params import StructuredOutputsParams

ANY_OBJECT: dict[str, Any] = {"type": "object"}
"""The arguments of a function declared without ``parameters``."""


def structured_outputs_of(body: SamplingRequest) -> StructuredOutputsParams | None:
    """The request's constraint, or None; ``APIError`` (400) naming the field when one is invalid or
    when several fields each ask for one."""
    asked = _asked(body)
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise APIError(
            400,
            f"a request may constrain its output one way only; this one asks through {names}.",
            param=asked[1][0],
        )
    if not asked:
        return None
    name, fields = asked[0]
    try:
        return StructuredOutputsParams(**fields)
    except ParamError as e:
        raise APIError(400, str(e) if name == "structured_outputs" else f"{name}: {e}", param=name) from None


def constraint_field(body: SamplingRequest) -> str | None:
    """The request field its constraint comes from (to blame for a grammar the engine cannot compile)."""
    asked = _asked(body)
    return asked[0][0] if asked else None


def _asked(body: SamplingRequest) -> list[tuple[str, dict[str, Any]]]:
    """``(field, StructuredOutputsParams fields)`` of each request field that asks for a constraint."""
    asked: list[tuple[str, dict[str, Any]]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_
        asked.append(("response_format", {"json": schema} if schema is not None else {"json_object": True}))
    elif fmt is not None and fmt.type == "structural_tag":
        tag = json.dumps({"structures": fmt.structures, "triggers": fmt.triggers})
        asked.append(("response_format", {"structural_tag": tag}))
    if body.structured_outputs is not None:
        so = body.structured_outputs
        asked.append(
            (
                "structured_outputs",
                {
                    "json": so.json_,
                    "regex": so.regex,
                    "choice": so.choice,
                    "grammar": so.grammar,
                    "json_object": so.json_object,
                    "structural_tag": so.structural_tag,
                    "disable_any_whitespace": so.disable_any_whitespace,
                    "whitespace_pattern": so.whitespace_pattern,
                },
            )
        )
    for name, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(body, name)
        if value is not None:
            extra = {"whitespace_pattern": body.guided_whitespace_pattern} if kind == "json" else {}
            asked.append((name, {kind: value, **extra}))
    if isinstance(body, ChatCompletionRequest):
        tool_schema = tool_call_schema(body)
        if tool_schema is not None:
            asked.append(("tool_choice", {"json": tool_schema}))
    return asked


def tool_call_schema(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema a forced tool call's output follows: a named function's arguments, or, with
    "required", a list of ``{"name", "parameters"}`` calls of the declared functions (one unless
    ``parallel_tool_calls``); None when the model may answer freely."""
    choice = body.effective_tool_choice
    if choice == "named":
        return body.named_tool.function.parameters or ANY_OBJECT
    if choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters or ANY_OBJECT,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in body.tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return schema
