"""Dense matmul ``x[M, K] @ w[K, N]`` on the CPU: XLA's dot vs. the native FFI kernel (pallas_kernels/cpu_matmul).

For each weight shape of SmolLM2-135M (fused qkv 576x960, o 576x576, fused gate/up 576x3072,
down 1536x576, LM head 576x49152) and each M, times one jitted call of XLA float32, XLA bfloat16,
native float32, native bfloat16, and both on the quantized weight (4-bit codes, as a Q4_1 GGUF's; the
weight is a random one quantized that way, so every variant multiplies the same numbers; "q4 x" and
"q4 bf16 x" are the dense native time over the quantized one), and torch bfloat16 with ``--torch``,
in this one process,
alternating the variants call by call, and reports the median ms, GFLOP/s and GB/s of weights
(weight bytes / time: the streaming rate that bounds small M); the JSON also has the fastest call. ``--cold`` cycles through enough
copies of each weight (>= ``COLD_BYTES``) that the weights come from memory, not the 32 MiB L3, as they do
when a model's layers run one after another.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152))
MS = (1, 8, 32, 64, 128, 256, 512)


def _variants(k: int, n: int, m: int, copies: int, with_torch: bool, rng):
    """name -> (function of copy index, weight bytes per copy)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpaged.kernels.cpu_matmul import QUANT_BLOCK, matmul, pack_quantized, pack_weight, use_amx

    # Q4_1 of a random weight: per block of 32 k, codes 0..15 between the block's minimum and maximum.
    w = rng.standard_normal((k, n), dtype=np.float32) / np.sqrt(k)
    blocks = w.reshape(k // QUANT_BLOCK, QUANT_BLOCK, n)
    low = blocks.min(axis=1).astype(np.float16).astype(np.float32)
    scale = ((blocks.max(axis=1) - low) / 15).astype(np.float16).astype(np.float32)
    codes = np.clip(np.rint((blocks - low[:, None]) / np.maximum(scale[:, None], 1e-30)), 0, 15).reshape(k, n)
    w = (codes * np.repeat(scale, QUANT_BLOCK, 0) + np.repeat(low, QUANT_BLOCK, 0)).astype(np.float32)
    x = rng.standard_normal((m, k), dtype=np.float32)
    xla = jax.jit(lambda a, b: a @ b)
    native = jax.jit(matmul, static_argnums=2)
    out = {}
    for dtype, tag in ((jnp.float32, "f32"), (jnp.bfloat16, "bf16")):
        xd = jnp.asarray(x, dtype)
        plain = [jnp.asarray(w, dtype) + 0 for _ in range(copies)]  # + 0: distinct buffers
        packed = [jnp.asarray(pack_weight(w, dtype)) + 0 for _ in range(copies)]
        out[f"xla {tag}"] = (lambda i, xd=xd, ws=plain: xla(xd, ws[i]), plain[0].nbytes)
        out[f"native {tag}"] = (lambda i, xd=xd, ws=packed: native(xd, ws[i], n), plain[0].nbytes)
        quant = [jnp.asarray(pack_quantized(codes, scale, low)) + 0 for _ in range(copies)]
        out[f"native q4 {tag}"] = (lambda i, xd=xd, ws=quant: native(xd, ws[i], n), quant[0].nbytes)
        if tag == "bf16" and use_amx():
            out["native bf16 no-AMX"] = (
                lambda i, xd=xd, ws=packed: _without_amx(lambda: native(xd, ws[i], n)),
                plain[0].nbytes,
            )
    if with_torch:
        import torch

        xt = torch.from_numpy(x).to(torch.bfloat16)
        wts = [torch.from_numpy(w).to(torch.bfloat16) for _ in range(copies)]
        out["torch bf16"] = (lambda i: torch.matmul(xt, wts[i]), wts[0].numel() * 2)
    # Same answer (bfloat16 to within its rounding), checked once before timing.
    ref = x.astype(np.float64) @ w.astype(np.float64)
    for name, (fn, _) in out.items():
        got = np.asarray(fn(0).float() if name.startswith("torch") else fn(0), np.float64)
        tol = 1e-3 if "f32" in name else 4e-2
        err = float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30))
        if err > tol:
            raise AssertionError(f"{name} at {m}x{k}x{n}: max error {err:.2e} of the largest output")
    return out


def _without_amx(call):
    """``call()`` with the native kernel's AMX path off, finished before it is switched back on
    (the kernel reads the switch when it runs, not when it is dispatched)."""
    from jaxpaged.kernels.cpu_matmul import use_amx

    use_amx(False)
    try:
        y = call()
        _block(y)
        return y
    finally:
        use_amx(True)


def _time_alternating(variants: dict, iters: int, copies: int) -> dict[str, list[float]]:
    """Seconds per call of each variant; the variants take turns call by call."""
    times = {name: [] for name in variants}
    for name, (fn, _) in variants.items():  # warm-up: compile, first touch
        _block(fn(0))
    for it in range(iters):
        for name, (fn, _) in variants.items():
            t = time.perf_counter()
            _block(fn(it % copies))
            times[name].append(time.perf_counter() - t)
    return times


def _block(y):
    if hasattr(y, "block_until_ready"):
        y.block_until_ready()


def run(ms, shapes, iters: int, cold: bool, with_torch: bool) -> list[dict]:
    import numpy as np

    from benchmarks.common import COLD_BYTES

    rng = np.random.default_rng(0)
    rows = []
    for k, n in shapes:
        copies = max(1, -(-COLD_BYTES // (k * n * 2))) if cold else 1
        for m in ms:
            if k % 32:
                raise ValueError(f"K={k}: the quantized variant needs K a multiple of 32")
            variants = _variants(k, n, m, copies, with_torch, rng)
            times = _time_alternating(variants, iters, copies)
            row = {"m": m, "k": k, "n": n, "copies": copies}
            for name, ts in times.items():
                sec = statistics.median(ts)
                row[name] = {
                    "ms": sec * 1e3,
                    "min_ms": min(ts) * 1e3,
                    "gflops": 2 * m * k * n / sec / 1e9,
                    "weight_gbs": variants[name][1] / sec / 1e9,
                }
            rows.append(row)
            _print_row(row, header=len(rows) == 1)
            del variants
    return rows


def _print_row(row: dict, header: bool) -> None:
    cols = ["xla f32", "native f32", "native q4 f32", "xla bf16", "native bf16", "native q4 bf16"]
    cols += [c for c in ("native bf16 no-AMX", "torch bf16") if c in row]
    if header:
        print(
            f"{'M x K x N':>18}"
            + "".join(f"{c + ' ms':>17}" for c in cols)
            + f"{'f32 x':>7}{'q4 x':>6}{'bf16 x':>7}{'q4 bf16 x':>10}{'nat f32 GF/s':>13}{'GB/s':>6}{'q4 GB/s':>8}"
            + f"{'nat bf16 GF/s':>14}{'GB/s':>6}"
        )
    shape = f"{row['m']} x {row['k']} x {row['n']}"
    f32x = row["xla f32"]["ms"] / row["native f32"]["ms"]
    q4x = row["native f32"]["ms"] / row["native q4 f32"]["ms"]
    bf16x = row["xla bf16"]["ms"] / row["native bf16"]["ms"]
    q4bf16x = row["native bf16"]["ms"] / row["native q4 bf16"]["ms"]
    print(
        f"{shape:>18}"
        + "".join(f"{row[c]['ms']:>17.3f}" for c in cols)
        + f"{f32x:>7.2f}{q4x:>6.2f}{bf16x:>7.2f}{q4bf16x:>10.2f}{row['native f32']['gflops']:>13.0f}"
        + f"{row['native f32']['weight_gbs']:>6.1f}{row['native q4 f32']['weight_gbs']:>8.1f}"
        + f"{row['native bf16']['gflops']:>14.0f}{row['native bf16']['weight_gbs']:>6.1f}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iters", type=int, default=15, help="timed calls per variant and shape (median)")
    parser.add_argument("--ms", default=",".join(map(str, MS)), help="comma-separated M values")
    parser.add_argument(
        "--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="comma-separated KxN weight shapes"
    )
    parser.add_argument("--cold", action="store_true", help="weights from memory (rotate copies past the L3)")
    parser.add_argument("--torch", action="store_true", help="also time torch bfloat16 (oneDNN)")
    args = parser.parse_args(argv)
    if args.torch:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle torch threads must not spin on XLA's cores
    from jaxpaged.kernels.cpu_matmul import native_matmul_available

    if not native_matmul_available():
        print("the native matmul kernel is not built: python setup.py build_ext --inplace", file=sys.stderr)
        return 1
    ms = [int(v) for v in args.ms.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    load = os.getloadavg()
    print(
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} CPUs; "
        f"{'cold' if args.cold else 'warm'} weights; median of {args.iters}"
    )
    rows = run(ms, shapes, args.iters, args.cold, args.torch)
    from benchmarks.common import UNDER_LOAD, write_json

    write_json("matmul", {"args": vars(args), "load_average": load, "note": UNDER_LOAD, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
