"""Paged-attention kernel benchmarks, the decode roofline, and accelerator compile checks.

``python -m benchmarks.kernels``                  time attention backends per call on this platform
``python -m benchmarks.kernels --roofline``       decode bytes/FLOPs table for docs/roofline.md
``python -m benchmarks.kernels --compile-check``  compile the TPU kernel with libtpu and the GPU kernel
                                                  with Triton, without an accelerator

On CPU the Pallas kernel runs in interpret mode (a Python-built XLA loop), so its timings say
nothing about GPU/TPU speed; ``cpu`` is the native C++ kernel. The table adds the platform
kernel's (``cpu`` or ``pallas``) achieved GB/s of live K/V and queries and its attention GFLOP/s;
on a GPU/TPU also the share of the HBM peak. ``--quick`` leaves out the slow backends (the jnp
reference, and the Pallas interpreter on CPU).

The pages come from memory, as in a model step, where each layer's attention reads pages that the
other layers' work has long evicted from the caches: the pool holds enough layers of pages
(``layers``, at least ``COLD_BYTES`` of them) and each call reads the next layer; each row's pages
are one run of consecutive blocks, as the engine's block pool hands them out. ``--hot`` times one
layer's pages called again and again, which stay in the last-level cache when they fit (the kernel's
arithmetic and loop without memory stalls), ``--scattered`` block ids shuffled over the pool (tables
after much churn). A prefill chunk's own keys were written just before its attention in a step, so
its figure from memory is a bound; ``--hot`` is closer there. On the 2-core Zen 4 (three alternating
runs), decode 64 x 256 read 23-28 GB/s from memory, 22-23 scattered, 33-36 hot: a model step sees
the first (21-25 GB/s in SmolLM2's decode steps, from a profile).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import COLD_BYTES

# ----------------------------------------------------------------------------- roofline


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    tied: bool

    @property
    def layer_matmul_params(self) -> int:
        """q, k, v, o projections and the gated MLP (gate, up, down); no biases."""
        q = self.q_heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.mlp

    @property
    def matmul_params(self) -> int:
        """Parameters every decode step multiplies with: all layers plus the LM head."""
        return self.layers * self.layer_matmul_params + self.vocab * self.hidden

    @property
    def params(self) -> int:
        embed = 0 if self.tied else self.vocab * self.hidden
        norms = (2 * self.layers + 1) * self.hidden
        return self.matmul_params + embed + norms

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of one token over all layers."""
        return self.layers * 2 * self.kv_heads * self.head_dim * 2


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes_per_s: float
    bf16_flops: float
    hbm_bytes: float


MODELS = (
    ModelShape(
        "SmolLM2-135M",
        layers=30,
        hidden=576,
        q_heads=9,
        kv_heads=3,
        head_dim=64,
        mlp=1536,
        vocab=49152,
        tied=True,
    ),
    ModelShape(
        "Llama-3-8B",
        layers=32,
        hidden=4096,
        q_heads=32,
        kv_heads=8,
        head_dim=128,
        mlp=14336,
        vocab=128256,
        tied=False,
    ),
)
CHIPS = (
    Chip("H100 SXM", hbm_bytes_per_s=3.35e12, bf16_flops=989e12, hbm_bytes=80e9),
    Chip("TPU v5e", hbm_bytes_per_s=819e9, bf16_flops=197e12, hbm_bytes=16e9),
)


def decode_step(model: ModelShape, chip: Chip, batch: int, context: int) -> dict:
    """Bytes and FLOPs of one bf16 decode step: ``batch`` sequences, each attending to ``context`` tokens.

    Bytes: every weight once (the input embedding only for the looked-up rows), the K/V of the
    live context, and the new tokens' K/V writes. Activations are left out (a few MB at most).
    FLOPs: 2 per weight per token for the matmuls; 4 * Hq * D per context token per layer for
    QK^T and PV.
    """
    weights = 2 * (model.params - (0 if model.tied else model.vocab * model.hidden) + batch * model.hidden)
    kv_read = batch * context * model.kv_bytes_per_token
    kv_write = batch * model.kv_bytes_per_token
    matmul_flops = 2 * batch * model.matmul_params
    attn_flops = 4 * batch * context * model.layers * model.q_heads * model.head_dim
    t_mem = (weights + kv_read + kv_write) / chip.hbm_bytes_per_s
    t_flops = (matmul_flops + attn_flops) / chip.bf16_flops
    t = max(t_mem, t_flops)
    resident = 2 * model.params + batch * context * model.kv_bytes_per_token
    return dict(
        model=model.name,
        chip=chip.name,
        batch=batch,
        context=context,
        weight_gb=weights / 1e9,
        kv_gb=(kv_read + kv_write) / 1e9,
        matmul_gflop=matmul_flops / 1e9,
        attn_gflop=attn_flops / 1e9,
        t_mem_ms=t_mem * 1e3,
        t_flops_ms=t_flops * 1e3,
        bound="memory" if t_mem >= t_flops else "compute",
        tokens_per_s=batch / t,
        attn_share=kv_read / (weights + kv_read + kv_write),
        fits=resident <= chip.hbm_bytes,
    )


def roofline_table() -> str:
    """Markdown table of ``decode_step`` over both models, both chips, batch 1/32/256 and context 512/4096."""
    head = (
        "| model | chip | batch | context | weights GB | KV GB | matmul GFLOP | attn GFLOP | "
        "t_mem ms | t_flop ms | bound | tokens/s ≤ | KV share of bytes | fits HBM |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for model in MODELS:
        for chip in CHIPS:
            for batch in (1, 32, 256):
                for context in (512, 4096):
                    r = decode_step(model, chip, batch, context)
                    lines.append(
                        f"| {r['model']} | {r['chip']} | {batch} | {context} | {r['weight_gb']:.3f} | "
                        f"{r['kv_gb']:.3f} | {r['matmul_gflop']:.1f} | {r['attn_gflop']:.2f} | "
                        f"{r['t_mem_ms']:.3f} | {r['t_flops_ms']:.3f} | {r['bound']} | "
                        f"{r['tokens_per_s']:,.0f} | {r['attn_share']:.0%} | {'yes' if r['fits'] else 'no'} |"
                    )
    return "\n".join(lines)


def ridge_points() -> str:
    rows = [
        f"- {c.name}: {c.bf16_flops / c.hbm_bytes_per_s:.0f} FLOP/byte (bf16 peak / HBM bandwidth)"
        for c in CHIPS
    ]
    rows += [
        f"- {m.name} decode attention: {m.q_heads // m.kv_heads} FLOP/byte "
        f"(4*Hq*D FLOPs per 2*2*Hkv*D bytes of K/V = Hq/Hkv)"
        for m in MODELS
    ]
    return "\n".join(rows)


# ------------------------------------------------------------------------------ timing

PEAK_HBM = {
    "H100": 3.35e12,
    "A100": 2.0e12,
    "TPU v5 lite": 819e9,
    "TPU v5": 2.76e12,
    "TPU v6 lite": 1.64e12,
    "TPU v4": 1.23e12,
}


def _peak_bandwidth(device_kind: str) -> float | None:
    for kind, bw in sorted(PEAK_HBM.items(), key=lambda kv: -len(kv[0])):
        if kind in device_kind:
            return bw
    return None


def _batch(
    rows: list[tuple[int, int]],
    *,
    block_size: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype,
    seed: int = 0,
    cold: bool = False,
    scattered: bool = False,
):
    """Device arrays for one ragged batch (a pool with a few spare blocks). ``scattered``: the block ids
    shuffled over the pool; else each row's pages one run of consecutive ids, the rows one after another,
    as the engine's block pool lays out the tables of sequences admitted together. ``cold``: the pool holds
    at least ``COLD_BYTES`` of layers (each with the same pages), for calls that each read the next layer
    from memory; else one layer."""
    import jax.numpy as jnp

    from jaxpaged.kernels.metadata import AttentionMetadata, build_prefill_tiles, num_prefill_tiles

    rng = np.random.default_rng(seed)
    q_lens = np.array([r[0] for r in rows], np.int32)
    ctx = np.array([r[1] for r in rows], np.int32)
    pages = -(-ctx // block_size)
    num_blocks = int(pages.sum()) + 8
    ids = (
        rng.permutation(num_blocks).astype(np.int32)
        if scattered
        else np.arange(1, num_blocks, dtype=np.int32)
    )
    bt = np.zeros((len(rows), int(pages.max())), np.int32)
    offsets = np.concatenate([[0], np.cumsum(pages)])
    for r in range(len(rows)):
        bt[r, : pages[r]] = ids[offsets[r] : offsets[r + 1]]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    T = int(qsl[-1])
    tiles = build_prefill_tiles(qsl, 32, num_prefill_tiles(qsl, 32))  # decode-only: no prefill pass
    md = AttentionMetadata(
        slot_mapping=jnp.full((T,), -1, jnp.int32),
        block_tables=jnp.asarray(bt),
        seq_lens=jnp.asarray(ctx),
        query_start_loc=jnp.asarray(qsl),
        tile_row=jnp.asarray(tiles[0]),
        tile_start=jnp.asarray(tiles[1]),
        tile_len=jnp.asarray(tiles[2]),
        tile_size=32,
    )
    one_layer = rng.standard_normal((1, 2, num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    layers = max(1, -(-COLD_BYTES // (one_layer.size * jnp.dtype(dtype).itemsize))) if cold else 1
    kv = jnp.asarray(np.broadcast_to(one_layer, (layers, *one_layer.shape[1:])), dtype)
    q = jnp.asarray(rng.standard_normal((T, q_heads, head_dim)), dtype)
    live_bytes = int(ctx.sum()) * 2 * kv_heads * head_dim * kv.dtype.itemsize + 2 * q.nbytes
    # QK^T and PV: 4 * Hq * D per (query token, visible key); token i of a chunk of n sees ctx - n + i + 1 keys.
    visible = sum(n * (c - n) + n * (n + 1) // 2 for n, c in zip(q_lens.tolist(), ctx.tolist()))
    return q, kv, md, live_bytes, 4 * q_heads * head_dim * visible


def _time_call(call, iters: int, min_seconds: float = 0.5) -> float:
    """Median seconds of ``call(i)``, the ``i``-th call, after one warm-up (compile) call ``call(0)``: ``iters``
    calls, and more until ``min_seconds`` have passed, so that a fast kernel's median is of many calls (on a
    shared 2-core VM five calls of a 1-ms kernel spread 2x) while a slow backend (the Pallas interpreter)
    still takes only ``iters``."""
    call(0).block_until_ready()
    times = []
    while len(times) < iters or sum(times) < min_seconds:
        t = time.perf_counter()
        call(len(times) + 1).block_until_ready()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _each_layer_in_turn(fn, q, kv, md):
    """``call(i)`` for ``_time_call``: ``fn`` on layer ``i`` of the pool ``kv``, cycling over its layers (the
    layer ids made on the device once, so no call pays a host transfer for its own)."""
    import jax.numpy as jnp

    layer_ids = [jnp.int32(layer) for layer in range(kv.shape[0])]
    return lambda i: fn(q, kv, layer_ids[i % len(layer_ids)], md)


def time_backends(
    iters: int, quick: bool, block_size: int, hot: bool = False, scattered: bool = False
) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxpaged.kernels.dispatch import paged_attention
    from jaxpaged.kernels.reference import ragged_paged_attention_reference

    platform = jax.default_backend()
    device = jax.devices()[0]
    peak = _peak_bandwidth(device.device_kind)
    on_cpu = platform == "cpu"
    dtype = jnp.float32 if on_cpu else jnp.bfloat16
    from jaxpaged.kernels.cpu_attention import native_kernel_available

    kernel = "cpu" if on_cpu else "pallas"  # the platform's own kernel: the one the figures below are for
    if on_cpu and not native_kernel_available():
        kernel = None
    slow = ["pallas_interpret", "reference"] if on_cpu else ["reference"]
    backends = [b for b in (kernel, "xla", *slow) if b is not None and not (quick and b in slow)]
    shapes = dict(block_size=block_size, q_heads=9, kv_heads=3, head_dim=64)  # SmolLM2-135M attention
    # (kind, rows, context): decode rows of one token; one prefill chunk of `context` tokens from
    # position 0; 448 prompt tokens next to `rows` decode rows (one chunked-prefill step).
    workloads = [
        ("decode", 1, 2048),
        ("decode", 8, 256),
        ("decode", 64, 256),
        ("decode", 64, 512),
        ("prefill", 1, 512),
        ("mixed +448", 64, 256),
    ]
    if not on_cpu:
        workloads += [("decode", 256, 4096)]
    print(
        f"platform: {platform} ({device.device_kind}), dtype {jnp.dtype(dtype).name}, "
        f"attention Hq={shapes['q_heads']} Hkv={shapes['kv_heads']} D={shapes['head_dim']} "
        f"block_size={shapes['block_size']}"
    )
    if on_cpu:
        print(
            "CPU: cpu is the native C++ kernel (the default CPU backend); pallas_interpret is the Pallas "
            "kernel run by the interpreter, its timings are not "
            "representative of GPU/TPU kernels."
        )
    print(
        (
            "pages from one layer called again and again (--hot)"
            if hot
            else f"pages from memory: each call reads the next of `layers` layers of pages (at least "
            f"{COLD_BYTES >> 20} MiB), as a model step does"
        )
        + (
            "; block ids shuffled over the pool (--scattered)"
            if scattered
            else "; each row's pages one run of consecutive blocks, as the engine allocates them"
        )
    )
    header = f"{'workload':<12}{'rows':>6}{'context':>8}{'layers':>8}  " + "".join(
        f"{b:>18}" for b in backends
    )
    if kernel is not None:
        header += f"    {kernel} GB/s" + (" (% of peak)" if peak else "") + "  GFLOP/s"
    print(header)
    results = []
    for kind, batch, context in workloads:
        if kind == "decode":
            rows = [(1, context)] * batch
        elif kind == "prefill":
            rows = [(context, context)]
        else:
            rows = [(1, context)] * batch + [(448, 448)]
        q, kv, md, live_bytes, flops = _batch(rows, dtype=dtype, cold=not hot, scattered=scattered, **shapes)
        layers = kv.shape[0]
        cells = []
        results.append(
            {
                "platform": platform,
                "device": device.device_kind,
                "workload": kind,
                "batch": batch,
                "context": context,
                "layers": layers,
                "live_bytes": live_bytes,
                "attention_flops": flops,
                "ms": {},
                "kernel": kernel,
                "peak_gb_s": peak / 1e9 if peak else None,
            }
        )
        for backend in backends:
            if backend == "reference":
                fn = jax.jit(functools.partial(ragged_paged_attention_reference, scale=0.125))
            else:
                fn = jax.jit(functools.partial(paged_attention, backend=backend, scale=0.125))
            sec = _time_call(_each_layer_in_turn(fn, q, kv, md), iters=iters)
            cells.append(f"{sec * 1e3:>15.3f} ms")
            results[-1]["ms"][backend] = sec * 1e3
        line = f"{kind:<12}{batch:>6}{context:>8}{layers:>8}  " + "".join(cells)
        if kernel is not None:
            sec = results[-1]["ms"][kernel] / 1e3
            gbs = live_bytes / sec / 1e9
            line += f"    {gbs:8.1f}" + (f" ({live_bytes / sec / peak:.0%})" if peak else "")
            line += f"  {flops / sec / 1e9:7.1f}"
            results[-1]["achieved_gb_s"] = gbs
            results[-1]["achieved_gflop_s"] = flops / sec / 1e9
        print(line)
    return results


# ------------------------------------------------------------------------ compile checks

_TPU_CHECK = r"""
import functools, sys
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding
from jaxpaged.kernels.metadata import AttentionMetadata
from jaxpaged.kernels.ragged_paged_attention import ragged_paged_attention

failed = 0
for topology in ("v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2"):
    dev = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(dev))
    T, R, W, NB = 256, 64, 64, 8192
    md = AttentionMetadata(sds((T,), jnp.int32), sds((R, W), jnp.int32), sds((R,), jnp.int32),
                           sds((R + 1,), jnp.int32), sds((8,), jnp.int32), sds((8,), jnp.int32),
                           sds((8,), jnp.int32), 32)
    for hq, hkv, d, bs, dtype in ((9, 3, 64, 16, jnp.bfloat16), (32, 8, 128, 16, jnp.bfloat16),
                                   (32, 8, 128, 32, jnp.float32), (8, 8, 128, 8, jnp.bfloat16)):
        for window, cap in ((None, None), (256, 30.0)):
            f = functools.partial(ragged_paged_attention, scale=0.125, sliding_window=window, soft_cap=cap)
            name = (f"{dev.device_kind} Hq={hq} Hkv={hkv} D={d} bs={bs} {jnp.dtype(dtype).name} "
                    f"window={window} cap={cap}")
            try:
                jax.jit(f).trace(sds((T, hq, d), dtype), sds((2, 2, NB, bs, hkv, d), dtype),
                                 sds((), jnp.int32), md).lower().compile()
                print("compiled", name, flush=True)
            except Exception as e:  # report every configuration, not just the first failure
                failed += 1
                print("FAILED", name, str(e).splitlines()[0][:300], flush=True)
sys.exit(1 if failed else 0)
"""

_GPU_CHECK = r"""
import functools, sys, tempfile
import jax, jax.numpy as jnp, numpy as np
from jax._src.pallas.triton import pallas_call_registration
import triton
from triton.backends.compiler import GPUTarget
from benchmarks.kernels import _batch
from jaxpaged.kernels.ragged_paged_attention import ragged_paged_attention

modules = []
lower = pallas_call_registration.lowering.lower_jaxpr_to_triton_module
def capture(*args, **kwargs):
    result = lower(*args, **kwargs)
    modules.append(result.module)
    return result
pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture

failed = 0
for hq, hkv, d, bs, dtype in ((9, 3, 64, 16, jnp.bfloat16), (32, 8, 128, 16, jnp.bfloat16),
                               (32, 8, 128, 32, jnp.float32), (8, 8, 128, 8, jnp.bfloat16)):
    q, kv, md, _, _ = _batch([(1, 300), (40, 100)], block_size=bs, q_heads=hq, kv_heads=hkv, head_dim=d, dtype=dtype)
    f = functools.partial(ragged_paged_attention, scale=0.125, sliding_window=256, soft_cap=30.0)
    jax.jit(f).trace(q, kv, jnp.int32(0), md).lower(lowering_platforms=("cuda",))
    with tempfile.NamedTemporaryFile("w", suffix=".ttir") as ttir:
        ttir.write(modules[-1].operation.get_asm())
        ttir.flush()
        for cc in (80, 90):
            name = f"sm_{cc} Hq={hq} Hkv={hkv} D={d} bs={bs} {jnp.dtype(dtype).name}"
            try:
                k = triton.compile(ttir.name, target=GPUTarget("cuda", cc, 32),
                                   options=dict(num_warps=4, num_stages=2))
                print("compiled", name, f"cubin {len(k.asm['cubin'])} B, shared memory {k.metadata.shared} B",
                      flush=True)
            except Exception as e:
                failed += 1
                print("FAILED", name, str(e).splitlines()[0][:300], flush=True)
sys.exit(1 if failed else 0)
"""


def compile_check(libtpu_dir: str | None, triton_dir: str | None) -> int:
    """Compile for real targets from a CPU host, each in a subprocess with the extra package on its path.

    TPU: jax's deviceless AOT path (``jax.experimental.topologies``) with libtpu runs Mosaic's
    full pipeline for v4/v5e/v5p/v6e. libtpu must match jax (``libtpu==0.0.42.*`` for jax
    0.10.2); install it into a separate directory (``pip install --target DIR``) so that
    ordinary runs do not try to start a TPU backend. GPU: the Pallas Triton IR is compiled to a
    cubin with the ``triton`` package (which ships ptxas); XLA's bundled Triton may differ in
    version. Returns the number of failed checks.
    """
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    failures = 0
    checks = (
        (
            "TPU (libtpu)",
            libtpu_dir,
            _TPU_CHECK,
            dict(
                TPU_SKIP_MDS_QUERY="1",
                TPU_ACCELERATOR_TYPE="v5litepod-4",
                TPU_WORKER_HOSTNAMES="localhost",
                TPU_WORKER_ID="0",
            ),
        ),
        ("GPU (triton)", triton_dir, _GPU_CHECK, {}),
    )
    for name, extra_path, script, env in checks:
        print(f"== {name}", flush=True)
        if extra_path is None:
            print("skipped: pass the directory that holds the package")
            continue
        env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([extra_path, repo])}
        failures += subprocess.run([sys.executable, "-c", script], env=env, cwd=repo).returncode != 0
    return failures


def main(argv: list[str] | None = None) -> int:
    from jaxpaged.config import EngineArgs

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--roofline", action="store_true", help="print the decode roofline table")
    parser.add_argument("--compile-check", action="store_true", help="compile for TPU/GPU without devices")
    parser.add_argument("--libtpu", help="directory holding the libtpu package (for --compile-check)")
    parser.add_argument("--triton", help="directory holding the triton package (for --compile-check)")
    parser.add_argument(
        "--iters",
        type=int,
        default=5,
        help="timed calls per backend and workload, at least; more until 0.5 s of calls",
    )
    parser.add_argument("--block-size", type=int, default=EngineArgs.block_size, help="default: the engine's")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="leave out the slow backends (jnp reference; Pallas interpreter on CPU)",
    )
    parser.add_argument(
        "--hot",
        action="store_true",
        help="call each workload on one layer's pages, kept in cache (default: from memory)",
    )
    parser.add_argument(
        "--scattered",
        action="store_true",
        help="shuffle the block ids over the pool (default: each row's pages one run)",
    )
    args = parser.parse_args(argv)
    if args.roofline:
        print(ridge_points())
        print()
        print(roofline_table())
        return 0
    if args.compile_check:
        return 1 if compile_check(args.libtpu, args.triton) else 0
    rows = time_backends(args.iters, args.quick, args.block_size, hot=args.hot, scattered=args.scattered)
    from benchmarks.common import write_json

    write_json("kernels", {"args": vars(args), "rows": rows})
    plot(rows)
    return 0


def plot(rows: list[dict]) -> Path:
    """Left: each backend's median ms per call for every workload (log scale). Right: the platform kernel's
    achieved GB/s of live K/V and queries, with the device's peak bandwidth where it is known (GPU/TPU)."""
    from benchmarks.common import new_figure, save_figure

    fig, (ax_ms, ax_bw) = new_figure(ncols=2, width=7.0)
    x = np.arange(len(rows))
    labels = [f"{r['workload']}\n{r['batch']} x {r['context']}" for r in rows]
    backends = list(dict.fromkeys(b for r in rows for b in r["ms"]))
    width = 0.8 / max(1, len(backends))
    for i, backend in enumerate(backends):
        ax_ms.bar(
            x + (i - (len(backends) - 1) / 2) * width,
            [r["ms"].get(backend, np.nan) for r in rows],
            width,
            label=backend,
        )
    ax_ms.set_yscale("log")
    ax_ms.set_xticks(x, labels)
    ax_ms.set(ylabel="ms per call (median)", title=f"paged attention on {rows[0]['device']}")
    ax_ms.legend()
    ax_bw.bar(x, [r.get("achieved_gb_s", np.nan) for r in rows])
    peak = rows[0].get("peak_gb_s")
    if peak:
        ax_bw.axhline(peak, color="k", linestyle="--", label="peak bandwidth")
        ax_bw.legend()
    ax_bw.set_xticks(x, labels)
    kernel = rows[0]["kernel"]
    ax_bw.set(
        ylabel="GB/s of live K/V and queries",
        title=f"{kernel} kernel's achieved bandwidth" if kernel else "no platform kernel built",
    )
    return save_figure(fig, "kernels")


if __name__ == "__main__":
    sys.exit(main())
