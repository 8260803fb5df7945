"""Tool-call parsers (server/tool_parsers.py): each format's rules on whole outputs, checked against the source
objects with json.loads, and streaming == non-streaming for random chunkings of every output."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpaged.server.tool_parsers import (
    DeltaFunctionCall,
    DeltaMessage,
    ExtractedToolCalls,
    HermesToolParser,
    Llama3JsonToolParser,
    ToolParser,
    get_tool_parser,
)

WEATHER = {"city": "Paris", "unit": "celsius"}
NESTED = {"query": 'café ☕ </b> "quoted"', "filters": [{"k": 1}, {"k": [1.5, None, True]}], "empty": {}}


@dataclass(frozen=True)
class Case:
    parser: str
    text: str
    calls: list[tuple[str, dict[str, Any]]]
    content: str | None


def call_json(name: str, args: dict[str, Any], key: str = "arguments", **dumps: Any) -> str:
    return json.dumps({"name": name, key: args}, **dumps)


CASES = {
    "hermes_single": Case(
        "hermes",
        f"<tool_call>\n{call_json('get_weather', WEATHER)}\n</tool_call>",
        [("get_weather", WEATHER)],
        None,
    ),
    "hermes_content_before": Case(
        "hermes",
        f"Let me check.\n\n<tool_call>\n{call_json('get_weather', WEATHER)}\n</tool_call>",
        [("get_weather", WEATHER)],
        "Let me check.\n\n",
    ),
    "hermes_blank_before": Case(
        "hermes", f" \n<tool_call>{call_json('f', {})}</tool_call>", [("f", {})], None
    ),
    "hermes_parallel": Case(
        "hermes",
        f"<tool_call>\n{call_json('get_weather', WEATHER)}\n</tool_call>\n"
        f"<tool_call>\n{call_json('search', NESTED, ensure_ascii=False, indent=2)}\n</tool_call>",
        [("get_weather", WEATHER), ("search", NESTED)],
        None,
    ),
    "hermes_text_between_and_after_dropped": Case(
        "hermes",
        f"A<tool_call>{call_json('a', {'x': 1})}</tool_call> and <tool_call>{call_json('b', {})}"
        "</tool_call> done",
        [("a", {"x": 1}), ("b", {})],
        "A",
    ),
    "hermes_unterminated_valid": Case(
        "hermes", f"<tool_call>\n{call_json('f', WEATHER)}\n", [("f", WEATHER)], None
    ),
    "hermes_smollm2_array": Case(
        "hermes",
        f"<tool_call>[\n{call_json('a', WEATHER)},\n{call_json('b', NESTED)}\n]</tool_call>",
        [("a", WEATHER), ("b", NESTED)],
        None,
    ),
    "hermes_empty_array": Case("hermes", "<tool_call>[]</tool_call>", [], None),
    "hermes_plain_text": Case(
        "hermes",
        "Just an answer, with <b>tags</b> and a < sign.",
        [],
        "Just an answer, with <b>tags</b> and a < sign.",
    ),
    "hermes_ends_with_partial_tag": Case("hermes", "Hi <tool_ca", [], "Hi <tool_ca"),
    "hermes_blank_only": Case("hermes", " \n ", [], " \n "),
    "hermes_malformed_json": Case(
        "hermes",
        'Sure <tool_call>{"name": "f", "arguments": {"a": 1}</tool_call> and <tool_call>'
        f"{call_json('g', {})}</tool_call>",
        [],
        'Sure <tool_call>{"name": "f", "arguments": {"a": 1}</tool_call> and <tool_call>'
        f"{call_json('g', {})}</tool_call>",
    ),
    "hermes_unterminated_malformed": Case(
        "hermes", '<tool_call>{"name": "f", "argu', [], '<tool_call>{"name": "f", "argu'
    ),
    "hermes_missing_arguments": Case(
        "hermes", '<tool_call>{"name": "f"}</tool_call>', [], '<tool_call>{"name": "f"}</tool_call>'
    ),
    "hermes_arguments_not_object": Case(
        "hermes",
        '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
        [],
        '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
    ),
    "hermes_nan_is_not_json": Case(
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        [],
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
    ),
    "hermes_lone_surrogate": Case(
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"x": "\\ud800"}}</tool_call>',
        [],
        '<tool_call>{"name": "f", "arguments": {"x": "\\ud800"}}</tool_call>',
    ),
    "hermes_malformed_after_valid_stops": Case(
        "hermes",
        f"<tool_call>{call_json('a', {})}</tool_call><tool_call>{{oops</tool_call>"
        f"<tool_call>{call_json('c', {})}</tool_call>",
        [("a", {})],
        None,
    ),
    "hermes_end_tag_in_argument": Case(
        "hermes",
        f"<tool_call>{call_json('f', {'s': '</tool_call>'})}</tool_call>",
        [],
        f"<tool_call>{call_json('f', {'s': '</tool_call>'})}</tool_call>",
    ),
    "llama_single": Case(
        "llama3_json", call_json("get_weather", WEATHER, "parameters"), [("get_weather", WEATHER)], None
    ),
    "llama_python_tag": Case(
        "llama3_json",
        "<|python_tag|>" + call_json("get_weather", WEATHER, "parameters"),
        [("get_weather", WEATHER)],
        None,
    ),
    "llama_arguments_key": Case(
        "llama3_json", " \n" + call_json("search", NESTED, ensure_ascii=False), [("search", NESTED)], None
    ),
    "llama_multiple": Case(
        "llama3_json",
        f"{call_json('a', WEATHER, 'parameters')}; {call_json('b', NESTED, 'parameters', indent=1)} ;\n"
        f"{call_json('c', {}, 'parameters')}",
        [("a", WEATHER), ("b", NESTED), ("c", {})],
        None,
    ),
    "llama_text_after_calls_dropped": Case(
        "llama3_json", call_json("a", {}, "parameters") + " hope that helps", [("a", {})], None
    ),
    "llama_calls_need_semicolons": Case(
        "llama3_json",
        call_json("a", {}, "parameters") + "\n" + call_json("b", {}, "parameters"),
        [("a", {})],
        None,
    ),
    "llama_malformed_after_valid_stops": Case(
        "llama3_json",
        f'{call_json("a", {}, "parameters")}; {{"name": 1}}; {call_json("c", {}, "parameters")}',
        [("a", {})],
        None,
    ),
    "llama_plain_text": Case(
        "llama3_json", "The weather is {sunny} today.", [], "The weather is {sunny} today."
    ),
    "llama_json_not_a_call": Case(
        "llama3_json", '{"answer": 42} is the result', [], '{"answer": 42} is the result'
    ),
    "llama_curly_prose": Case("llama3_json", "{curly} braces", [], "{curly} braces"),
    "llama_incomplete": Case(
        "llama3_json",
        '<|python_tag|>{"name": "f", "parameters": {"x": ',
        [],
        '<|python_tag|>{"name": "f", "parameters": {"x": ',
    ),
    "llama_tag_only": Case("llama3_json", "<|python_tag|>", [], "<|python_tag|>"),
    "llama_partial_tag": Case("llama3_json", "  <|python", [], "  <|python"),
    "llama_python_code": Case("llama3_json", "<|python_tag|>print(1)", [], "<|python_tag|>print(1)"),
}


@dataclass
class Streamed:
    content: str
    calls: list[tuple[str, str]]  # (name, concatenated argument fragments) per index


def stream(parser: ToolParser, chunks: list[str]) -> Streamed:
    """Feed ``chunks`` and finish, checking each delta's OpenAI shape; assemble what a client would."""
    deltas = [parser.extract_tool_calls_streaming(chunk) for chunk in chunks] + [parser.finish()]
    content = ""
    calls: list[list[str]] = []
    for delta in deltas:
        if delta is None:
            continue
        assert isinstance(delta, DeltaMessage) and (delta.content or delta.tool_calls)
        content += delta.content or ""
        for piece in delta.tool_calls:
            if piece.index == len(
                calls
            ):  # a new call: its header comes first, with the name and no arguments
                assert re.fullmatch(r"call_[0-9a-f]{24}", piece.id) and piece.type == "function"
                assert piece.function.name and piece.function.arguments == ""
                calls.append([piece.function.name, ""])
            else:
                assert piece.index == len(calls) - 1, "pieces of an earlier call after a later one began"
                assert piece.id is None and piece.type is None and piece.function.name is None
                calls[piece.index][1] += piece.function.arguments
    assert parser.tools_called == bool(calls)
    return Streamed(content, [(name, arguments) for name, arguments in calls])


def check_matches(
    result: ExtractedToolCalls, calls: list[tuple[str, dict[str, Any]]], content: str | None
) -> None:
    """``result`` holds exactly ``calls`` (arguments compared as parsed JSON) and ``content``."""
    assert [(call.function.name, json.loads(call.function.arguments)) for call in result.tool_calls] == calls
    assert all(
        call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id) for call in result.tool_calls
    )
    assert len({call.id for call in result.tool_calls}) == len(result.tool_calls)
    assert result.tools_called == bool(calls)
    assert result.content == content


def check_stream_equals(parser_name: str, text: str, cuts: list[int]) -> None:
    """Streaming ``text`` cut at ``cuts`` gives the non-streamed content and calls, but for the ids."""
    bounds = [0, *sorted(cuts), len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert "".join(chunks) == text
    parser_cls = get_tool_parser(parser_name)
    whole = parser_cls().extract_tool_calls(text)
    streamed = stream(parser_cls(), chunks)
    assert streamed.content == (whole.content or "")
    assert streamed.calls == [(call.function.name, call.function.arguments) for call in whole.tool_calls]


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_whole_output(case: Case) -> None:
    check_matches(get_tool_parser(case.parser)().extract_tool_calls(case.text), case.calls, case.content)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_stream_one_character_at_a_time(case: Case) -> None:
    check_stream_equals(case.parser, case.text, list(range(1, len(case.text))))


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stream_random_chunks(case: Case, data: st.DataObject) -> None:
    # Repeated cuts make empty chunks, which a detokenizer can produce too.
    check_stream_equals(
        case.parser, case.text, data.draw(st.lists(st.integers(0, len(case.text)), max_size=12))
    )


def test_arguments_are_json_dumps_without_ascii_escapes() -> None:
    body = json.dumps({"name": "f", "arguments": {"q": "café", "n": [1, 2]}}, indent=4)
    text = f"<tool_call>{body}</tool_call>"
    (call,) = HermesToolParser().extract_tool_calls(text).tool_calls
    assert call.function.arguments == '{"q": "café", "n": [1, 2]}'


def test_tags_split_across_chunks() -> None:
    parser = HermesToolParser()
    assert parser.extract_tool_calls_streaming("Hello ") == DeltaMessage("Hello ")
    assert parser.extract_tool_calls_streaming("wor") == DeltaMessage("wor")
    assert parser.extract_tool_calls_streaming("ld<tool") == DeltaMessage("ld")  # "<tool" may begin a tag
    assert parser.extract_tool_calls_streaming("_call>") is None
    assert parser.extract_tool_calls_streaming('{"name": "f", "arguments": {"a": 1}}</tool') is None
    assert not parser.tools_called
    delta = parser.extract_tool_calls_streaming("_call>")
    assert delta is not None and delta.content is None and parser.tools_called
    header, arguments = delta.tool_calls
    assert (header.index, header.type, header.function.name, header.function.arguments) == (
        0,
        "function",
        "f",
        "",
    )
    assert (arguments.index, arguments.id, arguments.function) == (
        0,
        None,
        DeltaFunctionCall(arguments='{"a": 1}'),
    )
    assert parser.finish() is None


def test_false_tag_start_becomes_content() -> None:
    parser = HermesToolParser()
    assert parser.extract_tool_calls_streaming("a <tool") == DeltaMessage("a ")
    assert parser.extract_tool_calls_streaming("box>") == DeltaMessage("<toolbox>")
    assert parser.extract_tool_calls_streaming("<") is None
    assert parser.finish() == DeltaMessage("<")


def test_blank_content_is_held_until_known() -> None:
    parser = HermesToolParser()
    assert parser.extract_tool_calls_streaming("\n") is None  # content None if a call follows
    assert parser.extract_tool_calls_streaming("\nOK") == DeltaMessage("\n\nOK")
    assert parser.extract_tool_calls_streaming("\n") == DeltaMessage(
        "\n"
    )  # once content began, all of it counts


def test_llama_streams_plain_text_at_once() -> None:
    parser = Llama3JsonToolParser()
    assert parser.extract_tool_calls_streaming(" ") is None
    assert parser.extract_tool_calls_streaming("<|py") is None
    assert parser.extract_tool_calls_streaming("thon") is None
    assert parser.extract_tool_calls_streaming("!") == DeltaMessage(" <|python!")
    assert parser.extract_tool_calls_streaming(" more") == DeltaMessage(" more")
    assert parser.finish() is None


def test_llama_sends_each_call_when_complete() -> None:
    parser = Llama3JsonToolParser()
    assert parser.extract_tool_calls_streaming('<|python_tag|>{"name": "a", "parameters": {"x": 1}') is None
    first = parser.extract_tool_calls_streaming('}; {"name": "b", ')
    assert first is not None and [piece.function.name for piece in first.tool_calls] == ["a", None]
    second = parser.extract_tool_calls_streaming('"parameters": {}}')
    assert second is not None and [
        (piece.index, piece.function.arguments) for piece in second.tool_calls
    ] == [(1, ""), (1, "{}")]


def test_registry() -> None:
    assert get_tool_parser("hermes") is HermesToolParser
    assert get_tool_parser("llama3_json") is Llama3JsonToolParser
    assert get_tool_parser("llama4_json") is Llama3JsonToolParser
    with pytest.raises(
        ValueError, match="unknown tool call parser 'mistral'; valid names: hermes, llama3_json"
    ):
        get_tool_parser("mistral")


# Generated outputs: random calls rendered in each format with random JSON layout, parsed back to the source.

NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,15}", fullmatch=True)
SCALARS = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
CALLS = st.lists(
    st.tuples(NAMES, st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4)), min_size=1, max_size=3
)
LAYOUTS = st.fixed_dictionaries({"ensure_ascii": st.booleans(), "indent": st.none() | st.integers(0, 2)})
SPACE = st.text(alphabet=" \n\t", max_size=2)


@settings(max_examples=150, deadline=None)
@given(
    calls=CALLS,
    content=st.text(max_size=20),
    layout=LAYOUTS,
    array=st.booleans(),
    space=SPACE,
    data=st.data(),
)
def test_hermes_generated(
    calls: list[tuple[str, dict[str, Any]]],
    content: str,
    layout: dict[str, Any],
    array: bool,
    space: str,
    data: st.DataObject,
) -> None:
    if array:  # SmolLM2: one block holding a JSON array of calls
        blocks = [json.dumps([{"name": name, "arguments": args} for name, args in calls], **layout)]
    else:
        blocks = [call_json(name, args, **layout) for name, args in calls]
    text = content + space.join(f"<tool_call>{space}{block}{space}</tool_call>" for block in blocks)
    check_matches(
        HermesToolParser().extract_tool_calls(text), calls, None if not content.strip() else content
    )
    check_stream_equals("hermes", text, data.draw(st.lists(st.integers(0, len(text)), max_size=20)))


@settings(max_examples=150, deadline=None)
@given(
    calls=CALLS,
    layout=LAYOUTS,
    tag=st.booleans(),
    key=st.sampled_from(["parameters", "arguments"]),
    space=SPACE,
    data=st.data(),
)
def test_llama_generated(
    calls: list[tuple[str, dict[str, Any]]],
    layout: dict[str, Any],
    tag: bool,
    key: str,
    space: str,
    data: st.DataObject,
) -> None:
    text = ("<|python_tag|>" if tag else "") + f"{space};{space}".join(
        call_json(name, args, key, **layout) for name, args in calls
    )
    check_matches(Llama3JsonToolParser().extract_tool_calls(text), calls, None)
    check_stream_equals("llama3_json", text, data.draw(st.lists(st.integers(0, len(text)), max_size=20)))


@settings(max_examples=200, deadline=None)
@given(
    parser=st.sampled_from(["hermes", "llama3_json"]),
    pieces=st.lists(
        st.sampled_from(
            [
                "<tool_call>",
                "</tool_call>",
                "<|python_tag|>",
                "{",
                "}",
                "[",
                "]",
                ";",
                " ",
                "\n",
                '"name"',
                ":",
                ",",
                '"f"',
                '"arguments"',
                '"parameters"',
                "{}",
                "1",
                "x",
                "<",
                "\\",
            ]
        ),
        max_size=30,
    ),
    data=st.data(),
)
def test_stream_equals_whole_on_arbitrary_text(parser: str, pieces: list[str], data: st.DataObject) -> None:
    # Fragments of the formats, shuffled: whatever the output, both paths agree.
    text = "".join(pieces)
    check_stream_equals(parser, text, data.draw(st.lists(st.integers(0, len(text)), max_size=20)))
