"""Where the time goes: a ``jax.profiler`` trace of ``LLM.generate`` on the throughput workload,
summarised by kind of work.

The trace (Perfetto / TensorBoard format, kept under ``--trace-dir``) names every device op by its
HLO instruction name; the compiled HLO of the step and sampler programs that ran maps those names
to kinds: the native matmul, attention and KV-write kernels, the forward's other XLA ops (norms,
RoPE, SiLU, residual adds, embedding gather: with the native CPU kernels, the norms, RoPE and SiLU are
native kernels of their own), the sampler's (the sampler program's, and the forward's own argmax of
plain greedy steps: its ops carry the forward's "sampler" name scope). The device's busy time is the union of
the programs' executions; the rest of the wall time is host work the device waited for.

Then the same workload runs once more with synchronous steps (each step launched, waited for and
taken in before the next is scheduled), timing every step; the steps are grouped by how many tokens
they compute (a power of two at least that count): where a workload's time goes by step size, e.g.
the few-token steps at the end of a lognormal workload, bound by reading the weights. Prefix
caching is off, as in ``benchmarks.throughput``: each run computes every prompt.

``python -m benchmarks.profile --n 64 [--dtype bfloat16]``
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import print_table, write_json
from benchmarks.throughput import add_engine_arguments, workload_engine_args
from benchmarks.workload import synthetic

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = ")
_TARGET = re.compile(r'custom_call_target="(\w+)"')
_SAMPLER_SCOPE = re.compile(r'op_name="[^"]*/sampler/')  # the forward's own argmax (plain greedy steps)
_LAYER_OPS = "norms, RoPE, SiLU (native)"
_OTHER = "other XLA ops of the forward (gathers, slices; norms, RoPE, SiLU, adds if not native)"
_TARGET_KINDS = (
    ("matmul", "matmul (native)"),
    ("attention", "attention (native)"),
    ("write_kv", "KV write (native)"),
    ("rms_norm", _LAYER_OPS),
    ("rope", _LAYER_OPS),
    ("silu", _LAYER_OPS),
)
_INFRASTRUCTURE = ("Thunk", "Threadpool", "Slinky", "end: ")


def _op_kinds(hlo_text: str, default: str) -> dict[str, str]:
    """HLO instruction name -> kind, for one compiled program."""
    kinds = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            target = _TARGET.search(line)
            target = target.group(1) if target else ""
            kind = next((k for t, k in _TARGET_KINDS if t in target), None)
            kinds[m.group(1)] = kind or ("sampler" if _SAMPLER_SCOPE.search(line) else default)
    return kinds


def summarise(trace: dict, kinds: dict[str, str]) -> tuple[dict[str, float], int]:
    """Per kind, the device time its ops took (ms): XLA runs independent ops on several threads at
    once, so an instant shared by k running ops counts 1/k for each, and the kinds sum to the time
    the device was busy. Also the number of forward programs the host launched."""
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e.get("name") == "thread_name"
    }
    edges, launches = [], 0
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        if threads.get((e["pid"], e["tid"])) == "python":
            launches += e["name"] == "PjitFunction(_step)"
        elif not e["name"].startswith(_INFRASTRUCTURE):
            kind = kinds.get(e["name"], "other (block copies, transfers)")
            edges += [(e["ts"], 1, kind), (e["ts"] + e["dur"], -1, kind)]
    edges.sort()
    running, time_us, last = collections.Counter(), collections.defaultdict(float), 0.0
    for t, change, kind in edges:
        n = sum(running.values())
        for k, c in running.items():
            if c:
                time_us[k] += (t - last) * c / n
        running[kind] += change
        last = t
    return {k: v / 1e3 for k, v in time_us.items()}, launches


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(ap)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--trace-dir", default=None, help="where the trace goes (default: a temporary directory)")
    args = ap.parse_args(argv)

    import jax

    from jaxpaged import LLM, SamplingParams
    from jaxpaged.step_programs import sample_fn

    reqs = synthetic(args.n, args.seed)
    llm = LLM(**workload_engine_args(args, args.dtype, enable_prefix_caching=False))
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    prompts = [r.prompt_token_ids for r in reqs]
    llm.generate(prompts, params, use_tqdm=False)  # every program compiled and loaded

    runner = llm.engine.runner
    batches, run_batch = {}, runner.run_batch

    def recording_run_batch(b):
        batches.setdefault(b.program_keys, b)
        return run_batch(b)

    runner.run_batch = recording_run_batch
    trace_dir = Path(args.trace_dir or tempfile.mkdtemp(prefix="jaxpaged-profile-"))
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python frames would slow the host part several times over
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True, profiler_options=options)
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall_ms = (time.perf_counter() - t) * 1e3
    jax.profiler.stop_trace()
    runner.run_batch = run_batch

    kinds: dict[str, str] = {}
    forwards = []
    for b in batches.values():
        program, call_args = runner.forward_program(b)
        forward = program.lower(*call_args)
        forwards.append(forward.compile().as_text())
        if not b.greedy_in_forward:  # else the forward sampled: no sampler program ran
            sampler = (
                sample_fn.lower(
                    forward.out_info[1],
                    b.sampling,
                    b.prompt_targets,
                    flags=b.flags,
                    num_token_slots=runner.max_rows,
                )
                .compile()
                .as_text()
            )
            kinds.update(_op_kinds(sampler, "sampler"))
    for text in forwards:  # a name in both programs counts as the forward's, by far the larger
        kinds.update(_op_kinds(text, _OTHER))

    trace = json.load(gzip.open(sorted(trace_dir.glob("plugins/profile/*/*.trace.json.gz"))[-1]))
    by_kind, launches = summarise(trace, kinds)
    busy_ms = sum(by_kind.values())
    rows = [
        (k, f"{ms:.0f}", f"{100 * ms / wall_ms:.1f}")
        for k, ms in sorted(by_kind.items(), key=lambda kv: -kv[1])
    ]
    rows += [
        ("device busy", f"{busy_ms:.0f}", f"{100 * busy_ms / wall_ms:.1f}"),
        (
            "device idle (waiting for the host)",
            f"{wall_ms - busy_ms:.0f}",
            f"{100 - 100 * busy_ms / wall_ms:.1f}",
        ),
        ("wall time of generate()", f"{wall_ms:.0f}", "100.0"),
    ]
    print(
        f"{args.n} requests, {args.dtype}: {launches} steps, {len(batches)} step shapes; trace (Perfetto, "
        f"TensorBoard): {trace_dir}"
    )
    print_table(["kind of work", "ms", "% of wall"], rows, widths=[64, 8, 10])

    by_size, sync_ms, sync_tokens = steps_by_size(llm, prompts, params)
    print(f"synchronous steps by size: generate() took {sync_ms:.0f} ms")
    print_table(
        ["tokens per step, at most", "steps", "ms", "median ms", "% of wall"],
        [
            (
                size,
                len(ms),
                f"{sum(ms):.0f}",
                f"{statistics.median(ms):.2f}",
                f"{100 * sum(ms) / sync_ms:.1f}",
            )
            for size, ms in by_size.items()
        ],
        widths=[26, 8, 10, 12, 10],
    )
    return write_json(
        f"profile_{args.dtype}",
        {
            "args": vars(args),
            "by_kind_ms": by_kind,
            "device_busy_ms": busy_ms,
            "wall_ms": wall_ms,
            "steps": launches,
            "trace_dir": str(trace_dir),
            "sync_wall_ms": sync_ms,
            "sync_step_ms_by_size": by_size,
            "sync_tokens": sync_tokens,
        },
    )


def steps_by_size(llm, prompts, params) -> tuple[dict[int, list[float]], float, int]:
    """``generate()`` with synchronous steps, each step's wall time (ms, from its launch until its
    samples are on the host) grouped by the smallest power of two >= its token count; the call's
    wall time (ms) and the tokens its steps computed."""
    engine, runner = llm.engine, llm.engine.runner
    launch, collect, was_async = runner.launch, runner.collect, engine.async_scheduling
    started: dict[int, tuple[float, int]] = {}  # launched step's id -> (launch time, tokens)
    by_size: dict[int, list[float]] = collections.defaultdict(list)
    tokens_computed = 0

    def timed_launch(out):
        t0 = time.perf_counter()
        step = launch(out)
        if step is not None:  # None: nothing ran
            started[id(step)] = (t0, out.total_num_tokens)
        return step

    def timed_collect(step):
        nonlocal tokens_computed
        result = collect(step)
        if id(step) in started:  # not a step left in flight by an earlier run
            t0, tokens = started.pop(id(step))
            tokens_computed += tokens
            by_size[1 << (tokens - 1).bit_length()].append((time.perf_counter() - t0) * 1e3)
        return result

    engine.async_scheduling, runner.launch, runner.collect = False, timed_launch, timed_collect
    try:
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall_ms = (time.perf_counter() - t) * 1e3
    finally:
        engine.async_scheduling, runner.launch, runner.collect = was_async, launch, collect
    return dict(sorted(by_size.items())), wall_ms, tokens_computed


if __name__ == "__main__":
    main()
