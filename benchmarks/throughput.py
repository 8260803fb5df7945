"""Offline throughput: ``LLM.generate`` over a seeded synthetic workload, optionally side by
side with Hugging Face transformers static batching (``--peer hf``) or vLLM's CPU build
(``--peer vllm``: ``vllm.LLM.generate`` in a virtualenv of its own, see ``benchmarks/vllm_peer.py``)
on the same model and requests (same token ids and output lengths, ignore_eos, temperature 0).

``python -m benchmarks.throughput --n 64 --seed 0 [--peer hf] [--peer vllm]``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.workload import WorkloadRequest, synthetic

RESULTS = Path(__file__).parent / "results"


def run_jaxpaged(reqs: list[WorkloadRequest], engine_args: dict, rounds: int) -> dict:
    from jaxpaged import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**engine_args)
    load_s = time.perf_counter() - t0
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    prompts = [r.prompt_token_ids for r in reqs]
    runs = []
    for _ in range(rounds):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(time.perf_counter() - t)
        assert [len(o.outputs[0].token_ids) for o in outs] == [r.output_len for r in reqs]
    return {"system": "jaxpaged", "load_s": load_s, "seconds": runs,
            "compiled_programs": llm.engine.runner.num_compiled_programs}


def run_hf(reqs: list[WorkloadRequest], batch_sizes: list[int], model: str) -> dict:
    """Static batching: each batch is left-padded to its longest prompt and generates until its
    longest output; only the requested output tokens count as useful."""
    import torch
    import transformers

    from jaxpaged.weights import resolve_model_path

    path = resolve_model_path(model)
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent if kw else path, dtype=torch.float32,
                                                           **kw).eval()
    hf.generation_config.eos_token_id = None
    best = None
    for bs in batch_sizes:
        t = time.perf_counter()
        for i in range(0, len(reqs), bs):
            batch = reqs[i:i + bs]
            longest = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.zeros((len(batch), longest), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, r in enumerate(batch):
                ids[j, longest - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
                mask[j, longest - len(r.prompt_token_ids):] = 1
            with torch.no_grad():
                hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                            max_new_tokens=max(r.output_len for r in batch), min_new_tokens=None)
        seconds = time.perf_counter() - t
        print(f"  hf static batch {bs}: {seconds:.1f} s")
        if best is None or seconds < best["seconds"][0]:
            best = {"system": f"hf-static(batch={bs})", "seconds": [seconds]}
    return best


def run_vllm(reqs: list[WorkloadRequest], args, ours_rows: list[dict]) -> list[dict]:
    """vLLM rows (best round per dtype), each with the ratio of ours (best round) to it."""
    from benchmarks import vllm_peer

    vllm_peer.setup()
    ours = max(r["output_tok_per_s"] for r in ours_rows if r["system"].startswith("jaxpaged"))
    rows = []
    for dtype in args.vllm_dtypes.split(","):
        res = vllm_peer.run(reqs, args.model, dtype, args.vllm_rounds, args.max_num_seqs,
                            args.max_num_batched_tokens)
        print(f"{res['system']}: load {res['load_s']:.1f} s, rounds {', '.join(f'{s:.1f}' for s in res['seconds'])} s")
        row = report(res["system"], reqs, min(res["seconds"]))
        row["ratio_jaxpaged_over_peer"] = ours / row["output_tok_per_s"]
        print(f"  ratio jaxpaged / {res['system']} (output tok/s): {row['ratio_jaxpaged_over_peer']:.2f}x")
        rows.append(row)
    return rows


def report(name: str, reqs: list[WorkloadRequest], seconds: float) -> dict:
    out_tokens = sum(r.output_len for r in reqs)
    all_tokens = out_tokens + sum(len(r.prompt_token_ids) for r in reqs)
    row = {"system": name, "n": len(reqs), "seconds": seconds, "req_per_s": len(reqs) / seconds,
           "output_tok_per_s": out_tokens / seconds, "total_tok_per_s": all_tokens / seconds}
    print(f"{name:<28} {len(reqs):>4} {seconds:>9.1f} {row['req_per_s']:>8.2f} "
          f"{row['output_tok_per_s']:>12.1f} {row['total_tok_per_s']:>12.1f}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2, help="jaxpaged runs (the first includes compilation)")
    ap.add_argument("--peer", choices=["hf", "vllm"], action="append", default=[])
    ap.add_argument("--peer-n", type=int, default=16, help="requests for the (slow) HF peer")
    ap.add_argument("--hf-batch-sizes", default="1,8")
    ap.add_argument("--vllm-dtypes", default="float32,bfloat16", help="vLLM runs, one per dtype")
    ap.add_argument("--vllm-rounds", type=int, default=2)
    args = ap.parse_args()

    reqs = synthetic(args.n, args.seed)
    engine_args = dict(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=512)
    res = run_jaxpaged(reqs, engine_args, args.rounds)
    print(f"jaxpaged: load {res['load_s']:.1f} s, compiled step programs {res['compiled_programs']}")
    header = f"{'system':<28} {'n':>4} {'seconds':>9} {'req/s':>8} {'out tok/s':>12} {'total tok/s':>12}"
    print(header)
    rows = [report(f"jaxpaged (run {i + 1})", reqs, s) for i, s in enumerate(res["seconds"])]
    if "hf" in args.peer:
        peer_reqs = reqs[:args.peer_n]
        hf = run_hf(peer_reqs, [int(b) for b in args.hf_batch_sizes.split(",")], args.model)
        print(header)
        hf_row = report(hf["system"], peer_reqs, hf["seconds"][0])
        rows.append(hf_row)
        ours = max(r["output_tok_per_s"] for r in rows if r["system"].startswith("jaxpaged"))
        print(f"ratio jaxpaged / HF (useful output tok/s): {ours / hf_row['output_tok_per_s']:.1f}x")
    if "vllm" in args.peer:
        rows += run_vllm(reqs, args, rows)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "throughput.json").write_text(json.dumps({"args": vars(args), "rows": rows,
                                                         "compiled_programs": res["compiled_programs"]}, indent=1))


if __name__ == "__main__":
    main()
