"""Start-up cost of each checkpoint format: SmolLM2 from its GGUF, from an HF safetensors
directory and from a ``jaxpaged convert`` orbax checkpoint (float32 and bfloat16).

The safetensors directory and the orbax checkpoints are made from the GGUF in a temporary
directory (the safetensors through our GGUF loader: float32, HF names). Every measurement runs
in a fresh process, after the files have been read once (warm page cache), and times what
``LLMEngine`` does before it can serve: ``load_checkpoint`` (read), ``build_model`` up to
params on the device (build), and the tokenizer. Imports (jax, jaxpaged, and transformers'
LlamaConfig, whose module pulls in torch when it is installed) are timed apart: every format
pays them.
Medians over ``--repeats`` processes; peak RSS is the process's maximum resident memory.

``python -m benchmarks.load_time [--model smollm2-135m-instruct] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PHASES = ("read", "build", "tokenizer", "total")


def child(model: str, dtype: str) -> dict:
    """One start-up, timed by phase (runs in its own process)."""
    t = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import transformers

    transformers.LlamaConfig  # noqa: B018  (its module imports torch, when installed, and more: 5-10 s here)

    from jaxpaged.tokenizer import Tokenizer
    from jaxpaged.weights import load_checkpoint
    from jaxpaged.models.registry import build_model

    t0 = time.perf_counter()
    ckpt = load_checkpoint(model, dtype=jnp.dtype(dtype))
    t1 = time.perf_counter()
    built = build_model(ckpt.config, ckpt.tensors, jnp.dtype(dtype), "xla", params=ckpt.params)
    jax.block_until_ready(built.params)
    t2 = time.perf_counter()
    Tokenizer.load(ckpt.path)
    t3 = time.perf_counter()
    return {
        "imports": t0 - t,
        "read": t1 - t0,
        "build": t2 - t1,
        "tokenizer": t3 - t2,
        "total": t3 - t0,
        "peak_rss_mib": _peak_rss_mib(),
    }


def _peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss it does not carry over the
    forking parent's peak across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(model: str, dtype: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.load_time", "--child", model, "--dtype", dtype],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
        check=False,
    )
    if proc.returncode:
        raise RuntimeError(f"loading {model} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def prepare(model: str, work: Path) -> list[dict]:
    """The formats to compare, written into ``work``: (label, model argument, dtype, seconds to make)."""
    import numpy as np
    from safetensors.numpy import save_file

    from jaxpaged.weights import convert_checkpoint, load_checkpoint, resolve_model_path
    from jaxpaged.weights.orbax_checkpoint import save_tokenizer

    gguf = resolve_model_path(model)
    t = time.perf_counter()
    ckpt = load_checkpoint(model)
    hf = work / "hf"
    hf.mkdir()
    save_file(
        {k: np.ascontiguousarray(v) for k, v in ckpt.tensors.items()},
        hf / "model.safetensors",
        metadata={"format": "pt"},
    )
    ckpt.config.save_pretrained(hf)
    save_tokenizer(gguf, hf)
    hf_s = time.perf_counter() - t
    del ckpt
    made = [
        {"format": "gguf", "model": str(gguf), "dtype": "float32", "make_s": None},
        {"format": "hf safetensors", "model": str(hf), "dtype": "float32", "make_s": hf_s},
    ]
    for dtype in ("float32", "bfloat16"):
        t = time.perf_counter()
        convert_checkpoint(str(gguf), work / f"orbax-{dtype}", dtype=dtype)
        made.append(
            {
                "format": "orbax",
                "model": str(work / f"orbax-{dtype}"),
                "dtype": dtype,
                "make_s": time.perf_counter() - t,
            }
        )
    for m in made:
        path = Path(m["model"])
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        m["disk_mib"] = sum(f.stat().st_size for f in files) / 2**20
    return made


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help="GGUF file or alias to start from.")
    parser.add_argument(
        "--repeats", type=int, default=3, help="Fresh processes per format (median reported)."
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dtype)))
        return

    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxpaged-load-time-") as tmp:
        for m in prepare(args.model, Path(tmp)):
            runs = [measure(m["model"], m["dtype"]) for _ in range(args.repeats)]
            row = {k: v for k, v in m.items() if k != "model"}
            row.update({k: statistics.median(r[k] for r in runs) for k in runs[0]})
            row["runs"] = runs
            rows.append(row)
            print(f"measured {m['format']} {m['dtype']}: {row['total']:.2f} s", file=sys.stderr)

    base = rows[0]["total"]
    load = os.getloadavg()[0]
    print(
        f"\nStart-up of {args.model} (median of {args.repeats} fresh processes, warm page cache, load average "
        f"{load:.1f} on {os.cpu_count()} CPUs; imports, the same for all, median "
        f"{statistics.median(r['imports'] for r in rows):.1f} s, not included)"
    )
    print(
        "| format | dtype | on disk MiB | made in s | read s | build s | tokenizer s | total s | vs GGUF | "
        "peak RSS MiB |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        made = "-" if r["make_s"] is None else f"{r['make_s']:.1f}"
        print(
            f"| {r['format']} | {r['dtype']} | {r['disk_mib']:.0f} | {made} | {r['read']:.2f} | {r['build']:.2f} | "
            f"{r['tokenizer']:.2f} | {r['total']:.2f} | {base / r['total']:.1f}x | {r['peak_rss_mib']:.0f} |"
        )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "load_time.json"
    out.write_text(
        json.dumps(
            {
                "args": {"model": args.model, "repeats": args.repeats},
                "load_average": load,
                "cpus": os.cpu_count(),
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
