"""One GPU check that fits a 10-minute run: correctness, kernel speed, start-up and throughput on one GPU.

``python -m benchmarks.gpu [--quick] [--budget SECONDS] [--results-dir DIR]`` (or ``jaxpaged bench gpu``)
on a machine with one GPU, with no download: every model is random, built with transformers on the
machine (a tiny Llama, and one of SmolLM2-135M's exact shape), and every prompt is token ids. Sections,
each timed and reported on its own (one that fails prints its error and the run goes on):

* ``device``: the card, the JAX version, and its device-to-device copy bandwidth (bytes read + written
  per second of a large elementwise copy), the yardstick of the kernel figures.
* ``kernel_correctness``: the Pallas kernel, compiled for the platform, on every case of
  ``tests/test_pallas_attention.py`` (float32 within 1e-5 of the jnp reference, bfloat16 within the
  tests' tolerance), and unchanged when every slot outside the live context is NaN.
* ``kernel_times``: paged attention per call at SmolLM2's heads (9 q / 3 kv, head dim 64, block 16,
  bfloat16), Pallas vs the ``xla`` backend, with the K/V bytes read per second and their share of the
  copy bandwidth.
* ``greedy_small`` / ``greedy_big``: the engine's greedy tokens (float32; Pallas and ``xla`` attention
  for the tiny model, Pallas for the SmolLM2-shaped one) against transformers on the same GPU in
  float32 with TF32 off; where tokens diverge, HF's top-1 minus top-2 logprob margin there.
* ``layer_scan``: one forward program of the SmolLM2-shaped model (bfloat16), its layers unrolled (as the
  engine runs them) and as one ``lax.scan`` (``scan_layers``): compile seconds and step time of each, the
  data for choosing the scan on GPUs, where the engine's start-up is mostly compilation.
* ``startup``: the throughput engine (SmolLM2-shaped, bfloat16) started in a new process on a fresh
  compilation cache (cold: load + precompile), then again in another new process on that cache: the
  times, and how many XLA programs each compiled or read from the cache.
* ``throughput``: that engine once more (its programs from the cache), offline ``LLM.generate`` of
  ``benchmarks.workload.synthetic``, and the device's idle share (waiting for the host) of a shorter
  pass, from a ``jax.profiler`` trace.
* ``hf_static``: transformers' ``generate`` with static batches (bfloat16) on the first requests of the
  same workload, as many batches as the section's time allows (at least one).

The run keeps to ``--budget`` seconds (default 450, so that it ends within 8 minutes): a section that
would not fit in what is left is skipped and named. It prints one table last, and writes
``gpu.json`` (after every section, so a cut-off run keeps what it measured) and ``gpu.png`` under
``--results-dir`` (default ``benchmarks/results``). ``--dry-run`` (automatic on CPU) runs the same
sections at tiny sizes with the Pallas kernel interpreted, so the whole script is exercised without a
GPU (``gpu-dry-run.json``); its timings mean nothing. ``benchmarks/gpu_run.sh`` is the command a lent
GPU machine runs (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import numpy as np

# torch shares the GPU with JAX: JAX takes memory as it needs it instead of 75% of the card at start.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    rope_theta=1e5,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
)
TINY_SHAPE = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
HEADS = dict(q_heads=9, kv_heads=3, head_dim=64)  # SmolLM2-135M's attention


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sizes of one run: a GPU's, or the dry run's (tiny, for a CPU)."""

    big_model: dict  # LlamaConfig fields of the "SmolLM2-shaped" model
    kernel_shapes: tuple  # (name, ((query tokens, context), ...)) timed per call
    copy_bytes: int
    greedy_prompts: int
    greedy_tokens: int
    n: int  # throughput requests
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory: int
    profile_n: int  # requests of the traced pass (idle share)
    hf_n: int
    hf_batch: int
    pallas: str  # the Pallas attention backend's name
    interpret: bool  # kernel checks interpret the Pallas kernel (GPU variant)
    cases: tuple[str, ...] | None  # the kernel tests' cases checked (None: all)
    timed_calls: tuple[int, float]  # per kernel shape: calls at least, and more until this many seconds
    lengths: dict  # ``benchmarks.workload.synthetic``'s length parameters
    max_model_len: int
    scan_steps: tuple  # layer_scan's forward programs: (name, rows, tokens per row, context)
    scan_attention: str


def gpu_plan(quick: bool) -> Plan:
    """The issue's sizes: the throughput workload of 1024 requests (``--quick``: 512) and the kernel
    shapes measured before (decode 256 x 512 and 64 x 2048, prefill 4 x 512, mixed)."""
    return Plan(
        big_model=SMOLLM2_SHAPE,
        kernel_shapes=(
            ("decode 256 x 512", ((1, 512),) * 256),
            ("decode 64 x 2048", ((1, 2048),) * 64),
            ("prefill 4 x 512", ((512, 512),) * 4),
            ("mixed 128 x 1024 + 2 x 256", ((1, 1024),) * 128 + ((256, 256),) * 2),
        ),
        copy_bytes=1 << 30,
        greedy_prompts=8 if not quick else 4,
        greedy_tokens=24 if not quick else 16,
        n=1024 if not quick else 512,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        kv_cache_memory=8 << 30,
        profile_n=128,
        hf_n=256 if not quick else 64,
        hf_batch=64,
        pallas="pallas",
        interpret=False,
        cases=None,
        timed_calls=(3, 0.2),
        lengths={},
        max_model_len=512,
        scan_steps=(("decode 256 x 512", 256, 1, 512), ("prefill 4 x 512", 4, 512, 512)),
        scan_attention="pallas",
    )


def dry_plan() -> Plan:
    """Tiny sizes that run every section on a CPU in about a minute."""
    big = dict(
        TINY_SHAPE,
        vocab_size=512,
        hidden_size=96,
        num_attention_heads=3,
        num_key_value_heads=1,
        num_hidden_layers=2,
        tie_word_embeddings=True,
    )
    return Plan(
        big_model=big,
        kernel_shapes=(
            ("decode 4 x 40", ((1, 40),) * 4),
            ("mixed 3 x 50 + 1 x 20", ((1, 50),) * 3 + ((20, 20),)),
        ),
        copy_bytes=16 << 20,
        greedy_prompts=2,
        greedy_tokens=5,
        n=12,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        kv_cache_memory=4 << 20,
        profile_n=4,
        hf_n=4,
        hf_batch=4,
        pallas="pallas_interpret",
        interpret=True,
        cases=("mixed-bs8-d64-gqa1", "window-bs16-d64-gqa3", "bf16-mixed-bs16-d128-gqa4"),
        timed_calls=(1, 0.0),
        lengths=dict(prompt_mean=16, output_mean=16, max_total=64),
        max_model_len=64,
        scan_steps=(("decode 4 x 40", 4, 1, 40),),
        scan_attention="xla",
    )


@dataclasses.dataclass
class Run:
    """What the sections share: the plan, the working directories, the models built so far, the results."""

    plan: Plan
    dry_run: bool
    work: Path
    results_dir: Path
    deadline: float
    results: dict
    models: dict = dataclasses.field(default_factory=dict)

    @property
    def cache_dir(self) -> Path:
        """The start-up and throughput engines' ``cache_dir``: the cold start fills it, the cached start and the
        throughput engine read it. JAX sets its persistent cache up once per process, at the first directory an
        engine names, so the greedy checks' engines name none."""
        return self.work / "cache"

    def left(self) -> float:
        return self.deadline - time.perf_counter()


# ----------------------------------------------------------------------------- helpers


class CompileCounter:
    """XLA executables a block of code obtained (compiled, or read from the persistent cache) and how many
    of them were cache hits, from ``jax.monitoring`` events."""

    def __enter__(self) -> "CompileCounter":
        import jax

        self.programs, self.hits, self.seconds = 0, 0, 0.0

        def on_duration(event: str, duration: float, **_) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                self.programs += 1
                self.seconds += duration

        def on_event(event: str, **_) -> None:
            self.hits += event == "/jax/compilation_cache/cache_hits"

        self._listeners = (on_duration, on_event)
        jax.monitoring.register_event_duration_secs_listener(on_duration)
        jax.monitoring.register_event_listener(on_event)
        return self

    def __exit__(self, *exc) -> None:
        import jax

        jax.monitoring.unregister_event_duration_listener(self._listeners[0])
        jax.monitoring.unregister_event_listener(self._listeners[1])

    def summary(self) -> dict:
        return {"programs": self.programs, "from_cache": self.hits, "compile_s": self.seconds}


def tests_module(name: str):
    """A module of ``tests/`` (the kernel cases, the tiny-model builders): the check reuses the tests' own."""
    sys.path.insert(0, str(ROOT / "tests"))
    return __import__(name)


def torch_device(run: Run) -> str:
    return "cpu" if run.dry_run else "cuda"


def model(run: Run, name: str):
    """``(directory, HF model on the host in float32)`` of the ``small`` (tiny) or ``big`` (SmolLM2-shaped)
    random Llama, saved once per run with the tests' byte-level tokenizer (prompts are token ids)."""
    if name not in run.models:
        tiny_models = tests_module("tiny_models")
        tok = run.work / "tokenizer"
        if not tok.exists():
            tok.mkdir(parents=True)
            tiny_models.save_tokenizer(tok)
        path = run.work / name
        path.mkdir()
        shape = TINY_SHAPE if name == "small" else run.plan.big_model
        run.models[name] = path, tiny_models.save_tiny_llama(path, tok, **shape)
    return run.models[name]


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of 5 to 20 random token ids (none of the first 32, where tokenizers keep special ones)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(32, vocab, int(rng.integers(5, 21))).tolist() for _ in range(n)]


def free_device_memory() -> None:
    """Drop the last section's engines and models so that the next one has the card."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


# ----------------------------------------------------------------------------- device


def copy_bandwidth(nbytes: int) -> float:
    """Bytes read + written per second by a jitted elementwise copy of ``nbytes`` (median of timed calls)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.kernels import _time_call

    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    return 2 * nbytes / _time_call(lambda i: copy(x), iters=10, min_seconds=0.2)


def section_device(run: Run) -> dict:
    import jax

    d = jax.devices()[0]
    return {
        "platform": d.platform,
        "device": d.device_kind,
        "jax": jax.__version__,
        "copy_gb_s": copy_bandwidth(run.plan.copy_bytes) / 1e9,
    }


# ----------------------------------------------------------------------------- kernels


def max_error(out: np.ndarray, ref: np.ndarray, atol: float, rtol: float) -> tuple[float, bool]:
    """Largest ``|out - ref|`` and whether every element is within ``atol + rtol * |ref|`` (NaN fails)."""
    err = np.nan_to_num(np.abs(out - ref), nan=np.inf)
    return float(err.max(initial=0.0)), bool(np.all(err <= atol + rtol * np.abs(ref)))


def section_kernel_correctness(run: Run) -> dict:
    """Every case of the kernel tests, float32 and bfloat16, against the jnp reference (float32 dots)."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.kernels import reference
    from jaxpaged.kernels.ragged_paged_attention import ragged_paged_attention

    t = tests_module("test_pallas_attention")
    variant = dict(variant="gpu", interpret=True) if run.plan.interpret else {}
    rows = []
    for name, case in t.CASES.items():
        if run.plan.cases is not None and name not in run.plan.cases:
            continue
        b = t.build_batch(case)
        kw = t.attn_kwargs(case)
        kernel = jax.jit(functools.partial(ragged_paged_attention, **kw, **variant))
        ref_fn = jax.jit(functools.partial(reference.ragged_paged_attention_reference, **kw))
        layer = jnp.int32(t.LAYER)
        out = np.asarray(kernel(b.q, b.kv, layer, b.md), np.float32)
        ref = np.asarray(ref_fn(b.q, b.kv, layer, b.md), np.float32)
        atol, rtol = (1e-5, 1e-5) if case.dtype == "float32" else (2e-2, 1e-2)
        err, ok = max_error(out, ref, atol, rtol)
        dirty = np.asarray(kernel(b.q, b.kv_poisoned, layer, b.md), np.float32)
        rows.append(
            {
                "case": name,
                "dtype": case.dtype,
                "max_abs_err": err,
                "atol": atol,
                "rtol": rtol,
                "match": ok,
                "nan_safe": bool(np.array_equal(dirty, out)),
            }
        )
    return {"cases": rows, "all_match": all(r["match"] and r["nan_safe"] for r in rows)}


def section_kernel_times(run: Run) -> dict:
    """Per call, K/V from memory (``benchmarks.kernels``' pools): the Pallas kernel and the ``xla`` backend."""
    import jax
    import jax.numpy as jnp

    from benchmarks.kernels import _batch, _each_layer_in_turn, _time_call
    from jaxpaged.kernels.dispatch import paged_attention

    copy = run.results["sections"].get("device", {}).get("copy_gb_s")
    rows = []
    for name, shape in run.plan.kernel_shapes:
        q, kv, md, _, _ = _batch(list(shape), block_size=16, dtype=jnp.bfloat16, cold=True, **HEADS)
        kv_bytes = sum(c for _, c in shape) * 2 * HEADS["kv_heads"] * HEADS["head_dim"] * kv.dtype.itemsize
        row = {"shape": name, "kv_bytes": kv_bytes, "ms": {}}
        for backend in (run.plan.pallas, "xla"):
            fn = jax.jit(functools.partial(paged_attention, backend=backend, scale=HEADS["head_dim"] ** -0.5))
            iters, min_seconds = run.plan.timed_calls
            row["ms"][backend] = 1e3 * _time_call(_each_layer_in_turn(fn, q, kv, md), iters, min_seconds)
        row["pallas_gb_s"] = kv_bytes / row["ms"][run.plan.pallas] / 1e6
        row["share_of_copy"] = row["pallas_gb_s"] / copy if copy else None
        row["pallas_over_xla"] = row["ms"][run.plan.pallas] / row["ms"]["xla"]
        rows.append(row)
    return {"rows": rows}


# ----------------------------------------------------------------------------- greedy agreement


def hf_greedy(hf, prompt: list[int], n: int, device: str) -> tuple[list[int], list[float]]:
    """Greedy tokens of HF's model with its KV cache on ``device``, and each step's top-1 minus top-2 logprob."""
    import torch

    tokens, margins = [], []
    with torch.no_grad():
        out = hf(torch.tensor([prompt], device=device), use_cache=True)
        for _ in range(n):
            lp = torch.log_softmax(out.logits[0, -1].double(), -1)
            top2 = torch.topk(lp, 2).values
            tokens.append(int(torch.argmax(lp)))
            margins.append(float(top2[0] - top2[1]))
            out = hf(
                torch.tensor([[tokens[-1]]], device=device),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    return tokens, margins


def compare_tokens(ours: list[list[int]], theirs: list[list[int]], margins: list[list[float]]) -> dict:
    """Prompts whose tokens are identical, tokens equal up to each prompt's first divergence, and at every
    divergence the reference's margin there (a near-tie explains a divergence; a wide margin is a bug)."""
    divergences = []
    same = 0
    for i, (a, b) in enumerate(zip(ours, theirs)):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None and len(a) == len(b):
            same += 1
        else:
            k = min(len(a), len(b)) if k is None else k
            margin = margins[i][k] if k < len(margins[i]) else None
            divergences.append({"prompt": i, "position": k, "hf_margin": margin})
    return {"prompts": len(theirs), "identical": same, "divergences": divergences}


def engine_greedy(path: Path, prompt_ids: list[list[int]], n: int, attention: str) -> list[list[int]]:
    """The engine's float32 greedy tokens (EOS ignored) for ``prompt_ids``, compiling only the programs it runs."""
    from jaxpaged import LLM, SamplingParams

    llm = LLM(
        model=str(path),
        dtype="float32",
        attention_backend=attention,
        block_size=16,
        max_model_len=64,
        max_num_seqs=len(prompt_ids),
        max_num_batched_tokens=256,
        kv_cache_memory=64 << 20,
        precompile=False,
        enable_prefix_caching=False,
        cache_dir=None,
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompt_ids],
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def greedy_agreement(run: Run, name: str, backends: tuple[str, ...]) -> dict:
    """Each attention backend's engine tokens against HF's on the same device, float32, TF32 off."""
    import torch

    path, hf = model(run, name)
    device = torch_device(run)
    torch.set_float32_matmul_precision("highest")  # no TF32 in HF's float32 matmuls
    torch.backends.cudnn.allow_tf32 = False
    hf = hf.to(device)
    ids = prompts(run.plan.greedy_prompts, 350 if name == "small" else hf.config.vocab_size)
    n = run.plan.greedy_tokens
    reference = [hf_greedy(hf, p, n, device) for p in ids]
    hf.to("cpu")
    out = {}
    for backend in backends:
        ours = engine_greedy(path, ids, n, backend)
        out[backend] = compare_tokens(ours, [r[0] for r in reference], [r[1] for r in reference])
    return out


def section_greedy_small(run: Run) -> dict:
    return greedy_agreement(run, "small", (run.plan.pallas, "xla"))


def section_greedy_big(run: Run) -> dict:
    return greedy_agreement(run, "big", (run.plan.pallas,))


# ----------------------------------------------------------------------------- layer scan


def step_inputs(rows: int, tokens: int, context: int, block_size: int = 16):
    """A forward step's inputs: ``rows`` sequences of ``context`` tokens, the last ``tokens`` of each computed,
    each row's pages its own run of blocks (block 0 is the null block)."""
    from jaxpaged.kernels import AttentionMetadata
    from jaxpaged.kernels.metadata import build_prefill_tiles, num_prefill_tiles

    W = -(-context // block_size)
    T = rows * tokens
    qsl = np.arange(rows + 1, dtype=np.int32) * tokens
    pos = np.tile(np.arange(context - tokens, context, dtype=np.int32), rows)
    row = np.repeat(np.arange(rows, dtype=np.int32), tokens)
    tables = 1 + np.arange(rows * W, dtype=np.int32).reshape(rows, W)
    tiles = build_prefill_tiles(qsl, 32, num_prefill_tiles(qsl, 32))
    md = AttentionMetadata(
        slot_mapping=tables[row, pos // block_size] * block_size + pos % block_size,
        block_tables=tables,
        seq_lens=np.full(rows, context, np.int32),
        query_start_loc=qsl,
        tile_row=tiles[0],
        tile_start=tiles[1],
        tile_len=tiles[2],
        tile_size=32,
    )
    return np.arange(T, dtype=np.int32) % 1000 + 32, pos, md, qsl[1:] - 1, rows * W + 1


def section_layer_scan(run: Run) -> dict:
    """One forward program of the SmolLM2-shaped model (bfloat16, random weights), its layers unrolled (as the
    engine runs them) and as one ``lax.scan`` (``scan_layers``): compile seconds and the step's median ms."""
    import jax
    import jax.numpy as jnp

    from benchmarks.kernels import _time_call
    from jaxpaged.models.decoder import DecoderForCausalLM
    from jaxpaged.models.params import init_params, stack_layers
    from jaxpaged.models.registry import config_from_hf

    _, cfg = config_from_hf(model(run, "big")[1].config)
    dtype = jnp.bfloat16
    per_layer = jax.device_put(init_params(cfg, dtype))
    rows = []
    for name, R, tokens, context in run.plan.scan_steps:
        ids, pos, md, last, num_blocks = step_inputs(R, tokens, context)
        row = {"step": name}
        for scan, params in ((False, per_layer), (True, jax.device_put(stack_layers(per_layer, cfg)))):
            kv = jnp.zeros((cfg.num_layers, 2, num_blocks, 16, cfg.num_kv_heads, cfg.head_dim), dtype)
            fn = jax.jit(
                DecoderForCausalLM(cfg, dtype, run.plan.scan_attention, scan_layers=scan).apply,
                donate_argnums=(3,),
            )
            t = time.perf_counter()
            compiled = fn.lower({"params": params}, ids, pos, kv, md, last).compile()
            key = "scan" if scan else "unrolled"
            row[f"{key}_compile_s"] = time.perf_counter() - t
            state = {"kv": kv}

            def call(_, compiled=compiled, params=params, state=state):
                logits, state["kv"] = compiled({"params": params}, ids, pos, state["kv"], md, last)
                return logits

            row[f"{key}_step_ms"] = 1e3 * _time_call(call, *run.plan.timed_calls)
            del params, state
        rows.append(row)
    return {"attention": run.plan.scan_attention, "rows": rows}


# ----------------------------------------------------------------------------- throughput and start-up


def throughput_engine_args(run: Run) -> dict:
    """The bfloat16 SmolLM2-shaped engine of the start-up and throughput sections."""
    p = run.plan
    return dict(
        model=str(model(run, "big")[0]),
        dtype="bfloat16",
        max_num_seqs=p.max_num_seqs,
        max_num_batched_tokens=p.max_num_batched_tokens,
        max_model_len=p.max_model_len,
        kv_cache_memory=p.kv_cache_memory,
        enable_prefix_caching=False,
        cache_dir=str(run.cache_dir),
    )


def device_idle_share(trace_dir: Path, wall_s: float) -> float | None:
    """1 - (time any device op ran) / ``wall_s``, from a ``jax.profiler`` trace's device timelines (processes
    named ``/device:...``; a CPU run has none: None)."""
    import gzip

    trace = json.load(gzip.open(sorted(trace_dir.glob("plugins/profile/*/*.trace.json.gz"))[-1]))
    devices = {
        e["pid"]
        for e in trace["traceEvents"]
        if e.get("name") == "process_name" and e["args"]["name"].startswith("/device:")
    }
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and e["pid"] in devices
    )
    if not spans:
        return None
    busy, end = 0.0, -np.inf
    for start, stop in spans:  # the union of the spans
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return max(0.0, 1.0 - busy / 1e6 / wall_s)


def traced_pass(llm, reqs, work: Path) -> dict:
    """A shorter ``generate`` under ``jax.profiler``: the device's idle share (waiting for the host)."""
    import jax

    from benchmarks.throughput import jaxpaged_round

    trace_dir = work / "trace"
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True, profiler_options=options)
    try:
        wall = jaxpaged_round(llm, reqs, "traced")
    finally:
        jax.profiler.stop_trace()
    return {"requests": len(reqs), "wall_s": wall, "device_idle_share": device_idle_share(trace_dir, wall)}


def section_throughput(run: Run) -> dict:
    """The engine (its programs from the cache ``startup`` filled), a warm-up pass, the timed workload, then a
    traced pass."""
    from benchmarks.throughput import jaxpaged_round
    from benchmarks.workload import synthetic
    from jaxpaged import LLM

    args = throughput_engine_args(run)
    reqs = synthetic(run.plan.n, seed=0, vocab_size=run.plan.big_model["vocab_size"], **run.plan.lengths)
    with CompileCounter() as start:
        t = time.perf_counter()
        llm = LLM(**args)
        start_s = time.perf_counter() - t
    jaxpaged_round(llm, reqs[: run.plan.max_num_seqs // 4], "warm-up")
    with CompileCounter() as timed:
        seconds = jaxpaged_round(llm, reqs, "timed")
    out_tokens = sum(r.output_len for r in reqs)
    out = {
        "engine_args": {k: v for k, v in args.items() if k != "model"},
        "requests": len(reqs),
        "startup": {
            "total_s": start_s,
            "load_s": llm.engine.load_time,
            "precompile_s": llm.engine.warmup_time,
            "step_programs": llm.engine.runner.num_compiled_programs,
            **start.summary(),
        },
        "seconds": seconds,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / seconds,
        "req_s": len(reqs) / seconds,
        "programs_compiled_while_timed": timed.summary()["programs"],
        "preemptions": llm.engine.scheduler.num_preemptions,
    }
    if run.left() > 30:
        try:
            out["traced"] = traced_pass(llm, reqs[: run.plan.profile_n], run.work)
        except Exception as e:  # the trace is a bonus: its failure keeps the figures above
            traceback.print_exc()
            out["traced"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    return out


def startup_child(engine_args: dict) -> dict:
    """In a new process: start the engine and report its start-up and where its programs came from."""
    from jaxpaged import LLM

    with CompileCounter() as counter:
        t = time.perf_counter()
        llm = LLM(**engine_args)
        total = time.perf_counter() - t
    return {
        "total_s": total,
        "load_s": llm.engine.load_time,
        "precompile_s": llm.engine.warmup_time,
        "step_programs": llm.engine.runner.num_compiled_programs,
        **counter.summary(),
    }


def start_in_new_process(run: Run, engine_args: dict) -> dict:
    """``startup_child`` in a new Python process (as a user starts the engine), within the budget."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--startup-child", json.dumps(engine_args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=max(30.0, run.left()),
    )
    if proc.returncode:
        raise RuntimeError(f"the engine's process failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def section_startup(run: Run) -> dict:
    """The throughput engine started twice, each in a new process on the run's cache directory: cold (its
    programs compiled and stored) and then from the cache (every program should be read from it)."""
    args = throughput_engine_args(run)
    cold = start_in_new_process(run, args)
    return {"cold": cold, "cached": start_in_new_process(run, args)}


def hf_static(hf, reqs, batch_size: int, device: str, deadline: float) -> dict:
    """Static batching: each batch left-padded to its longest prompt, generating until its longest output; only
    the requested output tokens count. Batches until ``deadline`` (at least one)."""
    import torch

    done, useful, t = 0, 0, time.perf_counter()
    with torch.no_grad():
        while done < len(reqs) and (done == 0 or time.perf_counter() < deadline):
            batch = reqs[done : done + batch_size]
            longest = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.zeros((len(batch), longest), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, r in enumerate(batch):
                ids[j, longest - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
                mask[j, longest - len(r.prompt_token_ids) :] = 1
            hf.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                do_sample=False,
                pad_token_id=0,
                max_new_tokens=max(r.output_len for r in batch),
            )
            done += len(batch)
            useful += sum(r.output_len for r in batch)
    seconds = time.perf_counter() - t
    return {"requests": done, "batch_size": batch_size, "seconds": seconds, "output_tok_s": useful / seconds}


def section_hf_static(run: Run) -> dict:
    """transformers in bfloat16 on the throughput workload's first requests, EOS ignored (full lengths)."""
    import torch
    import transformers

    from benchmarks.workload import synthetic

    device = torch_device(run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model(run, "big")[0], dtype=torch.bfloat16).to(
        device
    )
    hf.generation_config.eos_token_id = None
    reqs = synthetic(run.plan.hf_n, seed=0, vocab_size=run.plan.big_model["vocab_size"], **run.plan.lengths)
    hf_static(hf, reqs[:2], 2, device, 0.0)  # warm-up: CUDA kernels and caches
    return hf_static(hf, reqs, run.plan.hf_batch, device, time.perf_counter() + max(10.0, run.left() - 15))


# ----------------------------------------------------------------------------- the run


SECTIONS: dict[str, tuple[Callable[[Run], dict], float]] = {
    # name: (function, seconds it needs at least on a GPU: skipped when less is left)
    "device": (section_device, 5),
    "kernel_correctness": (section_kernel_correctness, 20),
    "kernel_times": (section_kernel_times, 20),
    "greedy_small": (section_greedy_small, 30),
    "greedy_big": (section_greedy_big, 60),
    "layer_scan": (section_layer_scan, 60),
    "startup": (section_startup, 180),
    "throughput": (section_throughput, 45),
    "hf_static": (section_hf_static, 20),
}


def run_section(run: Run, name: str) -> None:
    """Run one section within the budget; its result, error or skip goes into the results and the JSON."""
    fn, needs = SECTIONS[name]
    sections = run.results["sections"]
    if not run.dry_run and run.left() < needs:
        sections[name] = {
            "status": "skipped",
            "reason": f"{run.left():.0f} s left of the budget, needs ~{needs} s",
        }
    else:
        print(f"== {name} ({run.left():.0f} s left)", flush=True)
        t = time.perf_counter()
        try:
            sections[name] = {"status": "ok", **fn(run)}
        except Exception as e:  # a failed section is reported and the run goes on
            traceback.print_exc()
            sections[name] = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:2000]}
        sections[name]["seconds_taken"] = time.perf_counter() - t
        free_device_memory()
    write_json(run)


def json_name(run: Run) -> str:
    return "gpu-dry-run" if run.dry_run else "gpu"


def write_json(run: Run) -> Path:
    run.results_dir.mkdir(parents=True, exist_ok=True)
    path = run.results_dir / f"{json_name(run)}.json"
    path.write_text(json.dumps(run.results, indent=1, default=str))
    return path


def summary_rows(results: dict) -> list[tuple[str, str, str]]:
    """(section, what, result) lines of the final table."""
    s = results["sections"]
    rows = []
    for name, sec in s.items():
        if sec["status"] != "ok":
            rows.append(
                (name, sec["status"], sec.get("reason") or sec.get("error", "").splitlines()[0][:100])
            )
    dev = s.get("device", {})
    if dev.get("status") == "ok":
        rows.append(
            ("device", dev["device"], f"jax {dev['jax']}, copy {dev['copy_gb_s']:.0f} GB/s (read + write)")
        )
    for r in s.get("kernel_correctness", {}).get("cases", []):
        verdict = ("match" if r["match"] else "MISMATCH") + ("" if r["nan_safe"] else ", NaN LEAK")
        rows.append(
            (
                "kernel correctness",
                r["case"],
                f"{verdict}, max err {r['max_abs_err']:.1e} (atol {r['atol']:g})",
            )
        )
    for r in s.get("kernel_times", {}).get("rows", []):
        (pallas, p_ms), (_, x_ms) = r["ms"].items()
        share = f", {r['share_of_copy']:.1%} of copy" if r["share_of_copy"] else ""
        rows.append(
            (
                "kernel time",
                r["shape"],
                f"{pallas} {p_ms:.3f} ms ({r['pallas_gb_s']:.0f} GB/s{share}), xla {x_ms:.3f} ms",
            )
        )
    for name in ("greedy_small", "greedy_big"):
        for backend, c in s.get(name, {}).items():
            if isinstance(c, dict) and "identical" in c:
                first = c["divergences"][0] if c["divergences"] else None
                where = (
                    f"; first divergence: prompt {first['prompt']} token {first['position']}, HF margin "
                    f"{first['hf_margin']}"
                    if first
                    else ""
                )
                rows.append(
                    (
                        name,
                        f"{backend} vs HF (f32)",
                        f"{c['identical']}/{c['prompts']} prompts identical{where}",
                    )
                )
    for r in s.get("layer_scan", {}).get("rows", []):
        rows.append(
            (
                "layer scan",
                r["step"],
                f"compile {r['unrolled_compile_s']:.1f} s unrolled, "
                f"{r['scan_compile_s']:.1f} s scan; step {r['unrolled_step_ms']:.2f} "
                f"ms unrolled, {r['scan_step_ms']:.2f} ms scan",
            )
        )
    start = s.get("startup", {})
    for kind in ("cold", "cached"):
        if kind in start:
            r = start[kind]
            rows.append(
                (
                    "startup",
                    f"{kind}, new process",
                    f"{r['total_s']:.1f} s (load {r['load_s']:.1f}, precompile "
                    f"{r['precompile_s']:.1f}); {r['step_programs']} step "
                    f"programs; {r['from_cache']}/{r['programs']} XLA programs "
                    f"read from the cache",
                )
            )
    tp = s.get("throughput", {})
    if tp.get("status") == "ok":
        rows.append(
            (
                "throughput",
                f"jaxpaged bf16, N={tp['requests']}",
                f"{tp['output_tok_s']:,.0f} useful out tok/s, {tp['req_s']:.1f} req/s",
            )
        )
        idle = tp.get("traced", {}).get("device_idle_share")
        if idle is not None:
            rows.append(
                (
                    "throughput",
                    "device idle share",
                    f"{idle:.1%} of a {tp['traced']['requests']}-request pass",
                )
            )
    hf = s.get("hf_static", {})
    if hf.get("status") == "ok":
        ratio = (
            f" (jaxpaged {tp['output_tok_s'] / hf['output_tok_s']:.1f}x)" if tp.get("status") == "ok" else ""
        )
        rows.append(
            (
                "throughput",
                f"HF static bf16, batch {hf['batch_size']}, N={hf['requests']}",
                f"{hf['output_tok_s']:,.0f} useful out tok/s{ratio}",
            )
        )
    return rows


def plot(run: Run) -> Path:
    """Left: kernel ms per call, Pallas vs xla. Middle: Pallas' K/V GB/s with the copy bandwidth. Right: throughput."""
    from benchmarks.common import new_figure

    s = run.results["sections"]
    fig, (ax_ms, ax_bw, ax_tp) = new_figure(ncols=3, width=5.5)
    rows = s.get("kernel_times", {}).get("rows", [])
    x = np.arange(len(rows))
    for i, backend in enumerate((run.plan.pallas, "xla")):
        ax_ms.bar(x + (i - 0.5) * 0.4, [r["ms"][backend] for r in rows], 0.4, label=backend)
    ax_ms.set_yscale("log")
    ax_ms.set_xticks(x, [r["shape"].replace(" + ", "\n+ ") for r in rows], fontsize=7)
    ax_ms.set(ylabel="ms per call (median)", title="paged attention, SmolLM2 heads, bf16")
    ax_ms.legend()
    ax_bw.bar(x, [r["pallas_gb_s"] for r in rows])
    copy = s.get("device", {}).get("copy_gb_s")
    if copy:
        ax_bw.axhline(copy, color="k", linestyle="--", label="copy bandwidth (read + write)")
        ax_bw.legend()
    ax_bw.set_xticks(x, [r["shape"].replace(" + ", "\n+ ") for r in rows], fontsize=7)
    ax_bw.set(ylabel="GB/s of K/V read", title="Pallas kernel's bandwidth")
    bars = [
        (name, s[key]["output_tok_s"])
        for name, key in (("jaxpaged", "throughput"), ("HF static", "hf_static"))
        if s.get(key, {}).get("status") == "ok"
    ]
    ax_tp.bar([b[0] for b in bars], [b[1] for b in bars], color=["C0", "C2"][: len(bars)])
    ax_tp.set_yscale("log")
    ax_tp.set(ylabel="useful output tok/s", title="offline throughput, bf16")
    fig.suptitle(f"{s.get('device', {}).get('device', '?')}, jax {run.results['jax']}, {run.results['date']}")
    path = run.results_dir / f"{json_name(run)}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--dry-run", action="store_true", help="tiny sizes, Pallas interpreted (automatic on CPU)"
    )
    ap.add_argument("--quick", action="store_true", help="half the throughput workload, fewer greedy prompts")
    ap.add_argument(
        "--budget", type=float, default=450.0, help="seconds the whole run may take (default 450)"
    )
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset, in this order")
    ap.add_argument("--results-dir", default=str(Path(__file__).parent / "results"))
    ap.add_argument(
        "--work-dir", default=None, help="models and the compilation cache (default: a temporary one)"
    )
    ap.add_argument("--startup-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.startup_child:
        print(json.dumps(startup_child(json.loads(args.startup_child))))
        return 0

    import jax

    t0 = time.perf_counter()
    dry = args.dry_run or jax.default_backend() == "cpu"
    run = Run(
        plan=dry_plan() if dry else gpu_plan(args.quick),
        dry_run=dry,
        work=Path(args.work_dir or tempfile.mkdtemp(prefix="jaxpaged-gpu-")),
        results_dir=Path(args.results_dir),
        deadline=t0 + args.budget,
        results={
            "dry_run": dry,
            "jax": jax.__version__,
            "date": datetime.date.today().isoformat(),
            "args": vars(args),
            "sections": {},
        },
    )
    run.results["plan"] = dataclasses.asdict(run.plan)
    for name in args.sections.split(","):
        run_section(run, name)
    try:
        print(f"wrote {plot(run)}")
    except Exception:
        traceback.print_exc()
    run.results["total_s"] = time.perf_counter() - t0
    print(f"wrote {write_json(run)}")
    for section, what, result in summary_rows(run.results):
        print(f"{section:<20} {what:<34} {result}")
    print(
        f"total {run.results['total_s']:.0f} s{' (dry run: sizes tiny, timings meaningless)' if dry else ''}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
