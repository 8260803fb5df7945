"""Sampler cost per step against the model forward, at batch 256 over SmolLM2's 49152-token vocabulary.

The sampler runs on device logits as its own jitted program; its inputs come from
``BatchBuilder.sampling_tensors`` (the host side, timed separately) for requests with
mixed parameters. Logit rows are Gaussian with a per-row scale: sharp rows (scale 5) keep
their top-p nucleus within the sampler's candidate set; flat rows (scale 1) do not and take
the exact bisection path. The forward is a decode step of the SmolLM2-135M shape with random
weights (the engine's default backends, float32). Medians over interleaved repetitions, of wall time and of
process CPU time (steadier than wall time on a shared machine).
``python -m benchmarks.sampler``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.pool_scaling import decode_batch, smollm2_model
from jaxpaged.model_runner import ModelRunner
from jaxpaged.step_programs import sample_fn
from jaxpaged.request import Request
from jaxpaged.sampling_params import SamplingParams

VOCAB = 49152


def requests(kind: str, batch: int, context: int, rng: np.random.Generator) -> list[Request]:
    """``batch`` decoding requests whose parameters follow ``kind``."""

    def params(i: int) -> SamplingParams:
        if kind == "greedy":
            return SamplingParams(temperature=0.0)
        if kind == "random":
            return SamplingParams(temperature=0.8)
        # mixed: a quarter greedy; the rest with assorted filters, penalties, bias and logprobs.
        return SamplingParams(
            temperature=0.0 if i % 4 == 0 else float(rng.choice([0.7, 1.0])),
            top_k=int(rng.choice([-1, 20, 50])),
            top_p=float(rng.choice([1.0, 0.9, 0.95])),
            min_p=float(rng.choice([0.0, 0.05])),
            repetition_penalty=1.1 if i % 4 == 1 else 1.0,
            frequency_penalty=0.5 if i % 8 == 2 else 0.0,
            logit_bias={int(t): 2.0 for t in rng.integers(0, VOCAB, 3)} if i % 8 == 3 else None,
            logprobs=5 if i % 4 == 3 else None,
        )

    reqs = []
    for i in range(batch):
        r = Request(
            str(i), rng.integers(0, VOCAB, context // 2).tolist(), params(i), max_tokens=context, seed=i
        )
        r.output_token_ids = rng.integers(0, VOCAB, context // 2).tolist()
        if r.sampling_params.logprobs is not None:
            r.output_top_logprobs = []
        reqs.append(r)
    return reqs


def timed(fn, reps: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each of ``reps`` calls."""
    out = []
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn())
        out.append((time.perf_counter() - t, time.process_time() - c))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all cases")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per case and round")
    args = ap.parse_args()
    B, rng = args.batch, np.random.default_rng(0)

    scale = np.where(np.arange(B) % 2 == 0, 5.0, 1.0).astype(np.float32)[:, None]
    logits = {
        "sharp": jnp.asarray(rng.normal(size=(B, VOCAB)).astype(np.float32) * 5.0),
        "half flat": jnp.asarray(rng.normal(size=(B, VOCAB)).astype(np.float32) * scale),
    }
    model = smollm2_model()
    per_req = -(-args.context // args.block_size)
    runner = ModelRunner(
        model,
        num_blocks=B * per_req + 1,
        block_size=args.block_size,
        dtype=jnp.float32,
        max_num_batched_tokens=max(512, B),
        max_num_seqs=B,
        max_model_len=8192,
    )
    cases = {}  # name -> (logits, SamplingTensors on device, flags)
    host_ms = {}
    for kind, logit_kind in [
        ("greedy", "sharp"),
        ("random", "sharp"),
        ("mixed", "sharp"),
        ("mixed", "half flat"),
    ]:
        reqs = requests(kind, B, args.context, rng)
        slots = runner.slots.slots(reqs)  # the persistent batch's rows, written once per sequence
        seq_lens = np.full(B, args.context, np.int32)
        t = time.perf_counter()
        st, flags = runner.batches.sampling_tensors(reqs, slots, seq_lens, B, [])
        name = f"{kind}, {logit_kind} logits"
        host_ms[name] = (time.perf_counter() - t) * 1e3
        cases[name] = (logits[logit_kind], jax.device_put(st), flags)
        runner.slots.update([], [r.request_id for r in reqs])
    targets = jnp.zeros(0, jnp.int32)
    batch = runner.prepare(decode_batch(B, args.context, args.block_size))
    runner.collect(runner.run_batch(batch))  # its block tables written to the device

    fns = {"model forward (decode)": lambda: runner.forward(batch)}
    fns.update(
        {
            name: (lambda c=c: sample_fn(c[0], c[1], targets, flags=c[2], num_token_slots=B))
            for name, c in cases.items()
        }
    )
    for fn in fns.values():
        timed(fn, 1)  # compile and warm up
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            times[name] += timed(fn, args.reps)
    wall = {k: statistics.median(w for w, _ in v) * 1e3 for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) * 1e3 for k, v in times.items()}
    fwd = "model forward (decode)"
    print(
        f"batch {B}, vocabulary {VOCAB}, decode context {args.context}, SmolLM2-135M shape, float32, "
        f"{jax.device_count()} {jax.default_backend()} device(s)"
    )
    print(f"{'step part':<34} {'wall ms':>8} {'% fwd':>6} {'CPU ms':>8} {'% fwd':>6}")
    for name in fns:
        print(
            f"{name:<34} {wall[name]:>8.1f} {100 * wall[name] / wall[fwd]:>5.1f}% "
            f"{cpu[name]:>8.1f} {100 * cpu[name] / cpu[fwd]:>5.1f}%"
        )
    print("host-side sampling arrays (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in host_ms.items()))
    print(json.dumps({"wall_ms": wall, "cpu_ms": cpu, "host_ms": host_ms}))


if __name__ == "__main__":
    main()
