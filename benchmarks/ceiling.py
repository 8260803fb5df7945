"""The CPU's ceilings, and how close the native float32 matmul comes to them outside XLA.

Builds ``benchmarks/ceiling.cc`` (the package's own kernel source compiled into a small C++
program, with the flags the package's build uses) and reports:

- the fused multiply-add peak, GFLOP/s on 1 and on all cores (12 independent FMA chains per
  thread on the widest vectors the CPU has): the ceiling of a float32 dense layer;
- the streaming read bandwidth, GB/s on 1 and on all cores (1 GiB): the ceiling of decode
  attention and of dense layers with few rows;
- for each of SmolLM2-135M's projection shapes and each row count M, the dense float32 kernel and
  the 4-bit one (a Q4_1 GGUF's blocks, rebuilt exactly) called directly on a two-thread pool, as
  XLA gives them, with weights from memory (``--hot``: from cache): ms, GFLOP/s, share of the
  FMA peak, and the weight bytes per second of the dense one; medians over ``--rounds`` rounds of
  all shapes, each itself a median of 31 calls;
- the same dense kernel inside XLA: one jitted program of SmolLM2's 30 layers of projections and
  its LM head, at each M from 8 on (what the model's step gets of it).

``benchmarks.matmul`` times the same kernels through JAX (with its per-call cost); this one shows
what the kernel itself reaches. Needs a C++17 compiler (``$CXX``, else ``c++``).

``python -m benchmarks.ceiling [--ms 1,8,16,32,64,128,512] [--hot] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import new_figure, print_table, save_figure, write_json

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152))
MS = (1, 8, 16, 32, 64, 128, 512)


def build(out_dir: Path) -> Path:
    """Compile ceiling.cc (with the native matmul's source) as the package's setup.py compiles it."""
    import jaxlib

    exe = out_dir / "ceiling"
    cmd = [
        os.environ.get("CXX", "c++"),
        "-std=c++17",
        "-O3",
        "-march=native",
        "-fopenmp-simd",
        "-Wno-attributes",
        f"-I{Path(jaxlib.__file__).parent / 'include'}",
        f"-I{ROOT}",
        str(ROOT / "benchmarks" / "ceiling.cc"),
        "-o",
        str(exe),
        "-lpthread",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"building {cmd[-4]} failed:\n{done.stderr}")
    return exe


def _shape_order(item) -> tuple[int, int]:
    (m, k, n), _ = item
    return SHAPES.index((k, n)), m


def run(exe: Path, *args) -> list[list[str]]:
    out = subprocess.run([str(exe), *map(str, args)], check=True, capture_output=True, text=True).stdout
    return [line.split() for line in out.splitlines()]


def chain_gflops(m: int, iters: int = 9) -> float:
    """GFLOP/s of the dense float32 kernel inside XLA: one jitted program running SmolLM2's 30 layers
    of projections (an elementwise op between, as in the model) and its LM head on ``m`` rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpaged.kernels.cpu_matmul import matmul, pack_weight

    rng = np.random.default_rng(0)
    layer_shapes = SHAPES[:4]
    packed = [
        [
            jnp.asarray(pack_weight(rng.standard_normal(s, dtype=np.float32) / 30, np.float32))
            for s in layer_shapes
        ]
        for _ in range(30)
    ]
    head = jnp.asarray(pack_weight(rng.standard_normal(SHAPES[4], dtype=np.float32) / 30, np.float32))

    @jax.jit
    def chain(x, packed, head):
        for qkv, o, gate_up, down in packed:
            x = x + matmul(matmul(x, qkv, 960)[:, :576] * 0.5, o, 576)
            g = matmul(x, gate_up, 3072)
            x = x + matmul(g[:, :1536] * g[:, 1536:], down, 576)
        return matmul(x, head, SHAPES[4][1])

    x = jnp.asarray(rng.standard_normal((m, 576), dtype=np.float32))
    jax.block_until_ready(chain(x, packed, head))
    seconds = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(chain(x, packed, head))
        seconds.append(time.perf_counter() - t)
    flop = 2 * m * (30 * sum(k * n for k, n in layer_shapes) + SHAPES[4][0] * SHAPES[4][1])
    return flop / statistics.median(seconds) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="comma-separated row counts M")
    ap.add_argument("--hot", action="store_true", help="weights from cache (default: rotated through 96 MiB)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all shapes (median per shape and M)")
    args = ap.parse_args(argv)
    ms = [int(m) for m in args.ms.split(",")]
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        peak = {t: float(run(exe, "peak", t)[0][2]) for t in sorted({1, cores})}
        bandwidth = {t: float(run(exe, "bandwidth", t)[0][2]) for t in sorted({1, cores})}
        # Rounds over all shapes, the median of each (shape, M) over the rounds: a burst of other work
        # on the machine slows one round's stretch of shapes, not the result.
        times: dict[tuple[int, int, int], list[tuple[float, float]]] = {}
        for _ in range(args.rounds):
            for k, n in SHAPES:
                for _, m, _, _, dense_ms, quant_ms in run(exe, "gemm", int(not args.hot), k, n, *ms):
                    times.setdefault((int(m), k, n), []).append((float(dense_ms), float(quant_ms)))
    rows = [
        {
            "m": m,
            "k": k,
            "n": n,
            "dense_ms": statistics.median(d for d, _ in v),
            "q4_ms": statistics.median(q for _, q in v),
        }
        for (m, k, n), v in sorted(times.items(), key=_shape_order)
    ]
    top = peak[max(peak)]
    print(
        f"fused multiply-add peak: {', '.join(f'{v:.1f} GFLOP/s on {t} thread(s)' for t, v in peak.items())}"
    )
    print(f"streaming read: {', '.join(f'{v:.1f} GB/s on {t} thread(s)' for t, v in bandwidth.items())}")
    print(
        f"native float32 matmul, called directly on a 2-thread pool, weights {'from cache' if args.hot else 'from memory'}"
    )
    table = []
    for r in rows:
        flop = 2.0 * r["m"] * r["k"] * r["n"]
        r["dense_gflops"], r["q4_gflops"] = flop / r["dense_ms"] / 1e6, flop / r["q4_ms"] / 1e6
        r["dense_weight_gbs"] = r["k"] * r["n"] * 4 / r["dense_ms"] / 1e6
        table.append(
            (
                f"{r['m']} x {r['k']} x {r['n']}",
                r["dense_ms"],
                round(r["dense_gflops"], 1),
                f"{100 * r['dense_gflops'] / top:.0f}%",
                round(r["dense_weight_gbs"], 1),
                r["q4_ms"],
                round(r["q4_gflops"], 1),
                f"{100 * r['q4_gflops'] / top:.0f}%",
            )
        )
    print_table(
        ("M x K x N", "dense ms", "GFLOP/s", "of peak", "weight GB/s", "q4 ms", "q4 GFLOP/s", "of peak"),
        table,
        widths=(20, 10, 9, 8, 12, 9, 11, 8),
    )
    in_xla = {m: chain_gflops(m) for m in ms if m >= 8}
    print(
        "the same kernel inside XLA, SmolLM2's 30 layers of projections and its LM head in one jitted program: "
        + ", ".join(f"{v:.1f} GFLOP/s ({100 * v / top:.0f}%) at {m} rows" for m, v in in_xla.items())
    )
    write_json(
        "ceiling",
        {
            "peak_gflops": peak,
            "bandwidth_gbs": bandwidth,
            "hot": args.hot,
            "gemm": rows,
            "in_xla_gflops": in_xla,
        },
    )
    fig, (ax,) = new_figure()
    for k, n in SHAPES:
        pts = [r for r in rows if (r["k"], r["n"]) == (k, n)]
        ax.plot([r["m"] for r in pts], [r["dense_gflops"] for r in pts], marker="o", label=f"{k} x {n}")
    ax.axhline(top, color="black", linestyle="--", label=f"FMA peak ({top:.0f})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows M")
    ax.set_ylabel("GFLOP/s (float32, dense kernel)")
    ax.legend(fontsize=7)
    save_figure(fig, "ceiling")
    return 0


if __name__ == "__main__":
    sys.exit(main())
