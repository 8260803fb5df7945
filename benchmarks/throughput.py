"""Offline throughput: ``LLM.generate`` over a seeded synthetic workload, optionally side by
side with Hugging Face transformers static batching (``--peer hf``) or vLLM's CPU build
(``--peer vllm``: ``vllm.LLM.generate`` in a virtualenv of its own, see ``benchmarks/vllm_peer.py``)
on the same model and requests (same token ids and output lengths, ignore_eos, temperature 0).

jaxpaged and vLLM run each dtype of ``--dtypes`` with the same KV-cache space (``--kv-cache-gib``)
and the same step budget; prefix caching is off for both unless ``--prefix-caching``. Every round sends
the same prompts, each round under a prefix-cache salt of its own (``cache_salt``), so that with prefix
caching on no round finds the one before's prompts cached. Each system's figure is the median of its
rounds; ratios are jaxpaged over the peer, dtype for dtype.

Writes ``benchmarks/results/throughput.json`` and ``throughput.png``: each system's useful output tok/s, with
10x HF's figure and the float32 ceiling (``--ceiling``) as lines.

``--hf-pairs K`` then runs K rounds of jaxpaged and HF taking turns and prints each pair's ratio and their median:
the runs above go one system after another, so a drift of the machine's speed between them (10-25% within an
hour on a shared 2-core VM) moves the single ratio; alternating pairs share it.

``--workload chat`` runs the workload's real-text variant (the same lengths, prompts that are chat conversations in
English, templated by the model's tokenizer) on every system.

``python -m benchmarks.throughput --n 64 --seed 0 [--dtypes float32,bfloat16] [--peer hf] [--peer vllm]``
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.common import new_figure, save_figure, write_json
from benchmarks.workload import WORKLOADS, WorkloadRequest, model_flops, requests
from jaxpaged.config import keeps_quantized_blocks

_BAR_COLOURS = (("jaxpaged", "C0"), ("vllm", "C1"), ("hf", "C2"))


def run_jaxpaged(reqs: list[WorkloadRequest], engine_args: dict, rounds: int) -> dict:
    import jax
    import numpy as np

    from jaxpaged import LLM

    t0 = time.perf_counter()
    llm = LLM(**engine_args)
    load_s = time.perf_counter() - t0
    runs = [jaxpaged_round(llm, reqs, f"round-{k}") for k in range(rounds)]
    e = llm.engine
    quantized = sum(a.dtype == np.uint8 for a in jax.tree_util.tree_leaves(e.runner.model.params))
    k = engine_args.get("num_scheduler_steps", 1)
    matmul = e.runner.model.module.matmul_backend
    name = (
        f"jaxpaged ({engine_args['dtype']}{', q-weights' if quantized else ''}"
        f"{', XLA dot' if matmul == 'xla' else ''}{f', {k} steps' if k > 1 else ''})"
    )
    return {
        "system": name,
        "quantized_weights": quantized,
        "load_s": load_s,
        "warmup_s": e.warmup_time,
        "seconds": runs,
        "compiled_programs": e.runner.num_compiled_programs,
        "preemptions": e.scheduler.num_preemptions,
        "model_config": e.runner.model.module.cfg,
    }


def jaxpaged_round(llm, reqs: list[WorkloadRequest], salt: str) -> float:
    """Seconds of one timed ``llm.generate`` of the workload, under prefix-cache salt ``salt`` (one per round:
    no round finds the prompts of the one before cached)."""
    from jaxpaged import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    prompts = [{"prompt_token_ids": r.prompt_token_ids, "cache_salt": salt} for r in reqs]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    assert [len(o.outputs[0].token_ids) for o in outs] == [r.output_len for r in reqs]
    return seconds


def distinct_engines(dtypes: list[str], quantizations: list[str]) -> list[tuple[str, str]]:
    """(dtype, quantization) of one run per distinct engine: per dtype, the matmul backend ``auto``
    takes and whether it runs quantized blocks (the first quantization naming each)."""
    from jaxpaged.models.params import runs_quantized
    from jaxpaged.kernels import resolve_matmul_backend

    kept: dict[tuple, tuple[str, str]] = {}
    for d in dtypes:
        for q in quantizations:
            matmul = resolve_matmul_backend("auto", dtype=d, quantized=q == "gguf")
            kept.setdefault((d, matmul, runs_quantized(matmul) and keeps_quantized_blocks(q, d)), (d, q))
    return list(kept.values())


def load_hf(model: str):
    """The model in Hugging Face transformers, float32, EOS ignored (every request generates its full length)."""
    import torch
    import transformers

    from jaxpaged.weights import resolve_model_path

    path = resolve_model_path(model)
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent if kw else path, dtype=torch.float32, **kw
    ).eval()
    hf.generation_config.eos_token_id = None
    return hf


def hf_static_seconds(hf, reqs: list[WorkloadRequest], batch_size: int) -> float:
    """Seconds of static batching: each batch is left-padded to its longest prompt and generates until its
    longest output; only the requested output tokens count as useful."""
    import torch

    t = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        longest = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(batch):
            ids[j, longest - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[j, longest - len(r.prompt_token_ids) :] = 1
        with torch.no_grad():
            hf.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                pad_token_id=0,
                max_new_tokens=max(r.output_len for r in batch),
                min_new_tokens=None,
            )
    return time.perf_counter() - t


HF_WARMUP_TOKENS = 4
"""Output tokens of each request in HF's untimed first pass."""


def run_hf(hf, reqs: list[WorkloadRequest], batch_sizes: list[int]) -> dict:
    """HF's static batching at each batch size; its figure is the best one's. An untimed pass of a few tokens
    at the largest batch size comes first, so that torch's first-call costs (picking and building its kernels)
    fall outside the timed passes, as jaxpaged's fall in its start-up. (SmolLM2 in float32 on Zen 4 showed none
    worth measuring: three passes in a row took 72.4, 83.0 and 78.9 s, the VM's drift.)"""
    warm = [
        dataclasses.replace(r, output_len=min(r.output_len, HF_WARMUP_TOKENS))
        for r in reqs[: max(batch_sizes)]
    ]
    hf_static_seconds(hf, warm, max(batch_sizes))
    best = None
    for bs in batch_sizes:
        seconds = hf_static_seconds(hf, reqs, bs)
        print(f"  hf static batch {bs}: {seconds:.1f} s")
        if best is None or seconds < best["seconds"][0]:
            best = {"system": f"hf-static(batch={bs})", "batch_size": bs, "seconds": [seconds]}
    return best


def alternate(first, second, pairs: int) -> list[tuple[float, float]]:
    """``pairs`` rounds of ``first(k)`` then ``second(k)``, each returning seconds: A and B take turns, so that a
    drift of the machine's speed (a 2-core VM's moves 10-25% within an hour) reaches both alike."""
    return [(first(k), second(k)) for k in range(pairs)]


def paired_ratios(
    reqs: list[WorkloadRequest], peer_reqs: list[WorkloadRequest], pairs: list[tuple[float, float]]
) -> list[float]:
    """Each pair's useful output tok/s of jaxpaged (``reqs``, first) over the peer's (``peer_reqs``, second)."""
    ours, theirs = sum(r.output_len for r in reqs), sum(r.output_len for r in peer_reqs)
    return [(ours / a) / (theirs / b) for a, b in pairs]


def run_vllm(reqs: list[WorkloadRequest], args, dtype: str) -> dict:
    from benchmarks import vllm_peer

    vllm_peer.setup()
    res = vllm_peer.run(
        reqs,
        args.model,
        dtype,
        args.rounds,
        args.max_num_seqs,
        args.max_num_batched_tokens,
        args.kv_cache_gib,
        args.prefix_caching,
    )
    print(
        f"{res['system']}: load {res['load_s']:.1f} s, rounds {', '.join(f'{s:.1f}' for s in res['seconds'])} s"
    )
    return {**res, "dtype": dtype}


def report(name: str, reqs: list[WorkloadRequest], seconds: float, model_config) -> dict:
    """One system's row; "model GFLOP/s" is ``model_flops`` of the requests over the seconds (the
    model's own arithmetic, the same for every system: padding or recomputation is not credited)."""
    out_tokens = sum(r.output_len for r in reqs)
    all_tokens = out_tokens + sum(len(r.prompt_token_ids) for r in reqs)
    row = {
        "system": name,
        "n": len(reqs),
        "seconds": seconds,
        "req_per_s": len(reqs) / seconds,
        "output_tok_per_s": out_tokens / seconds,
        "total_tok_per_s": all_tokens / seconds,
        "model_gflop_per_s": model_flops(reqs, model_config) / seconds / 1e9,
    }
    print(
        f"{name:<32} {len(reqs):>4} {seconds:>9.1f} {row['req_per_s']:>8.2f} "
        f"{row['output_tok_per_s']:>12.1f} {row['total_tok_per_s']:>12.1f} {row['model_gflop_per_s']:>15.1f}"
    )
    return row


HEADER = (
    f"{'system':<32} {'n':>4} {'seconds':>9} {'req/s':>8} {'out tok/s':>12} {'total tok/s':>12} "
    f"{'model GFLOP/s':>15}"
)


def float32_ceiling(reqs: list[WorkloadRequest], model_config) -> dict:
    """The fastest any float32 system could run ``reqs`` on this CPU: their ``model_flops`` at the
    fused multiply-add peak of all cores (``benchmarks.ceiling``'s, needs a C++ compiler)."""
    import os
    import tempfile

    from benchmarks import ceiling

    with tempfile.TemporaryDirectory() as tmp:
        peak = float(ceiling.run(ceiling.build(Path(tmp)), "peak", os.cpu_count() or 1)[0][2])
    seconds = model_flops(reqs, model_config) / (peak * 1e9)
    return {
        "fma_peak_gflop_per_s": peak,
        "seconds": seconds,
        "output_tok_per_s": sum(r.output_len for r in reqs) / seconds,
    }


def add_engine_arguments(ap: argparse.ArgumentParser) -> None:
    """The engine options of the workload's runs; ``benchmarks.profile`` takes the same ones, so it
    profiles the engine this benchmark times."""
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-gib", type=int, default=4, help="KV-cache space of each system")


def workload_engine_args(args: argparse.Namespace, dtype: str, **more) -> dict:
    """``LLM`` arguments of a run from ``add_engine_arguments``' options (and ``more``)."""
    return dict(
        model=args.model,
        dtype=dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=512,
        kv_cache_memory=args.kv_cache_gib << 30,
        **more,
    )


def engine_args(args: argparse.Namespace, dtype: str, quantization: str) -> dict:
    """The ``LLM`` arguments of this benchmark's engine for one dtype and quantization."""
    return workload_engine_args(
        args,
        dtype,
        enable_prefix_caching=args.prefix_caching,
        quantization=quantization,
        num_scheduler_steps=args.num_scheduler_steps,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(ap)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="synthetic",
        help="synthetic: random token ids; chat: the same lengths as chat conversations in English",
    )
    ap.add_argument(
        "--dtypes", default="float32,bfloat16", help="comma-separated; jaxpaged and vLLM run each"
    )
    ap.add_argument("--prefix-caching", action="store_true", help="leave prefix caching on (both systems)")
    ap.add_argument(
        "--quantization",
        default="auto,gguf,none",
        help="jaxpaged's EngineArgs.quantization values to run (comma-separated): auto keeps a GGUF's "
        "Q4_1/Q8_0 weights quantized in float32 (q-weights), gguf in bfloat16 too, none "
        "dequantizes them as the peers do; a value giving a dtype the same engine as an "
        "earlier one is skipped",
    )
    ap.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=1,
        help="jaxpaged's decode steps per scheduling (multi-step scheduling; default 1, the engine's)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="timed generate() calls per system and dtype")
    ap.add_argument("--peer", choices=["hf", "vllm"], action="append", default=[])
    ap.add_argument("--peer-n", type=int, default=16, help="requests for the (slow) HF peer")
    ap.add_argument("--hf-batch-sizes", default="1,8,32", help="HF's figure is its best batch size")
    ap.add_argument(
        "--hf-pairs",
        type=int,
        default=0,
        help="with --peer hf, then this many rounds of jaxpaged (its first float32 engine, or the first "
        "dtype's if the run has no float32) and HF at its "
        "best batch size taking turns: each pair's ratio and their median, which the machine's "
        "drift between the runs above does not skew",
    )
    ap.add_argument(
        "--ceiling",
        action="store_true",
        help="also measure the CPU's float32 fused multiply-add peak and print the workload's "
        "useful output tok/s at that peak (needs a C++ compiler)",
    )
    args = ap.parse_args()
    if args.hf_pairs < 0 or (args.hf_pairs and "hf" not in args.peer):
        ap.error(f"--hf-pairs {args.hf_pairs}: give a count of at least 1, and --peer hf")

    reqs = requests(args.workload, args.n, args.seed, args.model)
    dtypes = args.dtypes.split(",")
    rows, runs = [], []
    quantizations = args.quantization.split(",")
    for dtype, quantization in distinct_engines(dtypes, quantizations):
        run = engine_args(args, dtype, quantization)
        res = {**run_jaxpaged(reqs, run, args.rounds), "dtype": dtype}
        print(
            f"{res['system']}: load {res['load_s']:.1f} s (of which precompile {res['warmup_s']:.1f} s), "
            f"{res['compiled_programs']} compiled step programs, {res['preemptions']} preemptions, "
            f"rounds {', '.join(f'{s:.1f}' for s in res['seconds'])} s"
        )
        runs.append(res)
    for dtype in dtypes if "vllm" in args.peer else []:
        runs.append(run_vllm(reqs, args, dtype))
    cfg = runs[0]["model_config"]
    print(HEADER)
    for res in runs:
        rows.append(
            {
                **report(res["system"], reqs, statistics.median(res["seconds"]), cfg),
                "rounds_s": res["seconds"],
                **{
                    k: res[k]
                    for k in ("dtype", "load_s", "compiled_programs", "preemptions", "quantized_weights")
                    if k in res
                },
            }
        )
    ours = [r for r in rows if r["system"].startswith("jaxpaged")]
    for r in rows:
        if r["system"].startswith("vllm"):
            r["ratios_jaxpaged_over_peer"] = {}
            for row in (o for o in ours if o["dtype"] == r["dtype"]):
                ratio = r["ratios_jaxpaged_over_peer"][row["system"]] = (
                    row["output_tok_per_s"] / r["output_tok_per_s"]
                )
                print(f"ratio {row['system']} / {r['system']} (useful output tok/s): {ratio:.2f}x")
    pairs = None
    if "hf" in args.peer:
        peer_reqs = reqs[: args.peer_n]
        hf_model = load_hf(args.model)
        hf = run_hf(hf_model, peer_reqs, [int(b) for b in args.hf_batch_sizes.split(",")])
        print(HEADER)
        hf_row = report(hf["system"], peer_reqs, hf["seconds"][0], cfg)
        rows.append(hf_row)
        for row in ours:
            row["ratio_over_hf_float32"] = row["output_tok_per_s"] / hf_row["output_tok_per_s"]
            print(
                f"ratio {row['system']} / HF float32 static batching (useful output tok/s): "
                f"{row['ratio_over_hf_float32']:.1f}x"
            )
        if args.hf_pairs:
            pairs = run_hf_pairs(args, reqs, peer_reqs, hf_model, hf["batch_size"])
    ceiling = float32_ceiling(reqs, cfg) if args.ceiling else None
    if ceiling:
        print(
            f"float32 ceiling: the workload's model arithmetic at the CPU's fused multiply-add peak "
            f"({ceiling['fma_peak_gflop_per_s']:.1f} GFLOP/s) takes {ceiling['seconds']:.1f} s, "
            f"{ceiling['output_tok_per_s']:.1f} useful output tok/s"
        )
        for row in (r for r in rows if r.get("dtype") == "float32"):
            print(
                f"{row['system']}: {row['output_tok_per_s'] / ceiling['output_tok_per_s']:.0%} of the float32 ceiling"
            )
        if "hf" in args.peer:
            print(
                f"10x HF float32 static batching = {10 * hf_row['output_tok_per_s']:.1f} useful output tok/s, "
                f"{10 * hf_row['output_tok_per_s'] / ceiling['output_tok_per_s']:.0%} of the float32 ceiling"
            )
    write_json(
        "throughput", {"args": vars(args), "rows": rows, "float32_ceiling": ceiling, "hf_pairs": pairs}
    )
    plot(rows, ceiling)


def run_hf_pairs(
    args, reqs: list[WorkloadRequest], peer_reqs: list[WorkloadRequest], hf_model, batch_size: int
) -> dict:
    """``--hf-pairs``: rounds of jaxpaged's first engine (float32 if the run has it) and HF at its best batch
    size taking turns; each pair's ratio of useful output tok/s and their median. The engine is loaded again
    (~10 s): the runs above drop each engine before the next loads, so that one KV pool at a time holds
    ``--kv-cache-gib`` of memory, also while vLLM runs."""
    from jaxpaged import LLM

    dtype = "float32" if "float32" in args.dtypes.split(",") else args.dtypes.split(",")[0]
    dtype, quantization = distinct_engines([dtype], args.quantization.split(","))[0]
    llm = LLM(**engine_args(args, dtype, quantization))
    seconds = alternate(
        lambda k: jaxpaged_round(llm, reqs, f"pair-{k}"),
        lambda k: hf_static_seconds(hf_model, peer_reqs, batch_size),
        args.hf_pairs,
    )
    ratios = paired_ratios(reqs, peer_reqs, seconds)
    for k, ((a, b), ratio) in enumerate(zip(seconds, ratios)):
        print(
            f"pair {k}: jaxpaged ({dtype}, quantization={quantization}) {a:.1f} s, HF (batch {batch_size}) "
            f"{b:.1f} s: {ratio:.1f}x"
        )
    median = statistics.median(ratios)
    print(f"jaxpaged / HF float32 static batching, median of {len(ratios)} alternating pairs: {median:.1f}x")
    return {
        "dtype": dtype,
        "quantization": quantization,
        "hf_batch_size": batch_size,
        "seconds": seconds,
        "ratios": ratios,
        "median_ratio": median,
    }


def plot(rows: list[dict], ceiling: dict | None) -> Path:
    """One bar per system (its useful output tok/s), jaxpaged's, vLLM's and HF's in their own colours; 10x the
    HF row's figure and the float32 ceiling as vertical lines when the run has them."""
    fig, (ax,) = new_figure(width=8.0, height=1.5 + 0.45 * len(rows))
    y = np.arange(len(rows))
    values = [r["output_tok_per_s"] for r in rows]
    colours = [next((c for prefix, c in _BAR_COLOURS if r["system"].startswith(prefix)), "C7") for r in rows]
    ax.barh(y, values, color=colours)
    for yi, v in zip(y, values):
        ax.text(v, yi, f" {v:.0f}", va="center")
    ax.set_yticks(
        y, [r["system"] if r["n"] == rows[0]["n"] else f"{r['system']}, {r['n']} requests" for r in rows]
    )
    ax.invert_yaxis()
    hf = next((r for r in rows if r["system"].startswith("hf")), None)
    lines = []  # (x, colour, style, label)
    if hf is not None:
        lines.append((10 * hf["output_tok_per_s"], "k", "--", "10x HF static batching"))
    if ceiling:
        lines.append((ceiling["output_tok_per_s"], "r", ":", "float32 ceiling (FMA peak)"))
    for x, colour, style, label in lines:
        ax.axvline(x, color=colour, linestyle=style, label=label)
    if lines:
        ax.legend(loc="lower right")
    ax.set_xlim(0, 1.12 * max(values + [x for x, *_ in lines]))  # room for the figures after the bars
    ax.set(
        xlabel="useful output tokens/s (median of rounds)",
        title=f"offline throughput, {rows[0]['n']} requests",
    )
    return save_figure(fig, "throughput")


if __name__ == "__main__":
    main()
