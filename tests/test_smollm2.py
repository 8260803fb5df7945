"""SmolLM2-135M-Instruct from its GGUF: our engine against transformers loading the same file."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxpaged import LLM, SamplingParams
from test_engine_equivalence import assert_matches_hf
from tiny_models import hf_greedy

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Name three colours.",
             "Explain in one sentence why the sky is blue, please, for a child of five years old.",
             "Count from one to five."]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(hf_smollm2_model, prompts):
    return [hf_greedy(hf_smollm2_model, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("engine_args", [
    {},
    # Chunked prompts and a pool of 8 usable blocks of 16: four sequences of ~60 tokens must preempt.
    dict(max_num_batched_tokens=32, block_size=16, num_gpu_blocks_override=9),
], ids=["default", "chunked_preempting"])
def test_greedy_matches_transformers(engine_args, prompts, reference):
    llm = LLM(**engine_args)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert_matches_hf(outs, reference)
    eng = llm.engine
    assert eng.kv_cache_manager.num_free_blocks == eng.cache_info.num_usable_blocks


@pytest.mark.parametrize("dtype,quantizations", [("float32", ("auto", "none")),
                                                  ("bfloat16", ("gguf", "none", "auto"))])
def test_quantized_weights_give_bit_identical_results(prompts, dtype, quantizations):
    """The Q4_1 projections and the Q8_0 embedding (the tied LM head) run as quantized weights by
    default in float32, and with quantization="gguf" in bfloat16 too; they rebuild the dequantized
    weights exactly (in bfloat16, rounded as the dequantized weights are) and sum in the same order,
    so tokens and logprobs equal those of quantization="none" to the last bit. In bfloat16 "auto"
    keeps the dense weights."""
    import jax.numpy as jnp
    import jax.tree_util as tu

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    results, kinds = [], []
    for quantization in quantizations:
        llm = LLM(quantization=quantization, dtype=dtype, precompile=False, max_num_seqs=4)
        kinds.append(sorted({str(a.dtype) for a in tu.tree_leaves(llm.engine.runner.model.params) if a.ndim >= 2}))
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, sp, use_tqdm=False)])
        num_quantized = sum(a.dtype == jnp.uint8 for a in tu.tree_leaves(llm.engine.runner.model.params))
        assert num_quantized == (30 * 4 + 1 if kinds[-1] == [dtype, "uint8"] else 0)
    assert kinds == [[dtype, "uint8"]] + [[dtype]] * (len(quantizations) - 1)
    assert all(r == results[0] for r in results[1:])


def test_cli_generate_prints_completion():
    proc = subprocess.run([sys.executable, "-m", "jaxpaged.cli", "generate", "--chat", "--max-tokens", "12",
                           "What is the capital of France?"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "finish:" in proc.stdout


def test_cli_reports_bad_model_cleanly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jaxpaged.cli", "generate", "--model", str(tmp_path / "nope"),
                           "hi"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert "jaxpaged: error:" in proc.stderr and "Traceback" not in proc.stderr
