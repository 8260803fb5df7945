"""Memory saved by block sharing (vLLM paper, memory-saving figure) and prefix-cache throughput.

1. Parallel sampling (n = 2, 4, 6) and beam search (width 2, 4, 6) over a seeded synthetic
   workload: after every engine step the pool reports the blocks in use and the blocks the
   live sequences would hold with private copies (the sum of ref counts). Saved =
   (without - used) / without, summed over steps (a time average weighted by memory), plus
   the largest per-step value.
2. A shared-system-prompt workload (one long system prompt, short distinct user turns):
   throughput with the prefix cache on vs. off, runs alternating on/off after a warm-up of
   each, medians reported; every run has fresh user turns so only the system prompt repeats.

``python -m benchmarks.memory_sharing [--model smollm2-135m-instruct] [--prompts 8]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.workload import synthetic

RESULTS = Path(__file__).parent / "results"


def run_until_done(engine) -> dict:
    """Step the engine to the end; blocks used vs. without sharing, summed over steps."""
    used = without = steps = 0
    peak = 0.0
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.sharing_stats()
        used += s.blocks_used
        without += s.blocks_without_sharing
        peak = max(peak, s.saved_fraction)
        steps += 1
    return {
        "seconds": time.perf_counter() - t,
        "steps": steps,
        "block_steps_used": used,
        "block_steps_without_sharing": without,
        "saved": (without - used) / without if without else 0.0,
        "peak_saved": peak,
    }


def sharing(llm, kind: str, width: int, reqs, seed: int) -> dict:
    from jaxpaged import BeamSearchParams, SamplingParams

    eng = llm.engine
    for i, r in enumerate(reqs):
        rid = f"{kind}{width}-{i}"
        if kind == "parallel":
            eng.add_request(
                rid,
                r.prompt_token_ids,
                SamplingParams(
                    n=width, temperature=1.0, seed=seed + i, max_tokens=r.output_len, ignore_eos=True
                ),
            )
        else:
            eng.add_beam_search_request(
                rid,
                r.prompt_token_ids,
                BeamSearchParams(beam_width=width, max_tokens=r.output_len, ignore_eos=True),
            )
    row = {"workload": kind, "width": width, **run_until_done(eng)}
    kv = eng.kv_cache_manager
    assert kv.num_free_blocks == eng.cache_info.num_usable_blocks and kv.pool.num_block_refs == 0
    print(
        f"{kind:<9} {width:>5} {row['saved'] * 100:>9.1f}% {row['peak_saved'] * 100:>9.1f}% "
        f"{row['steps']:>6} {row['seconds']:>8.1f}"
    )
    return row


def system_prompt_workload(rng: np.random.Generator, n: int, system_len: int, vocab: int):
    system = rng.integers(32, vocab, system_len).tolist()

    def turns(run: int) -> list[list[int]]:
        r = np.random.default_rng([run, 7])
        return [system + r.integers(32, vocab, int(k)).tolist() for k in r.integers(8, 48, n)]

    return turns


def prefix_throughput(
    model: str, engine_args: dict, n: int, system_len: int, out_len: int, rounds: int
) -> dict:
    from jaxpaged import LLM, SamplingParams

    llms = {on: LLM(model, enable_prefix_caching=on, **engine_args) for on in (True, False)}
    vocab = llms[True].engine.vocab_size
    turns = system_prompt_workload(np.random.default_rng(0), n, system_len, vocab)
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    for on, llm in llms.items():  # warm-up: compile (and, when on, cache the system prompt)
        llm.generate(turns(1000), sp, use_tqdm=False)
    seconds = {True: [], False: []}
    tokens = 0
    for run in range(rounds):
        prompts = turns(run)
        tokens = sum(len(p) for p in prompts) + n * out_len
        for on in (True, False) if run % 2 == 0 else (False, True):
            t = time.perf_counter()
            llms[on].generate(prompts, sp, use_tqdm=False)
            seconds[on].append(time.perf_counter() - t)
    stats = llms[True].engine.kv_cache_manager.stats
    row = {
        "requests": n,
        "system_prompt_tokens": system_len,
        "output_tokens": out_len,
        "rounds": rounds,
        "seconds_on": seconds[True],
        "seconds_off": seconds[False],
        "median_on": statistics.median(seconds[True]),
        "median_off": statistics.median(seconds[False]),
        "hit_rate_on": stats.hit_rate,
    }
    row["speedup"] = row["median_off"] / row["median_on"]
    for on in (True, False):
        med = row["median_on" if on else "median_off"]
        print(
            f"prefix cache {'on ' if on else 'off'}: median {med:.2f} s over {rounds} runs, "
            f"{n / med:.2f} req/s, {tokens / med:.0f} tok/s (prompt + output)"
        )
    print(
        f"speedup {row['speedup']:.2f}x, prefix-cache hit rate (cache on, all runs) {stats.hit_rate * 100:.1f}%"
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per sharing workload")
    ap.add_argument("--prompt-mean", type=float, default=128)
    ap.add_argument("--output-mean", type=float, default=96)
    ap.add_argument("--widths", default="2,4,6")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--prefix-requests", type=int, default=16)
    ap.add_argument("--prefix-output", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-prefix", action="store_true")
    args = ap.parse_args()

    from jaxpaged import LLM

    engine_args = dict(block_size=args.block_size, max_num_seqs=64, max_num_batched_tokens=512)
    reqs = synthetic(
        args.prompts, args.seed, prompt_mean=args.prompt_mean, output_mean=args.output_mean, max_total=384
    )
    llm = LLM(args.model, **engine_args)
    reqs = [type(r)([t % llm.engine.vocab_size for t in r.prompt_token_ids], r.output_len) for r in reqs]
    print(
        f"{args.prompts} prompts (mean {np.mean([len(r.prompt_token_ids) for r in reqs]):.0f} tokens), "
        f"outputs mean {np.mean([r.output_len for r in reqs]):.0f} tokens, block size {args.block_size}"
    )
    print(f"{'workload':<9} {'width':>5} {'saved':>10} {'peak':>10} {'steps':>6} {'seconds':>8}")
    rows = [
        sharing(llm, kind, int(w), reqs, args.seed)
        for kind in ("parallel", "beam")
        for w in args.widths.split(",")
    ]
    del llm
    prefix = None
    if not args.skip_prefix:
        prefix = prefix_throughput(
            args.model, engine_args, args.prefix_requests, args.system_len, args.prefix_output, args.rounds
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "memory_sharing.json").write_text(
        json.dumps({"args": vars(args), "sharing": rows, "prefix_cache": prefix}, indent=1)
    )


if __name__ == "__main__":
    main()
