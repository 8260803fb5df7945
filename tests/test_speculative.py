"""Speculative decoding through the engine: outputs token-identical to Hugging Face transformers and to
the plain engine (greedy, and seeded sampling, whose draws speculation must not change), under batching,
chunked prefill, preemption (recompute and swap), prefix caching, n > 1, async scheduling, both
proposers, with no block leaked; its counters checked by arithmetic over what was drafted."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from jaxpaged import LLM, LLMEngine, SamplingParams, StructuredOutputsParams
from jaxpaged.async_engine import AsyncLLMEngine
from jaxpaged.cli import build_parser, engine_args_from
from jaxpaged.server import build_app
from test_server import MODEL, metrics, serve, wait_until_idle
from tiny_models import hf_greedy, save_tiny_llama

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=256, block_size=8)
MAX_TOKENS = 32


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of a few random segments repeated (n-gram lookup finds them, and tiny random models tend
    to continue repeats), of assorted lengths."""
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(n):
        segment = rng.integers(3, 350, int(rng.integers(3, 9))).tolist()
        prompts.append(
            rng.integers(3, 350, int(rng.integers(0, 5))).tolist() + segment * int(rng.integers(2, 6))
        )
    return prompts


def run(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert engine.kv_cache_manager.num_free_blocks == engine.cache_info.num_usable_blocks, "leaked blocks"
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("gqa_untied")


@pytest.fixture(scope="module")
def plain(model):
    return LLM(str(model[0]), **ENGINE)


def test_ngram_greedy_matches_hf_and_counts_add_up(model, plain):
    path, hf = model
    prompts = repetitive_prompts(6)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    llm = LLM(str(path), speculative_config=NGRAM, **ENGINE)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    for p, out in zip(prompts, outs):
        tokens, logprobs, _ = hf_greedy(hf, p, MAX_TOKENS)
        got = out.outputs[0].token_ids
        assert list(got) == tokens
        ours = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, got, strict=True)]
        np.testing.assert_allclose(ours, logprobs, atol=1e-3)
    stats = llm.engine.spec_decode_stats
    assert stats.num_accepted_tokens > 0, "no draft was ever accepted: the test checks nothing"
    assert stats.num_accepted_tokens < stats.num_draft_tokens, "no draft was rejected: rollback unexercised"
    # Every output token is a verifying row's accepted draft or one sampled token of a step.
    per_request = [o.metrics for o in outs]
    assert sum(m.get("spec_decode_num_accepted_tokens", 0) for m in per_request) == stats.num_accepted_tokens
    assert sum(m.get("spec_decode_num_draft_tokens", 0) for m in per_request) == stats.num_draft_tokens
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    for m in per_request:
        if "spec_decode_num_draft_tokens" in m:
            assert (
                m["spec_decode_acceptance_rate"]
                == m["spec_decode_num_accepted_tokens"] / m["spec_decode_num_draft_tokens"]
            )
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.cache_info.num_usable_blocks


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_ngram_seeded_sampling_is_unchanged(model, plain, async_scheduling):
    """Seeded draws at each position are the plain engine's: speculation changes no token."""
    path, _ = model
    prompts = repetitive_prompts(5, seed=1)
    params = [
        SamplingParams(temperature=0.3, top_p=0.95, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i in range(len(prompts))
    ]
    want = run(plain, prompts, params)
    llm = LLM(str(path), speculative_config=NGRAM, async_scheduling=async_scheduling, **ENGINE)
    assert run(llm, prompts, params) == want
    assert llm.engine.spec_decode_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_ngram_under_preemption_prefix_caching_chunked_prefill_and_n(model, plain, preemption_mode):
    """A pool too small for the batch (preemptions), prefix caching with shared prompts, prompts
    longer than the step budget (chunked prefill), and n = 2 seeded samples: the plain engine's tokens."""
    path, _ = model
    rng = np.random.default_rng(2)
    shared = rng.integers(3, 350, 40).tolist()
    prompts = [shared + p for p in repetitive_prompts(6, seed=3)] + [rng.integers(3, 350, 90).tolist()]
    params = SamplingParams(n=2, temperature=0.5, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    small = dict(ENGINE, num_gpu_blocks_override=40, max_num_batched_tokens=32, enable_prefix_caching=True)
    ref = LLM(str(path), **small, preemption_mode=preemption_mode)
    want = run(ref, prompts, params), run(ref, prompts, greedy)
    llm = LLM(str(path), speculative_config=NGRAM, preemption_mode=preemption_mode, **small)
    assert (run(llm, prompts, params), run(llm, prompts, greedy)) == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.spec_decode_stats.num_accepted_tokens > 0
    assert want[1] == run(plain, prompts, greedy)


def test_penalties_bias_min_tokens_and_stops_under_speculation(model, plain):
    """Requests with penalties, logit bias and min_tokens verify drafts too, their lists counting the drafts
    before each position as output, and a stop token among accepted drafts ends the request there: the plain
    engine's tokens."""
    path, _ = model
    prompts = repetitive_prompts(6, seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = run(plain, prompts[:1], greedy)[0][0]
    eos = plain.get_tokenizer().eos_token_id
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, repetition_penalty=1.05, ignore_eos=True),
        SamplingParams(
            temperature=0.5,
            seed=3,
            max_tokens=MAX_TOKENS,
            presence_penalty=0.2,
            frequency_penalty=0.1,
            ignore_eos=True,
        ),
        # EOS boosted to the top: only the min_tokens mask holds it back, for exactly 26 tokens (the tiny
        # model's outputs fall into a cycle of about 20 tokens, which the lookup then proposes).
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=26, logit_bias={eos: 100.0}),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logit_bias={first[5]: -100.0}, ignore_eos=True),
        # A stop token held back by min_tokens until the cycle's second pass, among accepted drafts.
        SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, min_tokens=24, stop_token_ids=[first[5]], ignore_eos=True
        ),
    ]
    batch = [prompts[1], prompts[2], prompts[3], prompts[4], prompts[0]]
    llm = LLM(str(path), speculative_config=NGRAM, **ENGINE)
    outs = llm.generate(batch, params, use_tqdm=False)
    want = plain.generate(batch, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [list(o.outputs[0].token_ids) for o in want]
    assert len(outs[2].outputs[0].token_ids) == 27 and outs[2].outputs[0].token_ids[-1] == eos
    assert (
        outs[4].outputs[0].token_ids[-1] == first[5] and 24 < len(outs[4].outputs[0].token_ids) < MAX_TOKENS
    )
    drafted = [o.metrics.get("spec_decode_num_draft_tokens", 0) for o in outs]
    assert all(d > 0 for d in drafted), drafted
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.cache_info.num_usable_blocks


def test_structured_outputs_under_speculation(model, plain):
    """Constrained requests verify drafts too: drafts are cut where the grammar refuses one, and each verifying
    row is masked by the grammar's state after the drafts before it; the plain engine's tokens."""
    path, _ = model
    prompts = repetitive_prompts(3, seed=9)
    regex = lambda r: StructuredOutputsParams(regex=r)  # noqa: E731
    params = [
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=regex("[a-z ]+")),
        SamplingParams(temperature=0.7, seed=5, max_tokens=40, structured_outputs=regex("(the |cat |dog )+")),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    ]
    llm = LLM(str(path), speculative_config=NGRAM, **ENGINE)
    outs = llm.generate(prompts, params, use_tqdm=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [list(o.outputs[0].token_ids) for o in want]
    assert all(o.metrics.get("spec_decode_num_accepted_tokens", 0) > 0 for o in outs), [
        o.metrics for o in outs
    ]
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.cache_info.num_usable_blocks


def test_draft_model_greedy_matches_hf(model, tiny_model_factory):
    """A draft model of other random weights (same tokenizer): greedy tokens are HF's; the target as
    its own draft has nearly every draft accepted."""
    path, hf = model
    draft_path, _ = tiny_model_factory("draft_one_layer", num_hidden_layers=1, seed=5)
    prompts = repetitive_prompts(4, seed=6)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    spec = {"method": "draft_model", "model": str(draft_path), "num_speculative_tokens": 3}
    llm = LLM(str(path), speculative_config=spec, **ENGINE)
    for p, got in zip(prompts, run(llm, prompts, greedy)):
        assert got[0] == hf_greedy(hf, p, MAX_TOKENS)[0]
    assert llm.engine.spec_decode_stats.num_drafts > 0
    self_spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    llm = LLM(str(path), speculative_config=self_spec, **ENGINE)
    for p, got in zip(prompts, run(llm, prompts, greedy)):
        assert got[0] == hf_greedy(hf, p, MAX_TOKENS)[0]
    assert llm.engine.spec_decode_stats.acceptance_rate > 0.9


def test_draft_model_needs_the_targets_tokenizer(model, tmp_path, sentencepiece_tokenizer_dir):
    path, _ = model
    save_tiny_llama(tmp_path, sentencepiece_tokenizer_dir)
    with pytest.raises(ValueError, match="the draft model's tokenizer"):
        LLM(
            str(path),
            speculative_config={"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2},
            **ENGINE,
        )
    with pytest.raises(ValueError, match="needs 'model'"):
        LLM(str(path), speculative_config={"method": "draft_model", "num_speculative_tokens": 2}, **ENGINE)


def test_serve_flag_and_prometheus_counters(model):
    """``--speculative-config`` as ``jaxpaged serve`` parses it; a chat completion through the server is the
    plain engine's, and /metrics counts what the engine drafted under vLLM's ``spec_decode_*`` names."""
    path, _ = model
    ns = build_parser().parse_args(
        [
            "serve",
            str(path),
            "--speculative-config",
            json.dumps(NGRAM),
            "--max-num-seqs",
            "8",
            "--block-size",
            "8",
        ]
    )
    args = engine_args_from(ns)
    assert args.create_engine_config().speculative.num_speculative_tokens == 4
    prompt = repetitive_prompts(1, seed=8)[0]
    engine = AsyncLLMEngine(LLMEngine.from_engine_args(args))
    try:
        with serve(build_app(engine, MODEL)) as url:
            body = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            }
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
            wait_until_idle(url)
            m = metrics(url)
    finally:
        engine.shutdown()
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = LLM(str(path), max_num_seqs=8, block_size=8).generate([prompt], greedy, use_tqdm=False)[0]
    assert reply["choices"][0]["text"] == plain.outputs[0].text
    drafted = m['vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="' + MODEL + '"}']
    accepted = m['vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="' + MODEL + '"}']
    per_pos = [v for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")]
    assert 0 < accepted <= drafted and sum(per_pos) == accepted
    assert m['vllm:spec_decode_num_drafts_total{engine="0",model_name="' + MODEL + '"}'] > 0


@pytest.mark.slow
def test_smollm2_copying_a_passage_matches_hf(smollm2_tokenizer, hf_smollm2_model):
    """SmolLM2 asked to repeat a passage: n-gram drafts are mostly accepted, and the greedy tokens and
    their logprobs are transformers'."""
    passage = (
        "The harbour town wakes before the sun. Fishing boats slip out past the lighthouse while the "
        "bakery on the corner lights its ovens, and by six the smell of bread reaches the quay."
    )
    message = f"Repeat the following passage exactly, word for word.\n\n{passage}"
    prompt = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": message}])
    n = 40
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4}, num_gpu_blocks_override=64)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, logprobs=0), use_tqdm=False)[0]
    tokens, logprobs, _ = hf_greedy(hf_smollm2_model, prompt, len(out.outputs[0].token_ids))
    assert list(out.outputs[0].token_ids) == tokens
    ours = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
    np.testing.assert_allclose(ours, logprobs, atol=2e-3)
    stats = llm.engine.spec_decode_stats
    assert stats.acceptance_rate > 0.5 and stats.mean_acceptance_length > 2
