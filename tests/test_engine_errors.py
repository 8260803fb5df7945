"""Bad inputs get a clear error, and the engine keeps serving everyone else with nothing leaked."""

from __future__ import annotations

import json

import pytest

from jaxpaged import LLM, RequestOutputKind, SamplingParams, sampling_inputs
from jaxpaged.output_processor import OutputProcessor
from jaxpaged.sequence_slots import SequenceSlots
from tiny_models import hf_greedy


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny[0]), max_model_len=64, block_size=8, num_gpu_blocks_override=7)


GOOD = [5, 6, 7, 8]
SP = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def assert_still_serving(llm, tiny):
    """A normal request right after the error is served correctly and the pool ends full."""
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    out = llm.generate([GOOD], SP, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(tiny[1], GOOD, 6)[0]
    assert eng.kv_cache_manager.num_free_blocks == eng.cache_info.num_usable_blocks


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SP, "prompt is empty"),
        ([], SP, "prompt is empty"),
        ([1, 2, 384], SP, r"token ids must be in \[0, 384\)"),
        ([-1, 2], SP, r"token ids must be in \[0, 384\)"),
        (list(range(3, 70)), SP, "max_model_len is 64"),
        (list(range(3, 50)), SamplingParams(max_tokens=20), "lower max_tokens to at most 17"),
        (
            list(range(3, 20)),
            SamplingParams(max_tokens=40),
            "needs 8 KV blocks of 8 tokens but the pool has only 6",
        ),
    ],
)
def test_bad_request_rejected_and_engine_keeps_serving(llm, tiny, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([GOOD, prompt], params, use_tqdm=False)
    assert_still_serving(llm, tiny)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), "top_k must be 0 or -1"),
        (dict(stop=[""]), "stop must be a list of non-empty strings"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_mismatched_sampling_params_list(llm, tiny):
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([GOOD], [SP, SP], use_tqdm=False)
    assert_still_serving(llm, tiny)


def test_abort_mid_decode_frees_blocks_and_others_finish(llm, tiny):
    eng = llm.engine
    eng.add_request("victim", [9, 10, 11], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    eng.add_request("other", GOOD, SP)
    for _ in range(3):
        eng.step()
    eng.abort_request("victim")
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert "victim" not in outs
    assert outs["other"].outputs[0].token_ids == hf_greedy(tiny[1], GOOD, 6)[0]
    assert eng.kv_cache_manager.num_free_blocks == eng.cache_info.num_usable_blocks


def test_unknown_model_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        LLM(str(tmp_path / "no-such-model"))


def test_unsupported_architecture(tiny, tmp_path):
    for f in tiny[0].iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported model architecture.*LlamaForCausalLM"):
        LLM(str(tmp_path))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_size=3), "block_size must be a power of two"),
        (dict(block_size=256), "block_size must be a power of two"),
        (dict(max_model_len=100000), "exceeds the model's max_position_embeddings"),
        (dict(kv_cache_memory=10), "kv_cache_memory=10 bytes holds 0 blocks"),
        (dict(num_gpu_blocks_override=1), "num_gpu_blocks_override=1: the pool needs at least 2 blocks"),
        (dict(attention_backend="cuda-magic"), "attention_backend must be one of"),
        (dict(quantization="gguf-q9"), "quantization must be one of"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=32), "chunked prefill disabled"),
    ],
)
def test_bad_engine_config(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny[0]), **kwargs)


# ---- one request's failure inside a step (issue 52) -----------------------------------------


def _fails_for_bad(original, request_of=lambda *args: args[0], after: int = 0, bad: str = "bad"):
    """``original`` wrapped to raise for request (or sample) ``bad`` once it has ``after`` output tokens."""

    def wrapper(*args, **kwargs):
        r = request_of(*args)
        if r.request_id == bad and r.num_output_tokens >= after:
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)

    return wrapper


INJECTIONS = {
    # where: (patch(monkeypatch), the bad request's extra sampling parameters)
    "sampling row": (
        lambda mp: mp.setattr(
            SequenceSlots,
            "_write_sampling_row",
            _fails_for_bad(SequenceSlots._write_sampling_row, lambda slots, s, r: r),
        ),
        {},
    ),
    "penalty lists": (
        lambda mp: mp.setattr(
            sampling_inputs, "_host_lists", _fails_for_bad(sampling_inputs._host_lists, after=2)
        ),
        dict(repetition_penalty=1.3),
    ),
    "stop check": (
        lambda mp: mp.setattr(
            OutputProcessor,
            "_stop_status",
            staticmethod(_fails_for_bad(OutputProcessor._stop_status, after=3)),
        ),
        dict(stop=["never said"]),
    ),
    "detokenizer": (
        lambda mp: mp.setattr(
            OutputProcessor, "_passed", _fails_for_bad(OutputProcessor._passed, lambda eng, r, *_: r, after=2)
        ),
        dict(output_kind=RequestOutputKind.DELTA),
    ),
    "output": (
        lambda mp: mp.setattr(
            OutputProcessor,
            "_make_output",
            _fails_for_bad(OutputProcessor._make_output, lambda eng, r: r, after=1),
        ),
        {},
    ),
    "a fork's sampling row": (
        lambda mp: mp.setattr(
            SequenceSlots,
            "_write_sampling_row",
            _fails_for_bad(SequenceSlots._write_sampling_row, lambda slots, s, r: r, bad="1_bad"),
        ),
        dict(n=2),
    ),
}


@pytest.mark.parametrize("where", INJECTIONS)
def test_a_request_failing_in_a_step_ends_with_an_error_and_the_others_finish(llm, tiny, monkeypatch, where):
    """The failed request ends with finish reason "error" and its blocks freed; the requests in the same
    steps get their greedy outputs; the engine serves the next request."""
    patch, extra = INJECTIONS[where]
    patch(monkeypatch)
    eng = llm.engine
    good = {"good-1": [11, 12, 13], "good-2": [21, 22, 23, 24]}
    for rid, prompt in good.items():
        eng.add_request(rid, prompt, SP)
    eng.add_request(
        "bad",
        [31, 32, 33],
        SamplingParams(**{**dict(temperature=0.0, max_tokens=6, ignore_eos=True, seed=1), **extra}),
    )
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert {c.finish_reason for c in outs["bad"].outputs} == {"error"}
    for rid, prompt in good.items():
        assert outs[rid].outputs[0].token_ids == hf_greedy(tiny[1], prompt, 6)[0], rid
    monkeypatch.undo()
    assert_still_serving(llm, tiny)
