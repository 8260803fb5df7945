"""Tensor parallelism on 4 virtual CPU devices (run by ``test_tensor_parallel.py`` in a subprocess
with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``).

TP = 2, 3, 4 must give the TP = 1 engine's greedy tokens and logprobs (1e-4), for MHA, GQA with
kv heads split and repeated, MQA with biases and tied embeddings, and 6 q / 3 kv heads at TP = 2
(kv heads repeated) and 3 (split); each device must hold only its heads' KV pages and the step
must communicate nothing but the two all-reduces per layer, the embedding's and the logits'
all-gather.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import jax
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.step_programs import step_call
from jaxpaged.kernels import AttentionMetadata, build_prefill_tiles
from tiny_models import random_prompts

if jax.device_count() < 4:
    pytest.skip("needs 4 devices: run through test_tensor_parallel.py", allow_module_level=True)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
# One prefill step (prefill tiles over small blocks), then decode steps: few programs to compile.
ENGINE = dict(block_size=4, max_num_batched_tokens=64, num_gpu_blocks_override=64)

VARIANTS = {
    "mha": dict(num_key_value_heads=4),
    "gqa_untied": {},  # 4 q / 2 kv heads
    "mqa_bias_tied": dict(
        num_key_value_heads=1, attention_bias=True, mlp_bias=True, tie_word_embeddings=True
    ),
    "h6_kv3": dict(hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=3),
}
# Split kv heads (mha-2, gqa-2, h6_kv3-3) and repeated ones (gqa-4: 2x, mqa-4: 4x, h6_kv3-2: 2x).
CASES = [("mha", 2), ("gqa_untied", 2), ("gqa_untied", 4), ("mqa_bias_tied", 4), ("h6_kv3", 2), ("h6_kv3", 3)]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(np.random.default_rng(3), [1, 17, 40])


@pytest.fixture(scope="module")
def run(tiny_model_factory, prompts):
    """``run(variant, tp) -> (llm, tokens, logprobs)``, each engine built and run once."""
    cache = {}

    def get(variant: str, tp: int):
        if (variant, tp) not in cache:
            path, _ = tiny_model_factory(variant, **VARIANTS[variant])
            llm = LLM(str(path), tensor_parallel_size=tp, **ENGINE)
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            tokens = [o.outputs[0].token_ids for o in outs]
            logprobs = [
                [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs
            ]
            cache[variant, tp] = llm, tokens, np.asarray(logprobs)
        return cache[variant, tp]

    return get


@pytest.mark.parametrize("variant,tp", CASES, ids=[f"{v}-tp{t}" for v, t in CASES])
def test_tp_matches_single_device(run, variant, tp):
    _, ref_tokens, ref_logprobs = run(variant, 1)
    llm, tokens, logprobs = run(variant, tp)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-4)
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.cache_info.num_usable_blocks


def test_multi_step_under_tp_matches_single_device(run, tiny_model_factory, prompts):
    """Groups of decode steps in one program over the mesh (KV pages sharded in the loop)."""
    _, ref_tokens, ref_logprobs = run("gqa_untied", 1)
    path, _ = tiny_model_factory("gqa_untied", **VARIANTS["gqa_untied"])
    llm = LLM(str(path), tensor_parallel_size=2, num_scheduler_steps=3, **ENGINE)
    grouped = []
    schedule = llm.engine.scheduler.schedule
    llm.engine.scheduler.schedule = lambda: grouped.append(out := schedule()) or out
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert any(o.num_steps == 3 for o in grouped)
    assert [o.outputs[0].token_ids for o in outs] == ref_tokens
    logprobs = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-4)
    assert llm.engine.runner.kv_pages.sharding.spec[4] == "tp"


def test_speculative_decoding_under_tp_matches_single_device(tiny_model_factory):
    """n-gram speculation's verifying rows (several query tokens, a sampled row per draft) over the mesh."""
    path, _ = tiny_model_factory("gqa_untied", **VARIANTS["gqa_untied"])
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 350, 5).tolist() * 4 for _ in range(3)]
    # Long enough for the tiny model to fall into a cycle, which the lookup then proposes.
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=0)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    results = []
    for tp, speculative_config in [(1, None), (2, spec)]:
        llm = LLM(str(path), tensor_parallel_size=tp, speculative_config=speculative_config, **ENGINE)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        results.append(
            (
                [o.outputs[0].token_ids for o in outs],
                [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs],
            )
        )
        assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.cache_info.num_usable_blocks
    assert results[1][0] == results[0][0]
    np.testing.assert_allclose(results[1][1], results[0][1], atol=1e-4)
    assert llm.engine.spec_decode_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("tp", [2, 4])
def test_each_device_holds_only_its_kv_heads(run, tp):
    """GQA with 2 kv heads: TP=2 gives each device one head; TP=4 repeats each head twice, so
    device j holds (a copy of) head j // 2. Same schedule, same blocks: the pages must equal the
    TP=1 engine's pages of those heads."""
    ref = np.asarray(run("gqa_untied", 1)[0].engine.runner.kv_pages)
    llm = run("gqa_untied", tp)[0]
    kv = llm.engine.runner.kv_pages
    repeats = tp // math.gcd(2, tp)
    assert kv.shape[4] == 2 * repeats
    assert kv.sharding.spec[4] == "tp"
    shards = sorted(kv.addressable_shards, key=lambda s: s.index[4].start)
    assert len(shards) == tp and len({s.device for s in shards}) == tp
    for j, shard in enumerate(shards):
        assert shard.data.shape == kv.shape[:4] + (1,) + kv.shape[5:]
        np.testing.assert_allclose(np.asarray(shard.data), ref[:, :, :, :, [j // repeats]], atol=1e-5)


def test_params_are_split_as_the_rules_say(run):
    llm = run("gqa_untied", 2)[0]
    p = llm.engine.runner.model.params
    L, H, V, I = 2, 64, 384, 128
    expect = {  # param -> (global shape, per-device shape)
        ("embed_tokens", "embedding"): ((V, H), (V // 2, H)),
        ("lm_head", "kernel"): ((H, V), (H, V // 2)),
        **{(f"layers_{i}", "qkv_proj", "kernel"): ((H, 64 + 2 * 32), (H, 64)) for i in range(L)},
        ("layers_1", "o_proj", "kernel"): ((64, H), (32, H)),
        ("layers_1", "gate_up_proj", "kernel"): ((H, 2 * I), (H, I)),
        ("layers_0", "down_proj", "kernel"): ((I, H), (I // 2, H)),
        ("layers_0", "input_layernorm", "weight"): ((H,), (H,)),
        ("norm", "weight"): ((H,), (H,)),
    }
    for path, (shape, local) in expect.items():
        a = p
        for k in path:
            a = a[k]
        assert a.shape == shape, path
        assert {s.data.shape for s in a.addressable_shards} == {local}, path
    # Per device: about half the params of one device (norms are replicated), half the KV pages.
    one = run("gqa_untied", 1)[0].engine.runner.memory_per_device()
    two = llm.engine.runner.memory_per_device()
    (single,) = one.values()
    assert len(two) == 2
    for m in two.values():
        assert 0.45 * single.params < m.params < 0.55 * single.params
        assert m.kv_cache * 2 == single.kv_cache


def test_step_communicates_only_reductions_and_the_logits_gather(run):
    """Per layer one all-reduce after o_proj and one after down_proj, one after the vocabulary-split
    embedding lookup, and one all-gather: the logits. No KV or head gathers."""
    runner = run("gqa_untied", 2)[0].engine.runner
    T, R, W = 16, 8, 4
    qsl = np.array([0, 10] + [16] * 7, np.int32)
    tile_row, tile_start, tile_len = build_prefill_tiles(qsl, 16, 4)
    md = AttentionMetadata(
        np.arange(T, dtype=np.int32),
        np.zeros((R, W), np.int32),
        np.array([10, 6] + [0] * 6, np.int32),
        qsl,
        tile_row,
        tile_start,
        tile_len,
        16,
    )
    fn, args = step_call(
        runner.model.module,
        runner.model.params,
        runner.kv_pages,
        np.zeros(T, np.int32),
        np.zeros(T, np.int32),
        md,
        np.zeros(R, np.int32),
        np.full(T, -1, np.int32),
        np.zeros(runner.max_rows, np.int32),
        np.int32(R),
    )
    hlo = fn.lower(*args).compile().as_text()
    ops = re.findall(
        r"= (\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", hlo
    )
    num_layers = runner.model.module.cfg.num_layers
    assert Counter(op for _, op in ops) == {"all-reduce": 2 * num_layers + 1, "all-gather": 1}, ops
    (gathered,) = [shape for shape, op in ops if op == "all-gather"]
    assert gathered.startswith(f"f32[{R},384]"), gathered


def test_bad_configurations_fail_at_start_up(tiny_model_factory):
    path, _ = tiny_model_factory("gqa_untied", **VARIANTS["gqa_untied"])
    with pytest.raises(ValueError, match="does not divide the model's 4 attention"):
        LLM(str(path), tensor_parallel_size=3, **ENGINE)
    with pytest.raises(ValueError, match="needs 8 devices, but only 4"):
        LLM(str(path), tensor_parallel_size=8, **ENGINE)
    path, _ = tiny_model_factory("h6_kv3", **VARIANTS["h6_kv3"])
    with pytest.raises(ValueError, match="does not divide the model's 6 attention"):
        LLM(str(path), tensor_parallel_size=4, **ENGINE)


@pytest.mark.slow
def test_smollm2_tp3_matches_single_device(smollm2_tokenizer):
    """SmolLM2-135M (9 q / 3 kv heads, tied 49152-token vocabulary) split over 3 devices."""
    questions = ["What is the capital of France?", "Count from one to five."]
    prompts = [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    results = []
    for tp in (1, 3):
        llm = LLM(tensor_parallel_size=tp, num_gpu_blocks_override=32)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        results.append(
            (
                [o.outputs[0].token_ids for o in outs],
                np.asarray(
                    [
                        [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                        for o in outs
                    ]
                ),
            )
        )
        if tp == 3:
            kv = llm.engine.runner.kv_pages
            assert {s.data.shape[4] for s in kv.addressable_shards} == {1}
        del llm
    (tok1, lp1), (tok3, lp3) = results
    assert tok3 == tok1
    np.testing.assert_allclose(lp3, lp1, atol=1e-4)
