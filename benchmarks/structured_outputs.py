"""What constrained rows cost a batch: offline decode throughput with none, one, or all of a batch's
requests under a grammar.

Each request has a random token-id prompt and decodes exactly ``--max-tokens`` tokens greedily
(free ones ignore EOS; constrained ones follow the regex ``[a-z ,.]+`` with ``min_tokens`` =
``max_tokens``, so EOS is held back and the grammar never completes: the same work either way).
A batch holding a constrained row runs synchronously, one decode step at a time (its mask needs
the previous step's token on the host), so the free batch is timed three ways: async scheduling with
``--num-scheduler-steps`` groups, async one step at a time, and synchronous; "fill" is the host time
the runner spent filling bitmask rows (llguidance), as a share of the wall time. Medians of ``--rounds``
``generate`` calls after a warm-up one. ``python -m benchmarks.structured_outputs``
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.common import UNDER_LOAD, print_table, resolve_model_arg, write_json
from jaxpaged import LLM, SamplingParams, StructuredOutputsParams
from jaxpaged import sampling_inputs

REGEX = "[a-z ,.]+"


def timed_fill() -> list[float]:
    """Wrap the runner's bitmask fill; returns the list its calls' seconds are appended to."""
    seconds, fill = [], sampling_inputs.fill_bitmask

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = fill(*args, **kwargs)
        seconds.append(time.perf_counter() - t0)
        return out

    sampling_inputs.fill_bitmask = timed
    return seconds


def run_once(
    llm: LLM,
    prompts: list[list[int]],
    params: list[SamplingParams],
    max_tokens: int,
    fill_seconds: list[float],
) -> tuple[float, float]:
    """(wall seconds, bitmask fill seconds) of one ``generate`` call doing the same work as every other."""
    fill_seconds.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    if any(len(c.token_ids) != max_tokens for o in outs for c in o.outputs):
        raise RuntimeError("a request ended before max_tokens: the configurations would not do the same work")
    return wall, sum(fill_seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a model argument, or 'tiny' (random)")
    ap.add_argument("--n", type=int, default=16, help="requests per batch")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-scheduler-steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = resolve_model_arg(args.model)
    common = dict(max_num_seqs=args.n, precompile=False)
    grouped, single = LLM(model, num_scheduler_steps=args.num_scheduler_steps, **common), LLM(model, **common)
    prompts = (
        np.random.default_rng(0).integers(3, single.engine.vocab_size, (args.n, args.prompt_len)).tolist()
    )
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=args.max_tokens,
        min_tokens=args.max_tokens,
        structured_outputs=StructuredOutputsParams(regex=REGEX),
    )
    # label -> (engine, async scheduling, requests constrained)
    configs = {
        f"free, async, {args.num_scheduler_steps}-step groups": (grouped, True, 0),
        "free, async": (single, True, 0),
        "free, synchronous": (single, False, 0),
        f"1 of {args.n} constrained": (single, True, 1),
        f"{args.n} of {args.n} constrained": (single, True, args.n),
    }
    fill_seconds = timed_fill()
    times = {label: [] for label in configs}
    for r in range(args.rounds + 1):  # interleaved, so that a drift of the machine's load skews none
        for label, (llm, async_scheduling, k) in configs.items():
            llm.engine.async_scheduling = async_scheduling
            t = run_once(
                llm, prompts, [constrained] * k + [free] * (args.n - k), args.max_tokens, fill_seconds
            )
            if r:  # the first round compiles
                times[label].append(t)
    rows = {}
    for label, ts in times.items():
        wall = statistics.median(w for w, _ in ts)
        rows[label] = {
            "tok_s": args.n * args.max_tokens / wall,
            "wall_s": wall,
            "fill_share": statistics.median(f for _, f in ts) / wall,
        }
    best = max(r["tok_s"] for r in rows.values())
    print(
        f"{args.n} requests x {args.max_tokens} tokens, prompts of {args.prompt_len}; {args.model}; {UNDER_LOAD}"
    )
    print_table(
        ["batch", "tok/s", "vs best", "fill % wall"],
        [[label, r["tok_s"], r["tok_s"] / best, 100 * r["fill_share"]] for label, r in rows.items()],
        [40, 10, 10, 12],
    )
    write_json("structured_outputs", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
