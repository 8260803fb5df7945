"""SmolLM2-135M-Instruct from its GGUF: our engine against transformers loading the same file."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.kernels.cpu_matmul import native_matmul_available, native_matmul_vectorized
from test_engine_equivalence import assert_matches_hf
from tiny_models import hf_greedy

pytestmark = pytest.mark.slow
needs_native_matmul = pytest.mark.skipif(not native_matmul_available(), reason="native CPU matmul not built")

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "Explain in one sentence why the sky is blue, please, for a child of five years old.",
    "Count from one to five.",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(hf_smollm2_model, prompts):
    return [hf_greedy(hf_smollm2_model, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        # Chunked prompts and a pool of 8 usable blocks of 16: four sequences of ~60 tokens must preempt.
        dict(max_num_batched_tokens=32, block_size=16, num_gpu_blocks_override=9),
    ],
    ids=["default", "chunked_preempting"],
)
def test_greedy_matches_transformers(engine_args, prompts, reference):
    llm = LLM(**engine_args)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert_matches_hf(outs, reference)
    eng = llm.engine
    assert eng.kv_cache_manager.num_free_blocks == eng.cache_info.num_usable_blocks


def _matrix_dtypes(llm) -> list[str]:
    import jax.tree_util as tu

    return sorted({str(a.dtype) for a in tu.tree_leaves(llm.engine.runner.model.params) if a.ndim >= 2})


@needs_native_matmul
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_weights_give_bit_identical_results(prompts, dtype):
    """On the native matmul, the Q4_1 projections and the Q8_0 embedding (the tied LM head) run as
    quantized weights with quantization="gguf"; they rebuild the dequantized weights exactly (in
    bfloat16, rounded as the dequantized weights are) and sum in the same order, so tokens and
    logprobs equal those of quantization="none" to the last bit."""
    import jax.numpy as jnp
    import jax.tree_util as tu

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    results, kinds = [], []
    for quantization in ("gguf", "none"):
        llm = LLM(
            quantization=quantization, dtype=dtype, matmul_backend="cpu", precompile=False, max_num_seqs=4
        )
        kinds.append(_matrix_dtypes(llm))
        results.append(
            [
                (o.outputs[0].token_ids, o.outputs[0].logprobs)
                for o in llm.generate(prompts, sp, use_tqdm=False)
            ]
        )
        # The layers' kernels are stacked ([30, P, bytes] each kind), the LM head is one [P, bytes].
        quantized = [a for a in tu.tree_leaves(llm.engine.runner.model.params) if a.dtype == jnp.uint8]
        assert sum(a.shape[0] if a.ndim == 3 else 1 for a in quantized) == (
            30 * 4 + 1 if quantization == "gguf" else 0
        )
    assert kinds == [[dtype, "uint8"], [dtype]]
    assert results[0] == results[1]


@needs_native_matmul
def test_auto_runs_the_weights_where_they_are_fastest():
    """The defaults: in float32 the quantized weights on the native matmul when it was built for
    AVX-512 or AVX2 + FMA (setup.py builds for this CPU), else XLA's dot on the dense weights; in
    bfloat16 the dense weights on the native matmul either way."""
    flags = set(open("/proc/cpuinfo").read().split())
    vectorized = "avx512f" in flags or {"avx2", "fma"} <= flags
    assert native_matmul_vectorized() == vectorized
    float32 = ("cpu", ["float32", "uint8"]) if vectorized else ("xla", ["float32"])
    for dtype, expected in (("float32", float32), ("bfloat16", ("cpu", ["bfloat16"]))):
        llm = LLM(dtype=dtype, precompile=False, max_num_seqs=4)
        assert (llm.engine.runner.model.module.matmul_backend, _matrix_dtypes(llm)) == expected


def test_cli_generate_prints_completion():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxpaged.cli",
            "generate",
            "--chat",
            "--max-tokens",
            "12",
            "What is the capital of France?",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "finish:" in proc.stdout


def test_cli_reports_bad_model_cleanly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpaged.cli", "generate", "--model", str(tmp_path / "nope"), "hi"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2
    assert "jaxpaged: error:" in proc.stderr and "Traceback" not in proc.stderr
