"""Every value a request carries is refused unless the device can hold it and it means something
(issue 52): int32 counts and ids, finite float32 numbers, strict JSON types, valid Unicode text;
refusals are short 400s naming the field, and nothing reaches the engine loop that could stop it."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged import detokenizer as detokenizer_module
from jaxpaged.output_processor import OutputProcessor
from jaxpaged.sampling_params import ParamError
from jaxpaged.sequence_slots import SequenceSlots
from test_server import engine, http, url, wait_until_idle  # noqa: F401  (engine, http, url: the fixtures)
from tiny_models import hf_greedy

HUGE_TOP_K = 1099511627776
SURROGATE = "\ud800"


# ---- SamplingParams ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, param, message",
    [
        (
            dict(temperature=1e39),
            "temperature",
            r"temperature must be >= 0 \(0 = greedy\) and a finite float32, got 1e\+39",
        ),
        (dict(temperature=10**400), "temperature", "finite float32"),
        (dict(repetition_penalty=1e39), "repetition_penalty", r"repetition_penalty must be in \(0, inf\)"),
        (dict(repetition_penalty=1e-45), "repetition_penalty", "at least 1.2e-38"),
        (dict(top_p=1e-45), "top_p", r"top_p must be in \(0, 1\]"),
        (dict(presence_penalty=float("inf")), "presence_penalty", "finite float32"),
        (dict(min_p=float("nan")), "min_p", "finite float32"),
        (dict(n=True), "n", "n must be at least 1 and at most 2147483647"),
        (dict(n=2**31), "n", "at most 2147483647"),
        (dict(seed=True), "seed", "seed must be None or an integer"),
        (dict(seed=1.0), "seed", "seed must be None or an integer"),
        (dict(max_tokens=2**31), "max_tokens", r"at most 2147483647 \(an int32\)"),
        (dict(min_tokens=2**40, max_tokens=None), "min_tokens", "at most 2147483647"),
        (dict(best_of=2**31), "best_of", "an int32"),
        (dict(stop_token_ids=[2**31]), "stop_token_ids", r"non-negative integers \(int32\)"),
        (dict(logit_bias={2**31: 1.0}), "logit_bias", r"non-negative token ids \(int32\)"),
        (dict(logit_bias={5: 1e39}), "logit_bias", r"logit_bias values must be in \[-100, 100\]"),
        (dict(ignore_eos="yes"), "ignore_eos", "ignore_eos must be a bool"),
        (dict(stop=["ok", SURROGATE]), "stop", "valid Unicode"),
    ],
)
def test_values_the_device_cannot_hold_are_refused(kwargs, param, message):
    with pytest.raises(ParamError, match=message) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param and isinstance(err.value, ValueError)


def test_an_error_quotes_a_bounded_excerpt():
    with pytest.raises(ValueError) as err:
        SamplingParams(stop=[f"stop-{i}" for i in range(998)] + [""])
    assert len(str(err.value)) < 300 and "characters" in str(err.value)


def test_top_k_beyond_the_vocabulary_means_all_tokens():
    assert SamplingParams(top_k=HUGE_TOP_K).top_k == HUGE_TOP_K  # kept, as vLLM: the device row clamps it


# ---- the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny[0]), max_model_len=64, block_size=8, num_gpu_blocks_override=17, max_num_seqs=4)


def test_huge_top_k_samples_as_top_k_off(llm):
    """The issue's OverflowError (top_k written into an int32 row): top_k >= vocab is top_k off."""
    sampled = dict(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    off, huge, vocab = (
        llm.generate([[5, 6, 7]], SamplingParams(top_k=k, **sampled), use_tqdm=False)[0]
        for k in (-1, HUGE_TOP_K, llm.engine.vocab_size)
    )
    assert huge.outputs[0].token_ids == off.outputs[0].token_ids == vocab.outputs[0].token_ids
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.cache_info.num_usable_blocks


@pytest.mark.parametrize(
    "prompt, kwargs, param, message",
    [
        (SURROGATE, {}, "prompt", "prompt is not valid Unicode"),
        (
            "hi",
            dict(cache_salt=SURROGATE),
            "cache_salt",
            "cache_salt must be a non-empty string of valid Unicode",
        ),
        (
            "hi",
            dict(params=SamplingParams(n=5)),
            "n",
            r"n and best_of \(5\) must be at most max_num_seqs \(4\)",
        ),
        ("hi", dict(params=SamplingParams(n=1, best_of=10**9)), "best_of", "must be at most max_num_seqs"),
    ],
)
def test_engine_refuses_bad_text_and_too_many_samples(llm, tiny, prompt, kwargs, param, message):
    params = kwargs.pop("params", SamplingParams(max_tokens=2))
    with pytest.raises(ParamError, match=message) as err:
        llm.engine.make_request("r", prompt, params, **kwargs)
    assert err.value.param == param
    out = llm.generate(
        [[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids == hf_greedy(tiny[1], [5, 6, 7, 8], 4)[0]


# ---- the server ----------------------------------------------------------------------------


def post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    """POST ``body`` as ASCII JSON: a lone surrogate goes over the wire as the escape ``\\ud800``."""
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "hi", "max_tokens": 4}

REFUSED = [
    # (path, body, param, message pattern)
    ("/v1/completions", {**COMPLETION, "temperature": 1e39}, "temperature", "finite float32"),
    ("/v1/completions", {**COMPLETION, "temperature": 1e400}, "temperature", "finite float32"),
    ("/v1/completions", {**COMPLETION, "repetition_penalty": 1e39}, "repetition_penalty", "finite float32"),
    (
        "/v1/completions",
        {**COMPLETION, "repetition_penalty": 1e-45},
        "repetition_penalty",
        "at least 1.2e-38",
    ),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 1e39}}, "logit_bias", r"\[-100, 100\]"),
    ("/v1/completions", {**COMPLETION, "min_tokens": 2**40}, "min_tokens", "an int32"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 2**40}, "max_tokens", "an int32"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [2**40]}, "stop_token_ids", "int32"),
    ("/v1/completions", {**COMPLETION, "seed": 2**64}, "seed", "less than 9223372036854775808"),
    ("/v1/completions", {**COMPLETION, "n": True}, "n", "valid integer"),
    ("/v1/completions", {**COMPLETION, "seed": True}, "seed", "valid integer"),
    ("/v1/completions", {**COMPLETION, "seed": 1.0}, "seed", "valid integer"),
    ("/v1/completions", {**COMPLETION, "top_k": "5"}, "top_k", "valid integer"),
    ("/v1/completions", {**COMPLETION, "temperature": True}, "temperature", "valid number"),
    ("/v1/completions", {**COMPLETION, "temperature": "0.5"}, "temperature", "valid number"),
    ("/v1/completions", {**COMPLETION, "ignore_eos": "yes"}, "ignore_eos", "valid boolean"),
    ("/v1/completions", {**COMPLETION, "echo": 1}, "echo", "valid boolean"),
    ("/v1/completions", {**COMPLETION, "prompt": [5, True]}, "prompt", "valid"),
    ("/v1/completions", {**COMPLETION, "prompt": SURROGATE}, "prompt", "valid Unicode"),
    ("/v1/completions", {**COMPLETION, "prompt": ["ok", "a" + SURROGATE]}, "prompt", "valid Unicode"),
    ("/v1/completions", {**COMPLETION, "stop": SURROGATE}, "stop", "valid Unicode"),
    ("/v1/completions", {**COMPLETION, "model": SURROGATE}, "model", "valid Unicode"),
    ("/v1/completions", {**COMPLETION, "cache_salt": SURROGATE}, "cache_salt", "(?i)unicode"),
    ("/v1/completions", {**COMPLETION, SURROGATE: 1}, None, "unable to parse raw data as a unicode string"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": SURROGATE}]},
        "messages",
        "valid Unicode",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
        "messages",
        "valid Unicode",
    ),
    ("/v1/chat/completions", {**CHAT, "temperature": 1e39}, "temperature", "finite float32"),
    ("/v1/chat/completions", {**CHAT, "logprobs": "yes"}, "logprobs", "valid boolean"),
    (
        "/v1/chat/completions",
        {**CHAT, "max_completion_tokens": 4.0},
        "max_completion_tokens",
        "valid integer",
    ),
    ("/tokenize", {"prompt": SURROGATE}, "prompt", "valid Unicode"),
    ("/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages", "valid Unicode"),
    ("/tokenize", {"prompt": "hi", "model": SURROGATE}, "model", "valid Unicode"),
    ("/detokenize", {"tokens": [5, 2**40]}, "tokens", r"token ids must be in \[0, \d+\)"),
    ("/detokenize", {"tokens": [5, True]}, "tokens", "valid integer"),
]


@pytest.mark.parametrize(
    "path, body, param, message", REFUSED, ids=[f"{p}-{json.dumps(b)[-50:]}" for p, b, *_ in REFUSED]
)
def test_server_refuses_with_a_400_naming_the_param(http, path, body, param, message):
    resp = post(http, path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert re.search(message, error["message"]), error["message"]


def test_server_400_for_999_stop_strings_is_short(http):
    resp = post(http, "/v1/completions", {**COMPLETION, "stop": [f"stop-{i}" for i in range(998)] + [""]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stop"
    assert len(resp.content) < 600, resp.text


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "hi", "top_k": HUGE_TOP_K, "temperature": 1, "max_tokens": 4}),
        ("/v1/chat/completions", {**CHAT, "top_k": 2**31, "temperature": 1}),
        ("/v1/completions", {**COMPLETION, "temperature": 1e-45}),  # raised to 0.01, as vLLM
        ("/v1/completions", {**COMPLETION, "temperature": 1, "top_p": 1}),
    ],
)
def test_huge_top_k_and_tiny_temperature_are_served(http, url, path, body):
    resp = post(http, path, body)
    assert resp.status_code == 200, resp.text
    assert http.get("/health").status_code == 200
    wait_until_idle(url)


# ---- a request that fails inside the engine ------------------------------------------------

MARK = 4242
"""The seed of the requests whose processing the test makes fail."""


def _fails_for_marked(original, request_of, after: int = 0):
    def wrapper(*args, **kwargs):
        r = request_of(*args)
        if r.seed == MARK and r.num_output_tokens >= after:
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)

    return wrapper


INJECTIONS = {
    # where: (patch(monkeypatch), the failing requests' extra fields)
    "sampling row": (
        lambda mp: mp.setattr(
            SequenceSlots,
            "_write_sampling_row",
            _fails_for_marked(SequenceSlots._write_sampling_row, lambda slots, s, r: r),
        ),
        {},
    ),
    "stop check": (
        lambda mp: mp.setattr(
            OutputProcessor,
            "_stop_status",
            staticmethod(_fails_for_marked(OutputProcessor._stop_status, lambda r, *_: r, after=2)),
        ),
        {"stop": ["never said"]},
    ),
}


@pytest.mark.parametrize("where", INJECTIONS)
def test_a_request_failing_in_the_engine_gets_a_500_and_the_others_go_on(http, url, monkeypatch, where):
    """vLLM's behaviour: the failed request gets a 500 (a streamed one an error event), the requests
    beside it their greedy text, /health stays 200, its blocks are freed, the next request is served."""

    def body(prompt: str, **extra) -> dict:
        return {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}

    prompts = ["The quick brown fox", "Hello there", "One two three"]
    expected = [post(http, "/v1/completions", body(p)).json()["choices"][0]["text"] for p in prompts]
    patch, extra = INJECTIONS[where]
    patch(monkeypatch)

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            return await asyncio.gather(
                c.post("/v1/completions", json=body("Fail here", seed=MARK, **extra)),
                c.post("/v1/completions", json=body("Fail there", seed=MARK, stream=True, **extra)),
                *(c.post("/v1/completions", json=body(p)) for p in prompts),
            )

    failed, failed_stream, *served = asyncio.run(together())
    assert failed.status_code == 500, failed.text
    error = failed.json()["error"]
    assert error["type"] == "server_error" and "keeps serving" in error["message"]
    events = failed_stream.text.strip().split("\n\n")
    assert failed_stream.status_code == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["type"] == "server_error"
    assert [r.json()["choices"][0]["text"] for r in served] == expected
    assert http.get("/health").status_code == 200
    monkeypatch.undo()
    wait_until_idle(url)
    assert post(http, "/v1/completions", body(prompts[0])).json()["choices"][0]["text"] == expected[0]


def test_a_request_failing_as_it_is_added_gets_a_500_and_the_engine_goes_on(http, url, monkeypatch):
    """Adding is all or nothing: a request whose admission raises is refused alone."""

    class FailingDetokenizer(detokenizer_module.IncrementalDetokenizer):
        def __init__(self, tokenizer, prompt_token_ids, *args) -> None:
            if prompt_token_ids[:3] == [7, 7, 7]:
                raise RuntimeError("injected failure")
            super().__init__(tokenizer, prompt_token_ids, *args)

    monkeypatch.setattr(detokenizer_module, "IncrementalDetokenizer", FailingDetokenizer)
    for stream in (False, True):
        failed = post(http, "/v1/completions", {**COMPLETION, "prompt": [7, 7, 7, 8], "stream": stream})
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error", failed.text
    assert post(http, "/v1/completions", COMPLETION).status_code == 200
    assert http.get("/health").status_code == 200
    wait_until_idle(url)
