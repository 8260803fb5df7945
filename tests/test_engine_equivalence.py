"""Greedy decoding through the whole engine is token-identical to Hugging Face transformers,
and the chosen tokens' logprobs agree, under every batching and caching regime."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxpaged import LLM, SamplingParams
from jaxpaged.kernels.cpu_matmul import native_matmul_available
from tiny_models import hf_greedy, random_prompts

PROMPT_LENGTHS = [1, 5, 17, 40, 9, 23]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

VARIANTS = {
    "gqa_untied": {},
    "mha_tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "mqa_bias_llama3_rope": dict(
        num_key_value_heads=1,
        attention_bias=True,
        mlp_bias=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "linear_rope": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(np.random.default_rng(0), PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def reference(tiny_model_factory, prompts):
    """HF greedy tokens/logprobs per variant, computed once."""
    cache = {}

    def get(variant):
        if variant not in cache:
            path, hf = tiny_model_factory(variant, **VARIANTS[variant])
            cache[variant] = path, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
        return cache[variant]

    return get


def assert_matches_hf(outputs, ref):
    for i, (out, (tokens, logprobs, margins)) in enumerate(zip(outputs, ref)):
        got = out.outputs[0].token_ids
        if got != tokens:
            k = next(j for j, (a, b) in enumerate(zip(got, tokens)) if a != b)
            pytest.fail(
                f"prompt {i}: tokens diverge at step {k} (HF top1-top2 margin {margins[k]:.2e}): "
                f"ours {got} vs HF {tokens}"
            )
        ours = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, got, strict=True)]
        np.testing.assert_allclose(ours, logprobs, atol=1e-3, err_msg=f"prompt {i} logprobs")


def generate(path, prompts, **engine_args):
    llm = LLM(str(path), **engine_args)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.cache_info.num_usable_blocks
    return llm, outs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_model_variants_match_hf(variant, reference, prompts):
    path, ref = reference(variant)
    _, outs = generate(path, prompts)
    assert_matches_hf(outs, ref)


@pytest.mark.parametrize("block_size", [1, 8, 16, 64])
def test_block_sizes_match_hf(block_size, reference, prompts):
    path, ref = reference("gqa_untied")
    _, outs = generate(path, prompts, block_size=block_size)
    assert_matches_hf(outs, ref)


def test_chunked_prefill_matches_hf(reference, prompts):
    path, ref = reference("gqa_untied")
    llm, outs = generate(path, prompts, max_num_batched_tokens=8, block_size=4)
    assert_matches_hf(outs, ref)


def test_preemption_matches_hf(reference, prompts):
    """A pool of 12 blocks of 4 tokens cannot hold all six sequences (up to 52 tokens each)."""
    path, ref = reference("gqa_untied")
    llm = LLM(str(path), block_size=4, num_gpu_blocks_override=17, max_num_batched_tokens=64)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    reqs = [llm.engine.add_request(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    outs = {}
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert sum(r.num_preemptions for r in reqs) > 0, "the pool was meant to force preemption"
    assert_matches_hf([outs[f"r{i}"] for i in range(len(prompts))], ref)
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.cache_info.num_usable_blocks


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(num_scheduler_steps=5),  # groups of 5, 5 and 1 decode steps after the prompts' step
        dict(
            num_scheduler_steps=4, block_size=4, num_gpu_blocks_override=17, max_num_batched_tokens=64
        ),  # preemption
        dict(num_scheduler_steps=3, attention_backend="xla", max_num_batched_tokens=32),
        dict(num_scheduler_steps=4, attention_backend="pallas_interpret", max_num_batched_tokens=32),
    ],
    ids=["k5", "k4_preemption", "k3_xla", "k4_pallas"],
)
def test_multi_step_scheduling_matches_hf(engine_args, reference, prompts):
    """Several decode steps per schedule, in one program (every attention backend inside its loop)."""
    path, ref = reference("gqa_untied")
    llm = LLM(str(path), **engine_args)
    k, grouped = engine_args["num_scheduler_steps"], []
    schedule = llm.engine.scheduler.schedule
    llm.engine.scheduler.schedule = lambda: grouped.append(out := schedule()) or out
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert any(o.num_steps == k for o in grouped)
    if "num_gpu_blocks_override" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert_matches_hf(outs, ref)
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.cache_info.num_usable_blocks


def test_requests_arriving_mid_decode_match_hf(reference, prompts):
    path, ref = reference("gqa_untied")
    llm = LLM(str(path), max_num_batched_tokens=16)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs, pending = {}, list(enumerate(prompts))
    step = 0
    while pending or llm.engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request every third step
            i, p = pending.pop(0)
            llm.engine.add_request(f"r{i}", p, sp)
        for o in llm.engine.step():
            if o.finished:
                outs[o.request_id] = o
        step += 1
    assert_matches_hf([outs[f"r{i}"] for i in range(len(prompts))], ref)


@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("variant", ["gqa_untied", "mha_tied"])
def test_other_attention_backends_match_hf(backend, variant, reference, prompts):
    """The default CPU backend is the native kernel; the plain-XLA backend and the Pallas kernel
    (interpret mode on CPU) inside the whole engine give the same greedy tokens as HF, with chunked
    prefill mixing prompt chunks and decodes in one launch."""
    path, ref = reference(variant)
    llm, outs = generate(path, prompts, attention_backend=backend, max_num_batched_tokens=32)
    assert llm.engine.runner.model.module.attention_backend == backend
    assert_matches_hf(outs, ref)


def test_auto_backend_on_cpu_is_the_native_kernel(reference, prompts):
    path, _ = reference("gqa_untied")
    llm = LLM(str(path))
    assert llm.engine.runner.model.module.attention_backend == "cpu"


MATMUL_BACKENDS = [
    "xla",
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not native_matmul_available(), reason="native CPU matmul not built")
    ),
]


@pytest.mark.parametrize("matmul_backend", MATMUL_BACKENDS)
@pytest.mark.parametrize("variant", ["gqa_untied", "mha_tied"])
def test_matmul_backends_match_hf(matmul_backend, variant, reference, prompts):
    """XLA's dot and the native CPU matmul (packed weights; a tied head packed apart) in the whole
    engine, with chunked prefill: HF's greedy tokens and logprobs."""
    path, ref = reference(variant)
    llm, outs = generate(path, prompts, matmul_backend=matmul_backend, max_num_batched_tokens=32)
    assert llm.engine.runner.model.module.matmul_backend == matmul_backend
    assert_matches_hf(outs, ref)


@pytest.mark.parametrize("matmul_backend", MATMUL_BACKENDS)
def test_bfloat16_prompt_logprobs_close_to_hf_float32(matmul_backend, tiny, prompts):
    """The bfloat16 path end to end (weights, matmuls, KV pages written and read in bf16, chunked
    prefill): teacher-forced prompt logprobs stay within bf16 rounding of HF's float32 ones."""
    path, hf = tiny
    llm = LLM(str(path), dtype="bfloat16", matmul_backend=matmul_backend, max_num_batched_tokens=16)
    assert llm.engine.runner.kv_pages.dtype == jnp.bfloat16
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        if len(prompt) < 2:
            continue
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0, :-1].double()
        want = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].numpy()
        got = [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], prompt[1:])]
        np.testing.assert_allclose(got, want, atol=0.08, rtol=0.02)


def test_matmul_backend_errors(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match="matmul_backend must be one of"):
        LLM(str(path), matmul_backend="blas")
    with pytest.raises(ValueError, match="matmul_backend='cpu'.*cannot run here: it does not take float16"):
        LLM(str(path), dtype="float16", matmul_backend="cpu")
