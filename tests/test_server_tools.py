"""Structured outputs and tool calls over HTTP, with the official ``openai`` client, on a tiny model: the
request fields that name a constraint (``response_format``, ``structured_outputs``, ``guided_*``) hold on every
sample; tool choices "required", named and "auto" (hermes parser) give calls that parse and validate, streamed
and not alike; tool messages render as transformers renders them."""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from jaxpaged import EngineArgs
from jaxpaged.async_engine import AsyncLLMEngine
from jaxpaged.server import build_app
from test_server import MODEL, engine, serve  # noqa: F401  (engine: the fixture)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# A tool-aware template (Hermes style, as Qwen2.5's): tools in the system turn, calls and results as tags.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    '<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def url(engine) -> Iterator[str]:
    """A server whose "auto" tool choice uses the hermes parser, with the tool-aware template."""
    with serve(build_app(engine, MODEL, chat_template=TOOL_TEMPLATE, tool_call_parser="hermes")) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def no_blanks(tiny) -> dict[str, int]:
    """``logit_bias`` keeping the random model from the whitespace JSON allows anywhere (it would loop there)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny[0])
    return {str(i): -100 for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip()}


def streamed_message(client, **kw) -> tuple[str | None, list[dict], str]:
    """A streamed chat answer put together from its deltas: (content, tool calls, finish reason); checks
    that each call's first piece holds its id, type and name and the later ones only arguments."""
    content, calls, finish = None, {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for piece in choice.delta.tool_calls or []:
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name, piece
                calls[piece.index] = {
                    "name": piece.function.name,
                    "arguments": piece.function.arguments or "",
                }
            else:
                assert piece.id is None and piece.function.name is None, piece
                calls[piece.index]["arguments"] += piece.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], finish


def whole_message(client, **kw) -> tuple[str | None, list[dict], str]:
    choice = client.chat.completions.create(**kw).choices[0]
    calls = [
        {"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls or []
    ]
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls or [])
    return choice.message.content or None, calls, choice.finish_reason


def check_weather_arguments(arguments: str) -> None:
    """The arguments hold the schema of ``WEATHER`` (checked here by hand, independently of the grammar)."""
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and len(args["city"]) <= 12
    assert args["unit"] in ("celsius", "fahrenheit")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_tool_choice_calls_a_declared_function(client, no_blanks, temperature):
    kw = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=temperature,
        seed=3,
        max_tokens=120,
        logit_bias=no_blanks,
    )
    whole, streamed = whole_message(client, **kw), streamed_message(client, **kw)
    assert whole == streamed
    content, calls, finish = whole
    assert content is None and finish == "tool_calls" and calls
    for call in calls:
        assert call["name"] in ("get_weather", "get_time")
        if call["name"] == "get_weather":
            check_weather_arguments(call["arguments"])
        else:
            zone = json.loads(call["arguments"])["zone"]
            assert isinstance(zone, int) and -12 <= zone <= 14


def test_named_tool_choice_and_parallel_tool_calls_off(client, no_blanks):
    named = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        temperature=1.0,
        seed=4,
        max_tokens=120,
        logit_bias=no_blanks,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    whole, streamed = whole_message(client, **named), streamed_message(client, **named)
    assert whole == streamed
    content, [call], finish = whole
    assert content is None and call["name"] == "get_weather" and finish == "stop"  # vLLM's finish reason
    check_weather_arguments(call["arguments"])
    single = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        n=4,
        temperature=1.0,
        seed=5,
        max_tokens=120,
        logit_bias=no_blanks,
    )
    assert all(len(c.message.tool_calls) == 1 for c in single.choices)


def test_auto_tool_choice_parses_hermes_calls(client):
    """The output forced (by a regex) to be a Hermes call and some text: the hermes parser returns the call
    and the text before it, streamed or not; with tool_choice "none" the same text is the content."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    kw = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        temperature=0.0,
        max_tokens=150,
        extra_body={"structured_outputs": {"regex": re.escape("Sure. " + call)}},
    )
    whole, streamed = whole_message(client, **kw), streamed_message(client, **kw)
    assert whole == streamed
    content, [parsed], finish = whole
    assert content == "Sure. " and finish == "tool_calls"
    assert parsed == {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}
    plain = whole_message(client, **{**kw, "tool_choice": "none"})
    assert plain == ("Sure. " + call, [], "stop")


def test_tool_messages_render_as_transformers_renders_them(client, url, tiny):
    """An assistant turn with tool calls (content null) and the tool's answer: the prompt's tokens equal
    transformers' rendering of the same conversation (arguments as objects) with the tools."""
    conversation = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    out = httpx.post(
        f"{url}/tokenize", json={"model": MODEL, "messages": conversation, "tools": TOOLS}
    ).json()
    reference = [dict(m) for m in conversation]
    reference[1] = {
        **reference[1],
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
            }
        ],
    }
    tokenizer = AutoTokenizer.from_pretrained(tiny[0])
    text = tokenizer.apply_chat_template(
        reference, tools=TOOLS, chat_template=TOOL_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"' in text
        and "Tools: get_weather" in text
    )
    assert out["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    answer = client.chat.completions.create(
        model=MODEL, messages=conversation, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert answer.usage.prompt_tokens == len(out["tokens"])


class City(BaseModel):
    name: str = Field(max_length=10)
    population: int = Field(ge=0, le=10**6)
    capital: bool


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_structured_output_fields_hold_on_every_sample(client, no_blanks, temperature):
    """Each field that names a constraint, on n=8 samples: every one holds (checked here by hand)."""

    def texts(**kw) -> list[str]:
        out = client.completions.create(
            model=MODEL,
            prompt="Answer:",
            n=8,
            temperature=temperature,
            seed=6,
            max_tokens=60,
            logit_bias=no_blanks,
            **kw,
        )
        assert all(c.finish_reason == "stop" for c in out.choices), [c.finish_reason for c in out.choices]
        return [c.text for c in out.choices]

    for text in texts(extra_body={"guided_regex": "[a-f]{3}-[0-9]{2}"}):
        assert re.fullmatch("[a-f]{3}-[0-9]{2}", text)
    for text in texts(extra_body={"guided_choice": ["yes", "no", "maybe"]}):
        assert text in ("yes", "no", "maybe")
    for text in texts(extra_body={"structured_outputs": {"choice": ["red", "green"]}}):
        assert text in ("red", "green")
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    for field in (
        {"guided_json": schema},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "r", "schema": schema, "strict": True},
            }
        },
    ):
        for text in texts(extra_body=field):
            value = json.loads(text)
            assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9


def test_openai_parse_with_a_pydantic_model(client, no_blanks):
    """``chat.completions.parse(response_format=PydanticModel)``: the client's own validation accepts the
    answer (its schema is sent strict: every field required, no others)."""
    done = client.chat.completions.parse(
        model=MODEL,
        messages=ASK,
        response_format=City,
        temperature=1.0,
        seed=7,
        max_tokens=80,
        logit_bias=no_blanks,
    )
    message = done.choices[0].message
    assert isinstance(message.parsed, City) and message.parsed == City.model_validate_json(message.content)


def test_invalid_constraint_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body={"guided_regex": "(a"})
    assert e.value.body["param"] == "guided_regex"
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


# ---- SmolLM2 ---------------------------------------------------------------------------------------------------


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    street: str = Field(max_length=40)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)
    height_m: float = Field(ge=0.5, le=2.5)
    favourite_color: Color
    nickname: str | None = Field(max_length=20)
    address: Address
    hobbies: list[str] = Field(min_length=1, max_length=3)


class Inventory(BaseModel):
    items: list[Address] = Field(max_length=2)
    total: int = Field(ge=0, le=1000)


@pytest.fixture(scope="module")
def smollm2_client() -> Iterator[openai.OpenAI]:
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(
            model="smollm2-135m-instruct", kv_cache_memory="96MiB", max_model_len=1024, precompile=False
        )
    )
    try:
        with serve(build_app(engine, "smollm2", tool_call_parser="hermes")) as base:
            yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_openai_parse_on_smollm2(smollm2_client, temperature):
    """``chat.completions.parse`` with Pydantic models (nested objects, arrays, an enum, bounded numbers, an
    optional field): the client's own validation accepts each answer."""
    for model, question in (
        (Person, "Describe a fictional person."),
        (City, "Describe Paris."),
        (Inventory, "List two addresses in a small inventory."),
    ):
        done = smollm2_client.chat.completions.parse(
            model="smollm2",
            messages=[{"role": "user", "content": question}],
            response_format=model,
            temperature=temperature,
            seed=11,
            max_tokens=400,
        )
        choice = done.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, model), (
            choice.message.content
        )


@pytest.mark.slow
def test_tools_regex_and_choice_on_smollm2(smollm2_client):
    kw = dict(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0.0, max_tokens=200
    )
    whole = whole_message(smollm2_client, **kw)
    assert whole == streamed_message(smollm2_client, **kw)
    content, calls, finish = whole
    assert content is None and finish == "tool_calls"
    assert calls[0]["name"] == "get_weather"  # the question asks for the weather
    check_weather_arguments(calls[0]["arguments"])
    out = smollm2_client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Give a date."}],
        n=8,
        temperature=1.0,
        seed=2,
        max_tokens=20,
        extra_body={"guided_regex": "20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"},
    )
    assert all(re.fullmatch("20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", c.message.content) for c in out.choices)
    out = smollm2_client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        n=8,
        temperature=1.0,
        seed=2,
        max_tokens=5,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert all(c.message.content in ("yes", "no") for c in out.choices)
