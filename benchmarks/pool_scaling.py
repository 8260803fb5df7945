"""Decode-step time against KV pool size: the pool is donated and written in place, so a step's
cost must not grow when the pool does.

Uses SmolLM2-135M's shape with random weights (step time does not depend on weight values), the
engine's default backends (``--attention-backend``, ``--matmul-backend``), and runs pool sizes in
alternation, quoting medians. ``python -m benchmarks.pool_scaling``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax.numpy as jnp

from jaxpaged.config import EngineArgs
from jaxpaged.model_runner import ModelRunner
from jaxpaged.request import Request
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.scheduler_output import SchedulerOutput
from jaxpaged.models.params import pack_for_matmul_backend
from jaxpaged.models.llama import LlamaArchConfig, LlamaForCausalLM, init_params
from jaxpaged.models.registry import BuiltModel, ModelShape
from jaxpaged.kernels import resolve_backend, resolve_matmul_backend

SMOLLM2 = LlamaArchConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    qkv_bias=False,
    o_bias=False,
    mlp_bias=False,
    rope_theta=100000.0,
)


def smollm2_model(
    dtype=jnp.float32, attention_backend: str = "auto", matmul_backend: str = "auto"
) -> BuiltModel:
    """SmolLM2-135M's shape with random weights, on the given (or the engine's default) backends."""
    attention = resolve_backend(attention_backend, dtype=dtype)
    matmul = resolve_matmul_backend(matmul_backend, dtype=dtype)
    params = pack_for_matmul_backend(init_params(SMOLLM2, dtype), SMOLLM2, dtype, matmul)
    return BuiltModel(
        LlamaForCausalLM(SMOLLM2, dtype, attention, matmul_backend=matmul),
        params,
        ModelShape(30, 3, 64, 49152, 8192),
    )


def decode_batch(batch: int, context: int, block_size: int) -> SchedulerOutput:
    """``batch`` requests, each decoding its token number ``context`` with disjoint blocks."""
    per_req = -(-context // block_size)
    reqs = []
    for i in range(batch):
        r = Request(
            str(i), list(range(1, context + 1)), SamplingParams(temperature=0.0), max_tokens=8, seed=0
        )
        r.block_ids = list(range(1 + i * per_req, 1 + (i + 1) * per_req))
        reqs.append(r)
    return SchedulerOutput(
        requests=reqs,
        num_new_tokens=[1] * batch,
        start_positions=[context - 1] * batch,
        preempted=[],
        samples=[True] * batch,
        num_host_tokens=[1] * batch,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=EngineArgs.block_size, help="default: the engine's")
    ap.add_argument(
        "--base-blocks",
        type=int,
        default=None,
        help="blocks of the 1x pool (default: twice what the batch holds)",
    )
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (A, B, A, B, ...)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--matmul-backend", default="auto")
    args = ap.parse_args()

    needed = args.batch * -(-args.context // args.block_size) + 1
    base_blocks = args.base_blocks or 2 * needed
    if needed > base_blocks:
        raise SystemExit(f"--base-blocks must be at least {needed} for this batch and context")
    model = smollm2_model(attention_backend=args.attention_backend, matmul_backend=args.matmul_backend)
    sizes = {"1x": base_blocks, "4x": 4 * base_blocks}
    out = decode_batch(args.batch, args.context, args.block_size)
    runners = {
        k: ModelRunner(
            model,
            num_blocks=n,
            block_size=args.block_size,
            dtype=jnp.float32,
            max_num_batched_tokens=512,
            max_num_seqs=256,
            max_model_len=8192,
        )
        for k, n in sizes.items()
    }
    for r in runners.values():
        r.collect(r.launch(out))  # compile and warm up
    times: dict[str, list[float]] = {k: [] for k in sizes}
    for _ in range(args.rounds):
        for k, r in runners.items():
            for _ in range(args.steps):
                t = time.perf_counter()
                r.collect(r.launch(out))
                times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(
        f"decode step, batch {args.batch}, context {args.context}, block size {args.block_size}, "
        f"SmolLM2-135M shape, float32, attention {model.module.attention_backend}, "
        f"matmul {model.module.matmul_backend}"
    )
    print(f"{'pool':>6} {'blocks':>7} {'MiB':>8} {'median ms':>10} {'min ms':>8}")
    for k, n in sizes.items():
        mib = runners[k].kv_pages.nbytes / 2**20
        print(f"{k:>6} {n:>7} {mib:>8.0f} {med[k]:>10.1f} {min(times[k]) * 1e3:>8.1f}")
    print(f"ratio 4x / 1x: {med['4x'] / med['1x']:.3f}")
    print(f"compiled step programs: {sum(r.num_compiled_programs for r in runners.values())}")
    print(json.dumps({"median_ms": med, "ratio": med["4x"] / med["1x"]}))


if __name__ == "__main__":
    main()
