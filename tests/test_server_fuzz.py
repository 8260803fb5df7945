"""Hostile JSON at every field of the server's endpoints (issue 52): whatever a request holds, the
answer is a 2xx or a 4xx in OpenAI's error shape, never a 5xx, and afterwards the engine serves an
ordinary greedy request exactly as before. Deterministic (``derandomize``) and bounded for CI."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpaged import EngineArgs
from jaxpaged.async_engine import AsyncLLMEngine
from jaxpaged.server import build_app
from jaxpaged.server.request_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    StreamOptions,
    TokenizeCompletionRequest,
)
from test_server import ENGINE_ARGS, MODEL, serve, wait_until_idle

GREEDY = {
    "model": MODEL,
    "prompt": "The quick brown fox",
    "max_tokens": 8,
    "temperature": 0,
    "ignore_eos": True,
}

NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 1099511627776, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e39, -1e39, -0.0, 1e-45, 5e-324, 1e308, 3.4028235e38, 1.0, 0.5, 2.0, 100.5]),
)
TEXT = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(exclude_categories=()), max_size=6),  # lone surrogates included
    st.sampled_from(
        ["", "\ud800", "a\udfffb", "\x00", "hi", "tiny", "user", "assistant", "text", "5", "true"]
    ),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
HOSTILE = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=10,
)


def values_for(annotation: object) -> st.SearchStrategy:
    """Anything, or (as often) a value of the field's JSON type, edge values included: requests get
    past type checks to the range checks, and some generate."""
    kind = repr(annotation)
    typed = (
        st.booleans()
        if "bool" in kind
        else st.one_of(st.floats(-3, 3), NUMBERS)
        if "float" in kind
        else st.one_of(st.integers(-2, 10), NUMBERS)
        if "int" in kind
        else TEXT
        if "str" in kind
        else HOSTILE
    )
    return st.one_of(HOSTILE, typed)


ENDPOINTS = {
    # path: (a valid body, the request model whose fields are set, nested fields as (outer key, model))
    "/v1/completions": ({"prompt": "hi", "max_tokens": 2}, CompletionRequest, ()),
    "/v1/chat/completions": (
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ChatCompletionRequest,
        (("messages", ChatMessage), ("stream_options", StreamOptions)),
    ),
    "/tokenize": ({"prompt": "hi"}, TokenizeCompletionRequest, ()),
    "/detokenize": ({"tokens": [5, 6]}, DetokenizeRequest, ()),
}


@st.composite
def requests(draw) -> tuple[str, dict]:
    """An endpoint and a body: a valid one with 1 to 3 fields (known, nested or unknown) set to anything."""
    path = draw(
        st.sampled_from(["/v1/completions", "/v1/chat/completions"] * 3 + ["/tokenize", "/detokenize"])
    )
    base, model, nested = ENDPOINTS[path]
    body = json.loads(json.dumps(base))
    kinds = ["field"] * 4 + ["nested"] * bool(nested) + ["unknown"]
    # Nested fields first, while ``messages`` is still the valid one.
    for where in sorted(
        draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=3)), key=lambda w: w != "nested"
    ):
        if where == "nested":
            key, inner = draw(st.sampled_from(nested))
            target = body["messages"][0] if key == "messages" else body.setdefault(key, {})
            name = draw(st.sampled_from(sorted(inner.model_fields)))
            target[name] = draw(values_for(inner.model_fields[name].annotation))
        elif where == "field":
            name = draw(st.sampled_from(sorted(model.model_fields)))
            body[name] = draw(values_for(model.model_fields[name].annotation))
        else:
            body[draw(TEXT)] = draw(HOSTILE)
    if "stream_options" in body and draw(st.booleans()):
        body["stream"] = True  # reach past the "stream_options needs stream" check
    return path, body


@pytest.fixture(scope="module")
def url(tiny) -> Iterator[str]:
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny[0]), **ENGINE_ARGS))
    try:
        with serve(build_app(engine, MODEL)) as base:
            yield base
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def http(url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=60) as c:
        yield c


def check(resp: httpx.Response) -> None:
    """A 2xx with a whole answer, or a 4xx in OpenAI's error shape; never a 5xx."""
    assert resp.status_code < 500, resp.text[:500]
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and len(error["message"]) < 2000
    elif resp.headers["content-type"].startswith("text/event-stream"):
        events = resp.text.strip().split("\n\n")
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events), resp.text[-500:]
    else:
        resp.json()


def test_hostile_json_never_gets_a_5xx_nor_changes_the_engine(http, url):
    greedy_text = http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]

    @settings(
        max_examples=300,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=requests())
    def one(case: tuple[str, dict]) -> None:
        path, body = case
        check(http.post(path, content=json.dumps(body), headers={"content-type": "application/json"}))

    one()
    wait_until_idle(url)  # nothing left running, every KV block free
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"] == greedy_text
