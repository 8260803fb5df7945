"""What the clients people point at a vLLM server send, sent to this one over a tiny model: each body is
copied from the client's own request code (the file is named above it). Unknown fields are served and
named in one warning; prompt scoring (lm-eval's loglikelihood) is right whatever the prefix cache holds;
vLLM's small endpoints (``/tokenizer_info``, ``/version``, ``/ping``)."""

from __future__ import annotations

import importlib.metadata
import json
import logging

import httpx
import openai
import pytest
import torch

from jaxpaged.server import build_app
from test_server import MODEL, engine, http, serve, sse_events, url  # noqa: F401  (engine, http, url: the fixtures)

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


def ignored_warning(caplog) -> str:
    """The one warning naming ignored fields that the last request logged."""
    lines = [r.getMessage() for r in caplog.records if "present in the request but ignored" in r.getMessage()]
    assert len(lines) == 1, lines
    return lines[0]


CLIENT_BODIES = [
    # guidellm, src/guidellm/backends/openai/request_handlers.py (vllm-project/guidellm),
    # TextCompletionsRequestHandler.format: streamed, usage on every chunk, a fixed output length (stop null,
    # ignore_eos); its chat handler sends the prompt as content parts {"type": "text", "text": ...}.
    (
        "guidellm-completions",
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "The quick brown fox",
            "max_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "stop": None,
            "ignore_eos": True,
        },
        set(),
    ),
    (
        "guidellm-chat",
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}],
            "max_tokens": 8,
            "max_completion_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "ignore_eos": True,
        },
        set(),
    ),
    # lm-eval, lm_eval/models/openai_completions.py (EleutherAI/lm-evaluation-harness),
    # LocalCompletionsAPI._create_payload(generate=True): gen_kwargs' leftovers pass through.
    (
        "lm-eval-local-completions",
        "/v1/completions",
        {
            "prompt": ["Question: 2+2?\nAnswer:"],
            "model": MODEL,
            "max_tokens": 8,
            "temperature": 0,
            "stop": ["\n\n", "Question:"],
            "seed": 1234,
            "top_p": 1.0,
        },
        set(),
    ),
    # lm-eval, the same file, LocalChatCompletion._create_payload; with --apply_chat_template its
    # messages carry "type": "text" (lm_eval/models/api_models.py, JsonChatStr -> messages).
    (
        "lm-eval-local-chat-completions",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Question: 2+2?\nAnswer:", "type": "text"}],
            "model": MODEL,
            "max_tokens": 8,
            "temperature": 0,
            "stop": ["<|endoftext|>"],
            "seed": 1234,
        },
        {"messages[].type"},
    ),
    # LangChain's ChatOpenAI with stream_usage on: the body's shape (OpenAI's chat fields and stream_options),
    # written here, not read from langchain_openai's source.
    (
        "langchain-chat-openai",
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "model": MODEL,
            "stream": True,
            "n": 1,
            "temperature": 0.7,
            "max_tokens": 8,
            "stream_options": {"include_usage": True},
        },
        set(),
    ),
    # LiteLLM's hosted_vllm provider: OpenAI's body plus what a caller passes through (metadata, store, user,
    # vLLM's chat_template_kwargs): the body's shape, written here, not read from litellm's source.
    (
        "litellm-hosted-vllm",
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": CHAT,
            "max_tokens": 8,
            "temperature": 0.2,
            "stream": False,
            "store": False,
            "metadata": {"trace": "x"},
            "user": "u1",
            "chat_template_kwargs": {"enable_thinking": False},
        },
        {"store", "metadata"},
    ),
]


@pytest.mark.parametrize(
    "path, body, ignored", [c[1:] for c in CLIENT_BODIES], ids=[c[0] for c in CLIENT_BODIES]
)
def test_client_bodies_are_served(http, caplog, path, body, ignored):
    with caplog.at_level(logging.WARNING, logger="jaxpaged.server"):
        resp = http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    if body.get("stream"):
        events = sse_events(resp)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] > 0
        text = "".join(
            c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
            for c in chunks
            if c["choices"]
        )
    else:
        choice = resp.json()["choices"][0]
        text = choice.get("text", choice.get("message", {}).get("content"))
        assert resp.json()["usage"]["completion_tokens"] > 0
    assert isinstance(text, str)
    if ignored:
        message = ignored_warning(caplog)
        assert all(name in message for name in ignored), message
    else:
        assert "present in the request but ignored" not in caplog.text


def test_unknown_fields_at_every_depth_are_named_in_one_warning(http, caplog):
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}], "type": "text"}
        ],
        "max_tokens": 2,
        "frobnicate": 1,
        "stream": True,
        "stream_options": {"include_usage": True, "zz": 1},
    }
    with caplog.at_level(logging.WARNING, logger="jaxpaged.server"):
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    message = ignored_warning(caplog)
    for name in ("frobnicate", "messages[].type", "messages[].content[].cache_control", "stream_options.zz"):
        assert name in message, message


def test_continuous_usage_stats_puts_usage_on_every_chunk(http):
    for path, prompt in (
        ("/v1/completions", {"prompt": "Once upon"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        body = {
            **prompt,
            "max_tokens": 6,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        chunks = [json.loads(e) for e in sse_events(http.post(path, json=body))[:-1]]
        usages = [c["usage"] for c in chunks]
        assert all(u is not None for u in usages), chunks
        counts = [u["completion_tokens"] for u in usages]
        assert counts == sorted(counts) and counts[-1] == 6
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)


def test_openai_client_extra_body_is_served(url, caplog):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    with caplog.at_level(logging.WARNING, logger="jaxpaged.server"):
        resp = client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_completion_tokens=4,
            temperature=0.0,
            store=False,
            metadata={"run": "1"},
            extra_body={
                "top_k": 0,
                "ignore_eos": True,
                "mystery": 1,
                "chat_template_kwargs": {"enable_thinking": False},
            },
        )
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 4
    assert all(name in ignored_warning(caplog) for name in ("store", "metadata", "mystery"))


def test_chat_template_kwargs_reach_the_template(engine, http):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ greeting | default('') }}"
    with serve(build_app(engine, MODEL, chat_template=template)) as base:

        def tokens(**extra) -> list[int]:
            return httpx.post(
                f"{base}/tokenize",
                json={"messages": [{"role": "user", "content": "hi"}], **extra},
                timeout=60,
            ).json()["tokens"]

        assert tokens(chat_template_kwargs={"greeting": " there"}) == engine.tokenizer.encode(
            "hi there", False
        )
        assert tokens() == engine.tokenizer.encode("hi", False)


def hf_prompt_logprobs(model, ids: list[int]) -> list[float]:
    """The independent reference: transformers' log-softmax of each prompt token given those before it."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_lm_eval_loglikelihood_twice_with_the_prefix_cache(http, tiny):
    # lm_eval/models/openai_completions.py, LocalCompletionsAPI._create_payload(generate=False).
    ids = [(7 * i + 3) % 300 + 20 for i in range(40)]
    body = {
        "model": MODEL,
        "prompt": [ids],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    answers = [http.post("/v1/completions", json=body) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200], answers[-1].text
    first, second = (a.json()["choices"][0]["logprobs"]["token_logprobs"] for a in answers)
    assert first == second and len(first) == len(ids) + 1 and first[0] is None
    assert first[1 : len(ids)] == pytest.approx(hf_prompt_logprobs(tiny[1], ids), abs=1e-3)


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_with_echo_scores_the_prompt_only(http, engine, tiny, stream):
    ids = [11, 42, 77, 5, 93, 120]
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0, "stream": stream}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    if stream:
        choices = [json.loads(e)["choices"][0] for e in sse_events(resp)[:-1]]
        text = "".join(c["text"] for c in choices)
        logprobs = sum((c["logprobs"]["token_logprobs"] for c in choices), [])
    else:
        choice = resp.json()["choices"][0]
        text, logprobs = choice["text"], choice["logprobs"]["token_logprobs"]
    assert text == engine.tokenizer.decode(ids)
    assert logprobs[0] is None and logprobs[1:] == pytest.approx(hf_prompt_logprobs(tiny[1], ids), abs=1e-3)


def test_top_k_0_is_top_k_off(http):
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 99,
        "ignore_eos": True,
    }
    texts = [
        http.post("/v1/completions", json={**body, "top_k": k}).json()["choices"][0]["text"] for k in (0, -1)
    ]
    assert texts[0] == texts[1]


def test_tokenizer_info_version_ping(http, engine):
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == type(engine.tokenizer.hf).__name__
    assert info["chat_template"] == engine.tokenizer.hf.chat_template
    assert "model_max_length" in info and "name_or_path" not in info
    assert all(isinstance(v, str) for k, v in info.items() if k.endswith("_token") and v is not None)
    assert http.get("/version").json() == {"version": importlib.metadata.version("jaxpaged")}
    assert http.get("/ping").status_code == http.post("/ping").status_code == 200
