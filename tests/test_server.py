"""The OpenAI-compatible server, over real HTTP: a uvicorn server on 127.0.0.1 in a thread, a tiny
model, and the official ``openai`` client plus raw httpx for SSE framing and error bodies."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import random
import re
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn

from jaxpaged import EngineArgs, LLMEngine, SamplingParams
from jaxpaged.async_engine import AsyncLLMEngine, RequestStream
from jaxpaged.server import build_app
from test_async_engine import GatedEngine
from tiny_models import hf_greedy

# The same engine shape as tests/test_async_engine.py, so both reuse the same compiled programs.
ENGINE_ARGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=129)
MODEL = "tiny"
API_KEY = "sk-test-key"


@contextlib.contextmanager
def serve(app) -> Iterator[str]:
    """Run ``app`` with uvicorn on a free 127.0.0.1 port in a thread; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def engine(tiny):
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny[0]), **ENGINE_ARGS))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def url(engine) -> Iterator[str]:
    with serve(build_app(engine, MODEL)) as base:
        yield base


@pytest.fixture(scope="module")
def http(url) -> Iterator[httpx.Client]:
    """Raw HTTP; the long timeout covers requests that wait for a step shape to compile."""
    with httpx.Client(base_url=url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` as {series (name plus labels): value}."""
    text = httpx.get(f"{url}/metrics").text
    return {series: float(value) for series, value in re.findall(r"^(\S+) (\S+)$", text, re.M)}


def metric(url: str, name: str) -> float:
    return sum(v for k, v in metrics(url).items() if k == name or k.startswith(name + "{"))


def wait_until_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Poll ``/metrics`` until nothing runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        m = {k.split("{")[0]: v for k, v in metrics(url).items()}
        if (
            m["vllm:num_requests_running"] == 0
            and m["vllm:num_requests_waiting"] == 0
            and m["jaxpaged:kv_cache_free_blocks"] == m["jaxpaged:kv_cache_usable_blocks"]
        ):
            return m
        assert time.monotonic() < deadline, f"server not idle: {m}"
        time.sleep(0.05)


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE response, checking the framing on the way."""
    body = response.read().decode()
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    return [e.removeprefix("data: ") for e in events]


def test_models_health_tokenize(http, client, engine):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert http.get("/health").status_code == 200
    tokens = http.post("/tokenize", json={"prompt": "The quick brown fox"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == engine.max_model_len
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "The quick brown fox"
    assert http.post("/detokenize", json={"tokens": [5, 10**6]}).json()["error"]["param"] == "tokens"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_greedy_completion_matches_hf(client, tiny, engine):
    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    resp = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in resp.choices] == [0, 1]

    async def direct(i: int, prompt: list[int]):
        sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        async for out in await engine.add_request(engine.make_request(f"direct-{i}", prompt, sp)):
            pass
        return out.outputs[0]

    for i, (prompt, choice) in enumerate(zip(prompts, resp.choices)):
        expected = asyncio.run(direct(i, prompt))
        assert expected.token_ids == hf_greedy(tiny[1], prompt, 6)[0]
        assert choice.text == expected.text and choice.finish_reason == "length"
    assert (
        resp.usage.prompt_tokens == 7 and resp.usage.completion_tokens == 12 and resp.usage.total_tokens == 19
    )
    assert resp.object == "text_completion" and resp.model == MODEL and resp.id.startswith("cmpl-")


def test_prompt_forms_and_echo(client):
    kw = dict(model=MODEL, max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True})
    one = client.completions.create(prompt="The quick brown", **kw).choices[0].text
    many = client.completions.create(prompt=["Paged attention", "The quick brown"], **kw).choices
    assert many[1].text == one
    ids = client.completions.create(prompt="The quick brown", echo=True, **kw).choices[0].text
    assert ids == "The quick brown" + one


@pytest.mark.parametrize("stream_api", ["completions", "chat"])
def test_stream_equals_non_stream(client, stream_api):
    seeded = dict(model=MODEL, max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    if stream_api == "completions":
        full = client.completions.create(prompt="Paged attention splits", **seeded)
        chunks = list(
            client.completions.create(
                prompt="Paged attention splits", stream=True, stream_options={"include_usage": True}, **seeded
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        full_text = full.choices[0].text
    else:
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me a story."},
            {"role": "assistant", "content": "Once"},
            {"role": "user", "content": "Go on."},
        ]
        full = client.chat.completions.create(messages=messages, **seeded)
        chunks = list(
            client.chat.completions.create(
                messages=messages, stream=True, stream_options={"include_usage": True}, **seeded
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        full_text = full.choices[0].message.content
        assert full.choices[0].message.role == "assistant"
    assert text == full_text and len(full_text) > 0
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_n_samples_streamed_and_not(client, engine):
    kw = dict(model=MODEL, max_tokens=10, temperature=1.0, seed=7, n=3, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt=["Paged", "Blocks"], **kw)
    assert [c.index for c in full.choices] == list(range(6))  # prompt i, sample j -> 3 * i + j
    assert full.usage.completion_tokens == 60  # each prompt counted once:
    assert full.usage.prompt_tokens == sum(len(engine.tokenizer.encode(p)) for p in ["Paged", "Blocks"])
    streamed = ["" for _ in range(6)]
    for chunk in client.completions.create(prompt=["Paged", "Blocks"], stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in full.choices]
    assert len(set(streamed[:3])) > 1  # the samples of one prompt differ

    chat = dict(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=6, n=2, seed=3
    )
    full_chat = client.chat.completions.create(**chat)
    chunks = list(client.chat.completions.create(stream=True, **chat))
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    for j in range(2):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == j)
        assert text == full_chat.choices[j].message.content


def test_non_streamed_request_gets_only_its_final_output(client, monkeypatch):
    """The engine builds no per-step outputs for a non-streamed request (FINAL_ONLY), while a
    streamed one gets one per step."""
    puts: dict[str, int] = {}
    original = RequestStream._put

    def counting(stream, output):
        puts[stream.request_id] = puts.get(stream.request_id, 0) + 1
        original(stream, output)

    monkeypatch.setattr(RequestStream, "_put", counting)
    kw = dict(
        model=MODEL, prompt="Paged attention", max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**kw)
    assert full.usage.completion_tokens == 8
    assert list(puts.values()) == [1]
    puts.clear()
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert streamed == full.choices[0].text
    assert list(puts.values()) == [8]


def test_stop_string_streamed_and_not(client):
    kw = dict(
        model=MODEL,
        prompt="Paged attention",
        max_tokens=24,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    text = client.completions.create(**kw).choices[0].text
    stop = text[6:8]
    full = client.completions.create(stop=[stop], **kw).choices[0]
    assert full.text == text[: text.index(stop)]
    assert full.finish_reason == "stop" and full.stop_reason == stop
    streamed = list(client.completions.create(stop=[stop], stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == full.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs(client, tiny):
    prompt = [5, 6, 7, 8]
    hf_tokens, hf_logprobs, _ = hf_greedy(tiny[1], prompt, 6)
    kw = dict(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0.0, logprobs=2, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**kw).choices[0]
    lp = full.logprobs
    assert lp.token_logprobs == pytest.approx(hf_logprobs, abs=1e-3)
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(chosen)  # greedy: the best
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)]
    chunks = list(client.completions.create(stream=True, **kw))
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == lp.token_logprobs
    assert sum((c.choices[0].logprobs.tokens for c in chunks), []) == lp.tokens

    echo = client.completions.create(echo=True, **kw).choices[0]
    assert echo.logprobs.token_logprobs[0] is None and len(echo.logprobs.tokens) == len(prompt) + 6
    assert echo.logprobs.token_logprobs[len(prompt) :] == lp.token_logprobs
    assert echo.text.endswith(full.text)

    # Streamed with echo and two samples: each choice's pieces add up to the non-streamed choice
    # (the prompt's logprobs come once, with the engine's first delta, for every choice).
    sampled = dict(kw, n=2, temperature=1.0, seed=4, echo=True)
    whole = client.completions.create(**sampled).choices
    pieces = list(client.completions.create(stream=True, **sampled))
    assert len(whole) == 2
    for choice in whole:
        mine = [c.choices[0] for c in pieces if c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        for name in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
            assert sum((getattr(c.logprobs, name) for c in mine), []) == getattr(choice.logprobs, name)

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=5,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert len(chat.logprobs.content) == 5
    for entry in chat.logprobs.content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert entry.bytes == list(entry.token.encode())
    assert "".join(e.token for e in chat.logprobs.content).startswith(chat.message.content[:1])


def test_sse_framing(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all(set(c["choices"][0]["delta"]) <= {"content"} for c in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks)  # no usage unless asked for


@pytest.mark.parametrize("api", ["chat", "completion"])
def test_text_delta_events_are_the_bytes_pydantic_dumps(api):
    """A streamed text chunk is written from a template, not through pydantic: for texts of every
    kind of character JSON treats apart (ASCII controls, quotes, backslashes, U+2028, non-BMP, BOM),
    the event is byte for byte what dumping the chunk's models gives."""
    from jaxpaged.server.event_stream import TextDeltaEvents, sse
    from jaxpaged.server.response_models import (
        ChatChunkChoice,
        ChatCompletionChunk,
        CompletionChoice,
        CompletionResponse,
        DeltaMessage,
    )

    if api == "chat":

        def chunk(j, text):
            return ChatCompletionChunk(
                id="chatcmpl-1",
                created=7,
                model='m"x',
                choices=[ChatChunkChoice(index=j, delta=DeltaMessage(content=text))],
            )
    else:

        def chunk(j, text):
            return CompletionResponse(
                id="cmpl-1", created=7, model="m", choices=[CompletionChoice(index=j, text=text)]
            )

    events = TextDeltaEvents(chunk)
    rng = random.Random(0)
    alphabet = [
        chr(c) for c in [*range(0x80), 0xA0, 0xE9, 0x2028, 0x2029, 0x4E2D, 0xFEFF, 0xFFFD, 0x1F600, 0x10FFFF]
    ]
    for _ in range(3000):
        text = "".join(rng.choices(alphabet, k=rng.randint(1, 10)))
        j = rng.randrange(3)
        assert events.event(j, text) == sse(chunk(j, text)), repr(text)


def test_chat_uses_the_template(client, engine):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
    ]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3)
    as_text = [messages[0], {"role": "user", "content": "Hello there"}]
    assert resp.usage.prompt_tokens == len(engine.tokenizer.apply_chat_template(as_text))
    assert resp.usage.completion_tokens <= 3 and resp.object == "chat.completion"


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


BAD_REQUESTS = [
    # (endpoint, body, status, param, message pattern)
    ("completions", {"prompt": "x" * 600}, 400, "prompt", "max_model_len is 256"),
    ("completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", "greater than or equal to 0"),
    ("completions", {"prompt": "hi", "max_tokens": 300}, 400, "prompt", "lower max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature must be >= 0"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", r"top_p must be in \(0, 1\]"),
    (
        "completions",
        {"prompt": "hi", "repetition_penalty": 0},
        400,
        "repetition_penalty",
        "repetition_penalty",
    ),
    ("completions", {"prompt": "hi", "n": 1000}, 400, "n", "less than or equal to 128"),
    (
        "completions",
        {"prompt": "hi", "n": 3, "best_of": 2},
        400,
        "best_of",
        "best_of must be an integer >= n",
    ),
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias", r"\[-100, 100\]"),
    ("completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias", "valid integer"),
    ("completions", {"prompt": "hi", "stop_token_ids": [5000]}, 400, "stop_token_ids", r"\[0, 384\)"),
    ("completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens", "max_tokens=4"),
    ("completions", {"prompt": [5, 6, 384]}, 400, "prompt", r"token ids must be in \[0, 384\)"),
    ("completions", {"prompt": [[5, -1]]}, 400, "prompt", "token ids"),
    ("completions", {"prompt": []}, 400, "prompt", "must not be empty"),
    ("completions", {"prompt": ""}, 400, "prompt", "prompt is empty"),
    ("completions", {"prompt": 5}, 400, "prompt", "valid"),
    (
        "completions",
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        None,
        "only allowed when",
    ),
    ("completions", {"prompt": "hi", "suffix": "!"}, 400, "suffix", "not supported"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "only with echo"),
    (
        "completions",
        {"prompt": "hi", "guided_json": {}, "guided_regex": "a+"},
        400,
        "guided_regex",
        "one way only; this one asks through guided_json, guided_regex",
    ),
    (
        "completions",
        {"prompt": "hi", "response_format": {"type": "json_schema"}},
        400,
        "response_format",
        "json_schema is required",
    ),
    (
        "completions",
        {"prompt": "hi", "response_format": {"type": "xml"}},
        400,
        "response_format",
        "json_object",
    ),
    (
        "completions",
        {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}},
        400,
        "structured_outputs",
        "exactly one of",
    ),
    ("completions", {"prompt": "hi", "guided_choice": []}, 400, "guided_choice", "at least one string"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "does not exist"),
    ("completions", {}, 400, "prompt", "Field required"),
    ("chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", "role"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages",
        "",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3},
        400,
        None,
        "needs logprobs",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30},
        400,
        "top_logprobs",
        "less than or equal to 20",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
        400,
        None,
        "needs tools",
    ),
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        400,
        None,
        "'nope', which is not in tools \\('get_weather'\\)",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]},
        400,
        "tool_choice",
        "--enable-auto-tool-choice",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": None}]},
        400,
        "messages",
        "may be null only",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "functions": []},
        400,
        "functions",
        "not supported",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": 1}},
        400,
        "chat_template_kwargs",
        "may not set",
    ),
]


@pytest.mark.parametrize(
    "endpoint, body, status, param, message",
    BAD_REQUESTS,
    ids=[f"{e}-{'-'.join(map(str, b)) or 'empty'}"[:60] for e, b, *_ in BAD_REQUESTS],
)
def test_bad_request_gets_openai_error_and_server_keeps_serving(
    http, client, endpoint, body, status, param, message
):
    resp = http.post(f"/v1/{endpoint}", json=body)
    assert resp.status_code == status
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert re.search(message, error["message"]), error["message"]
    assert "Traceback" not in resp.text and "x" * 50 not in resp.text
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(
    "content, content_type",
    [
        (b'{"prompt": "hi",', "application/json"),
        (b"prompt=hi", "application/x-www-form-urlencoded"),
        (b"[1, 2]", "application/json"),
    ],
)
def test_malformed_body(http, client, content, content_type):
    resp = http.post("/v1/completions", content=content, headers={"content-type": content_type})
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_unknown_route_and_method(http):
    resp = http.get("/v1/nothing-here")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
    assert http.get("/v1/completions").status_code == 405
    assert http.get("/v1/models/gpt-4").status_code == 404


def test_api_key(engine):
    with serve(build_app(engine, MODEL, api_key=API_KEY)) as base:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}]:
            resp = httpx.post(f"{base}/v1/completions", json=body, headers=headers)
            assert resp.status_code == 401
            assert resp.json()["error"]["code"] == "invalid_api_key" and API_KEY not in resp.text
        assert httpx.post(f"{base}/tokenize", json={"prompt": "hi"}).status_code == 401
        # Authentication comes before validation: an anonymous client learns nothing about the body.
        assert httpx.post(f"{base}/v1/completions", json={"bogus": 1}).status_code == 401
        authed = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        assert authed.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
        assert [m.id for m in authed.models.list().data] == [MODEL]
        assert httpx.get(f"{base}/health").status_code == 200  # probes stay open
        assert httpx.get(f"{base}/metrics").status_code == 200


def test_request_logging(engine, client, caplog):
    secret = "my secret prompt text"
    with caplog.at_level(logging.INFO, logger="jaxpaged.server"):
        resp = client.completions.create(
            model=MODEL, prompt=secret, max_tokens=3, extra_body={"ignore_eos": True}
        )
        with serve(build_app(engine, MODEL, log_prompts=True)) as base:
            openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60).completions.create(
                model=MODEL, prompt=secret, max_tokens=3
            )
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxpaged.server"]
    mine = [line for line in lines if line.startswith(resp.id)]
    assert len(mine) == 1 and re.search(
        r"\d+ prompt tokens, 3 generated tokens, [\d.]+ s, finish=length", mine[0]
    )
    assert secret not in mine[0]
    assert sum(secret in line for line in lines) == 1  # only the --log-prompts server logs it


def test_disconnected_streams_free_everything(url):
    aborted = 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"}'
    before = metrics(url).get(aborted, 0.0)

    async def open_and_drop(client: httpx.AsyncClient, i: int) -> int:
        body = {
            "model": MODEL,
            "prompt": f"Stream number {i}",
            "max_tokens": 200,
            "stream": True,
            "ignore_eos": True,
        }
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            received = 0
            async for line in resp.aiter_lines():
                received += line.startswith("data: ")
                if received == 3:
                    return received  # leaving the block closes the connection mid-stream

    async def main():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=20)) as client:
            return await asyncio.gather(*(open_and_drop(client, i) for i in range(20)))

    assert asyncio.run(main()) == [3] * 20
    m = wait_until_idle(url)
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    assert metrics(url)[aborted] - before == 20


class SlowEngine(GatedEngine):
    """An open ``GatedEngine`` whose steps take at least 10 ms each, however fast the machine."""

    def step(self):
        time.sleep(0.01)
        return super().step()


def test_disconnected_non_streamed_request_is_aborted(tiny):
    """A fresh engine whose 240 steps take over 2.4 s, so the request cannot finish before the server
    sees the client leave (its read timeout of 50 ms); a bare tiny model's steps could."""
    engine = AsyncLLMEngine(
        SlowEngine(LLMEngine.from_engine_args(EngineArgs(model=str(tiny[0]), **ENGINE_ARGS)), open=True)
    )
    aborted = 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"}'
    body = {"model": MODEL, "prompt": "Long one", "max_tokens": 240, "ignore_eos": True}
    try:
        with serve(build_app(engine, MODEL)) as base:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{base}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.05))
            wait_until_idle(base)
            assert metrics(base).get(aborted, 0.0) == 1
    finally:
        engine.shutdown()


def test_overload_then_dead_engine_return_503(tiny):
    """A fresh engine whose steps the test holds (``GatedEngine``), so queue states are exact."""
    gated = GatedEngine(LLMEngine.from_engine_args(EngineArgs(model=str(tiny[0]), **ENGINE_ARGS)))
    engine = AsyncLLMEngine(gated, max_waiting_requests=2)
    body = {"model": MODEL, "prompt": "Hold on", "max_tokens": 8, "ignore_eos": True}

    async def overload(base: str) -> None:
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as first:
                assert first.status_code == 200  # admitted; the loop thread is stuck in its step
                others = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(2)]
                done, pending = await asyncio.wait(others, return_when=asyncio.FIRST_COMPLETED)
                refused = done.pop().result()  # 1 waiting + 1 queued = the limit of 2
                assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
                assert refused.json()["error"] == {
                    "message": refused.json()["error"]["message"],
                    "type": "server_error",
                    "param": None,
                    "code": "overloaded",
                }
                gated.gate.set()
                assert (await pending.pop()).status_code == 200
                assert (await first.aread()).endswith(b"data: [DONE]\n\n")

    try:
        with serve(build_app(engine, MODEL)) as base:
            asyncio.run(overload(base))
            assert httpx.get(f"{base}/health").status_code == 200
            gated.fail = RuntimeError("secret internal detail")
            with httpx.stream(
                "POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60
            ) as resp:
                events = sse_events(resp)
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == "engine_dead" and "secret" not in events[-2]
            resp = httpx.post(f"{base}/v1/completions", json=body)
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_dead"
            assert httpx.get(f"{base}/health").status_code == 503
            assert metric(base, "jaxpaged:engine_alive") == 0
    finally:
        gated.gate.set()
        engine.shutdown()


def test_load_200_requests_from_32_clients(url, http):
    """Mixed completions / chat, streamed or not: all complete, none lost or duplicated."""
    before = metric(url, "vllm:request_success_total")
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1",
        api_key="x",
        max_retries=0,
        timeout=120,
        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=32)),
    )
    latencies: list[float] = []

    async def one(i: int) -> tuple[int, str, int]:
        t0 = time.perf_counter()
        kw = dict(model=MODEL, max_tokens=8 + i % 17, seed=i, extra_body={"ignore_eos": True})
        if i % 4 == 0:
            r = await client.completions.create(prompt=f"Request {i}:", **kw)
            result = (r.choices[0].text, r.usage.completion_tokens, r.id)
        elif i % 4 == 1:
            r = await client.chat.completions.create(
                messages=[{"role": "user", "content": f"Request {i}"}], **kw
            )
            result = (r.choices[0].message.content, r.usage.completion_tokens, r.id)
        else:
            chunks = [
                c
                async for c in await client.completions.create(
                    prompt=f"Request {i}:", stream=True, stream_options={"include_usage": True}, **kw
                )
            ]
            result = (
                "".join(c.choices[0].text for c in chunks if c.choices),
                chunks[-1].usage.completion_tokens,
                chunks[0].id,
            )
        latencies.append(time.perf_counter() - t0)
        return (i, *result)

    async def main():
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(200):
            queue.put_nowait(i)
        results = []

        async def worker():
            while not queue.empty():
                results.append(await one(queue.get_nowait()))

        await asyncio.gather(*(worker() for _ in range(32)))
        await client.close()
        return results

    t0 = time.perf_counter()
    results = asyncio.run(main())
    elapsed = time.perf_counter() - t0
    assert sorted(r[0] for r in results) == list(range(200))
    assert len({r[3] for r in results}) == 200  # distinct response ids
    assert all(r[2] == 8 + r[0] % 17 for r in results)  # every token generated, ignore_eos
    generated = sum(r[2] for r in results)
    latencies.sort()
    print(
        f"\nload: 200 requests, 32 clients, {elapsed:.1f} s, {200 / elapsed:.1f} req/s, "
        f"{generated / elapsed:.0f} generated tok/s, latency p50 {latencies[100]:.2f} s, "
        f"p99 {latencies[197]:.2f} s"
    )
    assert elapsed < 60
    wait_until_idle(url)
    assert metric(url, "vllm:request_success_total") - before == 200
    assert http.get("/health").status_code == 200


def test_serve_freezes_what_it_loaded_out_of_the_garbage_collector(tiny, monkeypatch):
    """``jaxpaged serve`` starts uvicorn with everything loaded so far (JAX, the model, the app) frozen out
    of the cyclic garbage collector's generations: a full collection while serving then walks only what
    serving allocated, not half a million objects (~0.3 s, a stall of every stream)."""
    from jaxpaged.cli import main

    seen = {}

    def fake_run(server):
        seen.update(
            app=server.config.app,
            host=server.config.host,
            port=server.config.port,
            frozen=gc.get_freeze_count(),
            collectable=len(gc.get_objects()),
        )

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_ARGS.items()]
    try:
        assert main(["serve", "--model", str(tiny[0]), "--host", "127.0.0.1", "--port", "8123", *flags]) == 0
    finally:
        gc.unfreeze()
    assert (seen["host"], seen["port"]) == ("127.0.0.1", 8123) and seen["app"].title
    assert seen["frozen"] > 20 * seen["collectable"], {k: seen[k] for k in ("frozen", "collectable")}
