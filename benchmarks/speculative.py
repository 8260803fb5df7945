"""Speculative decoding's speed: TPOT and output tok/s at 1, 4 and 16 concurrent requests, with and
without speculation, on two workloads.

``copy``: real text that the answer copies from, n-gram lookup's home ground: chat requests asking the
model to repeat, correct or continue a passage given in the prompt (greedy; EOS ends them, and the
outputs are the same with and without speculation, so both do the same work). ``random``: random
token-id prompts sampling ``--max-tokens`` tokens (seeded, temperature 1, EOS ignored), where a lookup rarely
finds anything. The default config stops proposing at 16 running requests (``disable_by_batch_size``), where
on a 2-core CPU verifying drafts costs more than it saves.

Each (workload, concurrency) runs the plain engine and the speculating one alternately, ``--rounds``
times each after a warm-up, and reports medians: TPOT is each request's (finish - first token) /
(output tokens - 1), its median over the batch; output tok/s is the batch's tokens over the wall time.
"diverged" counts the requests whose tokens differ from the plain engine's: speculation keeps every token
the plain engine would sample from the same logits, but a verifying step computes a position's logits in a row
of k + 1 tokens, whose rounding can differ in the last bits from a one-token row's, so a near-tie (greedy) or a
draw within that rounding of a boundary (seeded) can go the other way, and the sequence continues from there.
``--draft-model PATH`` adds a draft-model run (``method: draft_model``). ``python -m benchmarks.speculative``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from benchmarks.common import UNDER_LOAD, print_table, resolve_model_arg, write_json
from jaxpaged import LLM, SamplingParams

PASSAGES = [
    "The harbour town wakes before the sun. Fishing boats slip out past the lighthouse while the bakery on "
    "the corner lights its ovens, and by six the smell of bread reaches the quay. Gulls argue over the "
    "nets, a bus coughs at the square, and the first ferry of the day sounds its horn twice as it leaves "
    "for the islands. By noon the market is full of tourists, crates of lemons and the noise of bargaining.",
    "To replace a bicycle chain, shift to the smallest cog, open the quick link with pliers and pull the old "
    "chain off. Lay it beside the new one to cut the new chain to the same length. Thread the new chain "
    "through the rear derailleur and over the front ring, join the ends with a fresh quick link, and pedal "
    "backwards while you pull the link tight. Finally, check every gear before you ride.",
    "Our library will change its opening hours from the first of March. On weekdays it will open at nine "
    "and close at eight; on Saturdays it will open at ten and close at four; on Sundays it will stay closed. "
    "Books can still be returned at any hour through the slot by the main door. The reading room on the "
    "second floor will be repainted in April, and study groups can book the ground floor meeting room.",
    "Photosynthesis turns light into chemical energy. In the leaves, chlorophyll absorbs light, mostly red "
    "and blue, and the energy splits water into oxygen, protons and electrons. The oxygen leaves through "
    "small pores called stomata. The electrons and protons drive the making of ATP and NADPH, which the "
    "Calvin cycle then uses to fix carbon dioxide from the air into sugars the plant can store or burn.",
]
TASKS = [
    "Repeat the following passage exactly, word for word.",
    "Correct any mistakes in the following passage and write it out again in full.",
    "Copy the passage below, then add one sentence that continues it.",
    "Rewrite the following passage line by line, keeping every sentence.",
]


def copy_prompts(llm: LLM, n: int) -> list[list[int]]:
    """``n`` chat prompts' token ids, each a task over a passage (cycling through both lists)."""
    tok = llm.get_tokenizer()
    prompts = []
    for i in range(n):
        message = f"{TASKS[i % len(TASKS)]}\n\n{PASSAGES[(i // len(TASKS) + i) % len(PASSAGES)]}"
        prompts.append(tok.apply_chat_template([{"role": "user", "content": message}]))
    return prompts


def timed(llm: LLM, prompts, params) -> tuple[float, float, int, list[list[int]]]:
    """(median TPOT in seconds, output tok/s, output tokens, the outputs' token ids) of one ``generate``."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tpots, tokens = [], 0
    for o in outs:
        n = len(o.outputs[0].token_ids)
        tokens += n
        if n > 1:
            tpots.append((o.metrics["finished_time"] - o.metrics["first_token_time"]) / (n - 1))
    return statistics.median(tpots), tokens / wall, tokens, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a model argument, or 'tiny' (random)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--workloads", default="copy,random")
    ap.add_argument(
        "--max-tokens", type=int, default=160, help="copy: the cap (EOS ends most); random: exact"
    )
    ap.add_argument("--random-prompt-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--speculative-config",
        default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2, '
        '"disable_by_batch_size": 16}',
    )
    ap.add_argument("--draft-model", default=None, help="also run method draft_model with this model")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    model = resolve_model_arg(args.model)
    levels = [int(c) for c in args.concurrency.split(",")]
    common = dict(max_num_seqs=max(levels), dtype=args.dtype)
    engines = {
        "plain": LLM(model, **common),
        "ngram": LLM(model, speculative_config=args.speculative_config, **common),
    }
    if args.draft_model:
        k = json.loads(args.speculative_config)["num_speculative_tokens"]
        spec = {
            "method": "draft_model",
            "model": resolve_model_arg(args.draft_model),
            "num_speculative_tokens": k,
        }
        engines["draft"] = LLM(model, speculative_config=spec, **common)
    vocab = engines["plain"].engine.vocab_size
    rows, results = [], []
    for workload in args.workloads.split(","):
        for c in levels:
            if workload == "copy":
                prompts = copy_prompts(engines["plain"], c)
                params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
            else:
                # Seeded sampling at temperature 1: greedy decoding of random prompts falls into loops, which
                # the lookup predicts; samples do not. Seeds make the outputs the same with and without.
                rng = np.random.default_rng(c)
                prompts = rng.integers(3, vocab, (c, args.random_prompt_len)).tolist()
                params = [
                    SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
                    for i in range(c)
                ]
            for llm in engines.values():
                timed(llm, prompts, params)  # warm-up: compiles this shape's programs
            runs = {name: [] for name in engines}
            before = {name: llm.engine.spec_decode_stats for name, llm in engines.items()}
            before = {name: None if st is None else st.copy() for name, st in before.items()}
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    runs[name].append(timed(llm, prompts, params))
            want = runs["plain"][0][3]
            base = statistics.median(r[0] for r in runs["plain"])
            for name, llm in engines.items():
                tpot = statistics.median(r[0] for r in runs[name])
                tps = statistics.median(r[1] for r in runs[name])
                stats = llm.engine.spec_decode_stats
                if stats is not None:
                    stats = stats - before[name]  # these rounds' counts
                accept = "" if not stats or not stats.num_drafts else f"{stats.acceptance_rate:.2f}"
                length = "" if not stats or not stats.num_drafts else f"{stats.mean_acceptance_length:.2f}"
                # Requests whose tokens differ from the plain engine's (see the module docstring).
                diverged = sum(a != b for a, b in zip(runs[name][0][3], want))
                rows.append(
                    [
                        workload,
                        c,
                        name,
                        f"{tpot * 1e3:.1f}",
                        f"{base / tpot:.2f}x",
                        f"{tps:.1f}",
                        accept,
                        length,
                        f"{diverged}/{c}",
                    ]
                )
                results.append(
                    dict(
                        workload=workload,
                        concurrency=c,
                        engine=name,
                        tpot_ms=tpot * 1e3,
                        speedup=base / tpot,
                        output_tok_s=tps,
                        output_tokens=runs[name][0][2],
                        acceptance_rate=None if stats is None else stats.acceptance_rate,
                        mean_acceptance_length=None if stats is None else stats.mean_acceptance_length,
                        diverged=diverged,
                    )
                )
    print_table(
        ["workload", "conc", "engine", "TPOT ms", "TPOT gain", "out tok/s", "accept", "mean len", "diverged"],
        rows,
    )
    print("(accept: accepted / drafted tokens in the measured rounds; mean len: tokens per verifying step)")
    print(UNDER_LOAD)
    write_json("speculative", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
