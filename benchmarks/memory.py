"""KV-cache memory utilization over a trace (the vLLM paper's Figure 2) and blocks saved by sharing.

The seeded synthetic workload runs through ``LLMEngine`` step by step. After every step it
samples, over the sequences holding KV blocks:

- tokens held: KV slots holding a real token (each sequence's ``num_computed_tokens``; a block
  shared by several sequences counts once, filled as far as its fullest owner);
- jaxpaged: slots allocated = blocks in use x block_size (waste only in each sequence's last block);
- static reservation (Orca / FasterTransformer style, on the same trace): each running
  sequence reserves ``max_model_len`` slots from admission to finish;
- static oracle: each reserves exactly prompt + max_tokens slots (the best a static system can do).

Utilization = tokens held / slots; reported per step (plotted), as the mean over steps, weighted
by slots (sum held / sum slots), at the step with the most slots in use, and at the last step.
Then, unless ``--skip-sharing``, the blocks saved by parallel sampling (n = 2/4/6) and beam
search (width 2/4/6), from ``benchmarks.memory_sharing``.

``python -m benchmarks.memory [--model smollm2-135m-instruct|tiny] [--n 64] [--block-size 16]``
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

import numpy as np

from benchmarks import memory_sharing
from benchmarks.common import new_figure, print_table, resolve_model_arg, save_figure, write_json
from benchmarks.workload import WorkloadRequest, synthetic
from jaxpaged.config import EngineArgs

SYSTEMS = ("jaxpaged", "static_max", "static_oracle")


@dataclass(frozen=True)
class SlotSample:
    """One step's KV-slot counts (over the sequences holding device blocks)."""

    step: int
    num_seqs: int
    tokens_held: int
    blocks_in_use: int
    jaxpaged: int
    """Slots allocated by jaxpaged: blocks in use x block_size."""
    static_max: int
    """Slots a static system reserves: max_model_len per sequence."""
    static_oracle: int
    """Slots reserved for exactly prompt + max_tokens per sequence."""


def live_sequences(engine) -> list:
    """Sequences holding device KV blocks now (running, or waiting with a prefix hit)."""
    sched = engine.scheduler
    return [r for r in [*sched.running, *sched.waiting] if r.block_ids]


def tokens_held(seqs, block_size: int) -> int:
    """KV slots holding a real token: per distinct block, the fill of its fullest owner."""
    fill: dict[int, int] = {}
    for r in seqs:
        for i, b in enumerate(r.block_ids):
            n = min(block_size, max(0, r.num_computed_tokens - i * block_size))
            fill[b] = max(fill.get(b, 0), n)
    return sum(fill.values())


def sample(engine, step: int) -> SlotSample:
    bs = engine.cache_info.block_size
    seqs = live_sequences(engine)
    used = engine.kv_cache_manager.pool.num_used_blocks
    return SlotSample(
        step=step,
        num_seqs=len(seqs),
        tokens_held=tokens_held(seqs, bs),
        blocks_in_use=used,
        jaxpaged=used * bs,
        static_max=len(seqs) * engine.max_model_len,
        static_oracle=sum(r.num_prompt_tokens + r.max_tokens for r in seqs),
    )


def run_trace(engine, reqs: list[WorkloadRequest]) -> list[SlotSample]:
    """Add every request (greedy, ``ignore_eos``, exact output lengths), step to the end, and
    sample after every step that leaves KV in use."""
    from jaxpaged import SamplingParams

    vocab = engine.vocab_size
    for i, r in enumerate(reqs):
        engine.add_request(
            f"mem-{i}",
            [t % vocab for t in r.prompt_token_ids],
            SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True),
        )
    samples, step = [], 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        s = sample(engine, step)
        if s.blocks_in_use:
            samples.append(s)
    return samples


def utilization(samples: list[SlotSample], system: str) -> dict[str, float]:
    """Tokens held / slots of ``system``: mean over steps, slot-weighted, at peak slots, at the end."""
    held = np.array([s.tokens_held for s in samples], float)
    slots = np.array([getattr(s, system) for s in samples], float)
    per_step = held / slots
    peak = int(np.argmax(slots))
    return {
        "mean_over_steps": float(per_step.mean()),
        "slot_weighted": float(held.sum() / slots.sum()),
        "at_peak": float(per_step[peak]),
        "final": float(per_step[-1]),
        "peak_slots": int(slots[peak]),
    }


def plot(samples: list[SlotSample], block_size: int, path_name: str = "memory") -> None:
    fig, (ax_u, ax_s) = new_figure(ncols=2)
    steps = [s.step for s in samples]
    labels = {
        "jaxpaged": f"jaxpaged (paged, block {block_size})",
        "static_max": "static: max_model_len",
        "static_oracle": "static: prompt + max_tokens",
    }
    for system in SYSTEMS:
        ax_u.plot(steps, [100 * s.tokens_held / getattr(s, system) for s in samples], label=labels[system])
        ax_s.plot(steps, [getattr(s, system) for s in samples], label=labels[system])
    ax_s.plot(steps, [s.tokens_held for s in samples], "k--", label="tokens held")
    ax_u.set(
        xlabel="engine step",
        ylabel="% of allocated KV slots holding a token",
        ylim=(0, 101),
        title="KV-cache utilization",
    )
    ax_s.set(xlabel="engine step", ylabel="KV slots", title="slots allocated vs. tokens held")
    ax_u.legend()
    ax_s.legend()
    save_figure(fig, path_name)


def run_sharing(llm, args) -> list[dict]:
    """Blocks saved by parallel sampling and beam search (``benchmarks.memory_sharing``)."""
    reqs = synthetic(args.sharing_prompts, args.seed, prompt_mean=128, output_mean=96, max_total=384)
    vocab = llm.engine.vocab_size
    reqs = [WorkloadRequest([t % vocab for t in r.prompt_token_ids], r.output_len) for r in reqs]
    print(f"\nblocks saved by sharing ({len(reqs)} prompts, block size {args.block_size})")
    print(f"{'workload':<9} {'width':>5} {'saved':>10} {'peak':>10} {'steps':>6} {'seconds':>8}")
    return [
        memory_sharing.sharing(llm, kind, int(w), reqs, args.seed)
        for kind in ("parallel", "beam")
        for w in args.widths.split(",")
    ]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="model, or 'tiny' (a random 2-layer model: the slot counts do not depend on the model)",
    )
    ap.add_argument("--n", type=int, default=64, help="requests in the trace")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=EngineArgs.block_size, help="default: the engine's")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--skip-sharing", action="store_true", help="skip the parallel-sampling / beam figures")
    ap.add_argument("--sharing-prompts", type=int, default=8)
    ap.add_argument("--widths", default="2,4,6")
    args = ap.parse_args(argv)

    from jaxpaged import LLM

    llm = LLM(
        resolve_model_arg(args.model),
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
    )
    reqs = synthetic(args.n, args.seed, max_total=args.max_model_len)
    samples = run_trace(llm.engine, reqs)
    util = {system: utilization(samples, system) for system in SYSTEMS}
    print(
        f"{args.n} requests (prompt mean {np.mean([len(r.prompt_token_ids) for r in reqs]):.0f}, output mean "
        f"{np.mean([r.output_len for r in reqs]):.0f} tokens), block size {args.block_size}, max_model_len "
        f"{args.max_model_len}, {len(samples)} steps sampled"
    )
    print("% of allocated KV slots holding a token:")
    print_table(
        ["system", "mean/step", "slot-weighted", "at peak", "final", "peak slots"],
        [
            [
                s,
                100 * u["mean_over_steps"],
                100 * u["slot_weighted"],
                100 * u["at_peak"],
                100 * u["final"],
                u["peak_slots"],
            ]
            for s, u in util.items()
        ],
        widths=[16, 12, 15, 10, 10, 12],
    )
    target = util["jaxpaged"]["mean_over_steps"] >= 0.97
    print(
        f"jaxpaged time-averaged utilization {100 * util['jaxpaged']['mean_over_steps']:.1f}% "
        f"(target >= 97%: {'met' if target else 'NOT met'})"
    )
    plot(samples, args.block_size)
    sharing = None if args.skip_sharing else run_sharing(llm, args)
    result = {
        "args": vars(args),
        "utilization": util,
        "samples": [asdict(s) for s in samples],
        "sharing": sharing,
    }
    write_json("memory", result)
    return result


if __name__ == "__main__":
    main()
