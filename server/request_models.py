"""OpenAI API request bodies (pydantic), plus vLLM's extra sampling parameters.

Request models accept unknown fields, at any depth, and ignore them (vLLM's rule: clients such as
guidellm and lm-eval send fields of their own); the app logs their names (``ignored_fields``). Fields
of OpenAI's or vLLM's API that this server does not implement (``suffix``, the deprecated ``functions``)
are refused with a 400 saying so, as ignoring them would answer something else than what was asked. Their types are strict, as OpenAI's schema is: an integer field takes
no bool, float or string (``"n": true``, ``"seed": 1.0``), a number field no bool or string, a bool
field only ``true``/``false`` (not ``"yes"``), and every string must be valid Unicode (a lone
surrogate such as ``"\\ud800"`` cannot be tokenized or sent back as UTF-8). Sampling parameters keep
vLLM's names, which are ``SamplingParams``' field names, so they are passed through by name and
validated there (ranges, float32 and int32 limits).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    model_validator,
)

from jaxpaged.sampling_params import RequestOutputKind, SamplingParams, is_unicode

MAX_N = 128
"""OpenAI's own limit on ``n`` (also applied to ``best_of``)."""
MAX_LOGPROBS = 20
"""OpenAI's limit on ``top_logprobs`` (also applied to the completions API's ``logprobs``)."""


def _unicode(text: str) -> str:
    if not is_unicode(text):
        raise ValueError("must be valid Unicode text (it holds a lone surrogate); send UTF-8 text")
    return text


Text = Annotated[StrictStr, AfterValidator(_unicode)]
"""A JSON string encodable as UTF-8."""
Number = Annotated[float, Strict()]
"""A JSON number (an integer or not), not a bool or a string."""
Int = StrictInt
"""A JSON integer, not a bool, a float (``1.0``) or a string."""
Bool = StrictBool
"""``true`` or ``false``, not ``1`` or ``"yes"``."""


def _refuse(value: Any, info: ValidationInfo) -> None:
    """Any value but null: this server does not implement the field, and ignoring it would answer another request."""
    raise ValueError(f"{info.field_name} is not supported by this server; leave it out.")


Unsupported = Annotated[Any, AfterValidator(_refuse)] | None
"""A known field this server does not implement: null or absent, else a 400."""


_PASS_THROUGH = (
    "n",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "best_of",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)
"""Request fields named as in ``SamplingParams`` and passed to it unchanged when set."""


class RequestModel(BaseModel):
    """A request body, or part of one, that keeps unknown fields aside (``model_extra``) to be reported."""

    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> set[str]:
        """The dotted names of the fields sent that no model declares, at any depth, a list's items as
        ``[]`` (``messages[].type``): they are ignored, and vLLM logs them."""
        names = set(self.model_extra or {})
        for name in self.model_fields_set:
            for path, inner in _nested_models(getattr(self, name), name):
                names |= {f"{path}.{field}" for field in inner.ignored_fields()}
        return names


def _nested_models(value: Any, path: str) -> Iterator[tuple[str, RequestModel]]:
    """The request models within a field's value, with their paths."""
    if isinstance(value, RequestModel):
        yield path, value
    elif isinstance(value, list):
        for item in value:
            yield from _nested_models(item, f"{path}[]")


class StreamOptions(RequestModel):
    include_usage: Bool = False
    continuous_usage_stats: Bool = Field(
        False, description="With include_usage, usage on every chunk (vLLM's)."
    )


class JSONSchemaFormat(RequestModel):
    """OpenAI's ``response_format.json_schema``: the schema (``schema``) and its name."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: Text = "response"
    description: Text | None = None
    schema_: dict[Text, Any] | None = Field(None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema``; vLLM's ``structural_tag`` (``structures`` and ``triggers`` as in
    ``StructuredOutputsParams.structural_tag``)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JSONSchemaFormat | None = None
    structures: list[dict[Text, Any]] | None = None
    triggers: list[Text] | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(
                'response_format.json_schema is required with type "json_schema", and only with it.'
            )
        if (self.type == "structural_tag") != (self.structures is not None and self.triggers is not None):
            raise ValueError(
                'response_format.structures and .triggers are required with type "structural_tag", '
                "and only with it."
            )
        return self


class StructuredOutputsRequest(RequestModel):
    """vLLM's ``structured_outputs`` request field: ``StructuredOutputsParams``' fields, checked there."""

    json_: Text | dict[Text, Any] | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: Bool | None = None
    structural_tag: Text | None = None
    disable_any_whitespace: Bool = False
    whitespace_pattern: Text | None = None

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class SamplingRequest(RequestModel):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model: Text | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # Sampling, OpenAI's:
    n: Int = Field(1, ge=1, le=MAX_N)
    temperature: Number | None = None
    top_p: Number | None = None
    seed: Int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: Text | list[Text] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[int, Number] | None = None
    # vLLM's extras:
    best_of: Int | None = Field(None, ge=1, le=MAX_N)
    top_k: Int | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    ignore_eos: Bool | None = None
    min_tokens: Int | None = None
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: Bool | None = None
    skip_special_tokens: Bool | None = None
    spaces_between_special_tokens: Bool | None = None
    cache_salt: Annotated[StrictStr, Field(min_length=1), AfterValidator(_unicode)] | None = Field(
        None, description="Only requests with the same salt share prefix-cache blocks (vLLM's parameter)."
    )
    priority: Int = Field(
        0, description="Lower runs sooner, with --scheduling-policy priority; else 0 (vLLM's parameter)."
    )
    # Structured outputs (``server.structured_requests`` turns them into one ``StructuredOutputsParams``):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: Text | dict[Text, Any] | None = Field(
        None, description="vLLM's older name of structured_outputs.json."
    )
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_whitespace_pattern: Text | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true.")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def usage_on_every_chunk(self) -> bool:
        """vLLM's ``continuous_usage_stats``: only together with ``include_usage``."""
        return self.include_usage_in_stream and self.stream_options.continuous_usage_stats

    def to_sampling_params(self, defaults: Mapping[str, Any], **resolved) -> SamplingParams:
        """``SamplingParams`` from the fields the client set, the model's ``defaults`` (its generation config:
        ``GenerationDefaults.sampling``) for those it left unset or null, ``SamplingParams``' own for the rest,
        and ``resolved`` (values the endpoint derived, passed even when None); ``ValueError`` if invalid.
        A default ``max_tokens`` (the model's ``max_new_tokens``) also caps the endpoint's, as in vLLM."""
        kwargs = {name: value for name, value in defaults.items() if name in _PASS_THROUGH}
        kwargs.update(
            {
                name: getattr(self, name)
                for name in _PASS_THROUGH
                if name in self.model_fields_set and getattr(self, name) is not None
            }
        )
        limit = defaults.get("max_tokens")
        if limit is not None:
            requested = resolved.get("max_tokens")
            resolved["max_tokens"] = limit if requested is None else min(requested, limit)
        # A non-streamed response reads only the final output, so the engine builds none per step;
        # a streamed one reads only what is new, so the engine copies nothing old (as vLLM).
        kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        return SamplingParams(**kwargs, output_kind=kind, **resolved)


class CompletionRequest(SamplingRequest):
    prompt: Text | list[Text] | list[Int] | list[list[Int]]
    max_tokens: Int | None = Field(
        16, ge=0, description="0 only with echo: score the prompt, generate nothing."
    )
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Bool = False
    suffix: Unsupported = None

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the answer is the prompt and its logprobs (OpenAI's and vLLM's rule)."""
        return self.echo and self.max_tokens == 0

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (a string, or token ids, each)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: Text


class FunctionCall(RequestModel):
    name: Text
    arguments: Text = Field(description="The call's arguments: a JSON object, as text.")


class ToolCall(RequestModel):
    """A tool call an assistant message made earlier in the conversation."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = Field(None, description="In a tool message: the call it answers.")

    @model_validator(mode="after")
    def _content_or_tool_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only in an assistant message with tool_calls.")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages hold tool_calls.")
        return self

    def to_template_dict(self) -> dict[str, Any]:
        """The message as a chat template sees it (OpenAI's ``developer`` role is ``system``); a tool call's
        arguments as a dict (templates write them as JSON themselves, as vLLM passes them)."""
        content = (
            self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        )
        # Null content (an assistant message that only calls tools) is "" to the template: simple templates
        # concatenate it, tool-aware ones test it.
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": content or "",
        }
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": _json_arguments(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        return message


def _json_arguments(arguments: str) -> Any:
    """A tool call's arguments, parsed (a template cannot iterate a string); kept as text if not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class FunctionDefinition(RequestModel):
    name: Annotated[StrictStr, Field(min_length=1), AfterValidator(_unicode)]
    description: Text | None = None
    parameters: dict[Text, Any] | None = Field(None, description="The arguments' JSON schema.")
    strict: Bool | None = None


class Tool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: Text


class NamedToolChoice(RequestModel):
    """``tool_choice`` naming the one function the model must call."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    max_tokens: Int | None = Field(None, ge=1, description="Deprecated by OpenAI for max_completion_tokens.")
    logprobs: Bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: Bool = True
    chat_template_kwargs: dict[Text, Any] | None = Field(
        None, description="Extra chat template variables (vLLM's)."
    )
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='Default: "auto" with tools, else "none".'
    )
    parallel_tool_calls: Bool = True
    functions: Unsupported = None
    function_call: Unsupported = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true.")
        return self

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatCompletionRequest:
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError(
                f"tool_choice {self.tool_choice if isinstance(self.tool_choice, str) else 'naming a function'}"
                " needs tools."
            )
        if isinstance(self.tool_choice, NamedToolChoice) and self.named_tool is None:
            raise ValueError(
                f"tool_choice names the function {self.tool_choice.function.name!r}, which is not in "
                f"tools ({', '.join(repr(t.function.name) for t in self.tools)})."
            )
        return self

    @property
    def effective_tool_choice(self) -> str:
        """ "none", "auto", "required" or "named": OpenAI's default is "auto" when tools are given."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def named_tool(self) -> Tool | None:
        """The tool ``tool_choice`` names, if it names one that ``tools`` holds."""
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        return next((t for t in self.tools or () if t.function.name == self.tool_choice.function.name), None)

    @property
    def num_logprobs(self) -> int | None:
        """``SamplingParams.logprobs``: how many top alternatives per token (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeCompletionRequest(RequestModel):
    model: Text | None = None
    prompt: Text
    add_special_tokens: Bool = True


class TokenizeChatRequest(RequestModel):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: Bool = True
    chat_template_kwargs: dict[Text, Any] | None = None
    tools: list[Tool] | None = None


class DetokenizeRequest(RequestModel):
    model: Text | None = None
    tokens: list[Int]
