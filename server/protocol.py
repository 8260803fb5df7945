"""OpenAI API request and response bodies (pydantic), plus vLLM's extra sampling parameters.

Request models forbid unknown fields, as OpenAI does: a misspelt parameter is a 400, not
something silently ignored. Their types are strict, as OpenAI's schema is: an integer field takes
no bool, float or string (``"n": true``, ``"seed": 1.0``), a number field no bool or string, a bool
field only ``true``/``false`` (not ``"yes"``), and every string must be valid Unicode (a lone
surrogate such as ``"\\ud800"`` cannot be tokenized or sent back as UTF-8). Sampling parameters keep
vLLM's names, which are ``SamplingParams``' field names, so they are passed through by name and
validated there (ranges, float32 and int32 limits).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr,
                      model_serializer, model_validator)

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


_PASS_THROUGH = ("n", "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty",
                 "logit_bias", "best_of", "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens",
                 "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                 "spaces_between_special_tokens")
"""Request fields named as in ``SamplingParams`` and passed to it unchanged when set."""


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(RequestModel):
    include_usage: Bool = False


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
    seed: Int | None = Field(None, ge=-2**63, lt=2**63)
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
        None, description="Only requests with the same salt share prefix-cache blocks (vLLM's parameter).")
    priority: Int = Field(0, description="Lower runs sooner, with --scheduling-policy priority; else 0 "
                                         "(vLLM's parameter).")

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true.")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def to_sampling_params(self, defaults: Mapping[str, Any], **resolved) -> SamplingParams:
        """``SamplingParams`` from the fields the client set, the model's ``defaults`` (its generation config:
        ``GenerationDefaults.sampling``) for those it left unset or null, ``SamplingParams``' own for the rest,
        and ``resolved`` (values the endpoint derived, passed even when None); ``ValueError`` if invalid.
        A default ``max_tokens`` (the model's ``max_new_tokens``) also caps the endpoint's, as in vLLM."""
        kwargs = {name: value for name, value in defaults.items() if name in _PASS_THROUGH}
        kwargs.update({name: getattr(self, name) for name in _PASS_THROUGH
                       if name in self.model_fields_set and getattr(self, name) is not None})
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
    max_tokens: Int | None = Field(16, ge=1)
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Bool = False

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


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextContentPart]
    name: Text | None = None

    def to_template_dict(self) -> dict[str, str]:
        """The message as a chat template sees it (OpenAI's ``developer`` role is ``system``)."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    max_tokens: Int | None = Field(None, ge=1, description="Deprecated by OpenAI for max_completion_tokens.")
    logprobs: Bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: Bool = True

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true.")
        return self

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


class DetokenizeRequest(RequestModel):
    model: Text | None = None
    tokens: list[Int]


# ---- responses --------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """A whole completion, or (with ``usage`` null but in the last one) one streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler) -> dict:
        """A delta carries only what changed: ``{"role": ...}`` first, then ``{"content": ...}``."""
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "jaxpaged"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
