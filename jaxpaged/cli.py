"""``jaxpaged`` command line: thin wrappers over the public Python API."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import pathlib
import sys
import typing

from jaxpaged.config import EngineArgs
from jaxpaged.sampling_params import SamplingParams


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per ``EngineArgs`` field, typed and documented from the dataclass."""
    group = parser.add_argument_group("engine arguments")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        kind = hints[f.name]
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        conv = _bool if base is bool else base
        group.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=conv, default=f.default,
                           help=f"{f.metadata['help']} (default: {f.default})")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def _generate(ns: argparse.Namespace) -> int:
    from jaxpaged.llm import LLM

    sp = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, seed=ns.sampling_seed,
                        max_tokens=ns.max_tokens)
    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    if ns.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in ns.prompts], sp, use_tqdm=False)
    else:
        outs = llm.generate(ns.prompts, sp, use_tqdm=False)
    for prompt, out in zip(ns.prompts, outs):
        c = out.outputs[0]
        print(f"### prompt: {prompt!r}\n{c.text}\n### ({len(c.token_ids)} tokens, finish: {c.finish_reason})")
    return 0


def _serve(ns: argparse.Namespace) -> int:
    import uvicorn

    from jaxpaged.async_engine import AsyncLLMEngine
    from jaxpaged.server import build_app

    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = engine_args_from(ns)
    multihost = ns.num_processes > 1
    if multihost:       # one engine over every process's devices; process 0 serves, the others follow it
        from jaxpaged import distributed

        distributed.initialize(ns.coordinator_address, ns.num_processes, ns.process_id)
        sync_engine = distributed.build_engine(args)
        if sync_engine is None:
            return 0
        engine = AsyncLLMEngine(sync_engine, max_waiting_requests=ns.max_waiting_requests)
    else:
        engine = AsyncLLMEngine.from_engine_args(args, max_waiting_requests=ns.max_waiting_requests)
    try:
        app = build_app(engine, ns.served_model_name or args.model, api_key=ns.api_key, log_prompts=ns.log_prompts)
        # What is loaded by now (JAX, transformers, the model, the app) lives as long as the server: out of
        # the cyclic collector's reach, a full collection walks only what serving allocates, instead of
        # stalling every stream for ~0.3 s over half a million objects.
        gc.collect()
        gc.freeze()
        uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level)
    finally:
        engine.shutdown()
        if multihost:
            distributed.stop_followers(engine.engine)
    return 0


def _convert(ns: argparse.Namespace) -> int:
    from jaxpaged.weights import convert_checkpoint

    out = convert_checkpoint(ns.model, ns.output, dtype=ns.dtype)
    print(f"wrote {out} ({ns.dtype}); use it as --model {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpaged", description="PagedAttention LLM serving on JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="Generate completions for prompts and print them.")
    gen.add_argument("prompts", nargs="+", help="Prompt texts.")
    gen.add_argument("--chat", action="store_true", help="Wrap each prompt as a user message in the chat template.")
    gen.add_argument("--max-tokens", type=int, default=64, help="Tokens to generate per prompt.")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sampling-seed", type=int, default=None, help="Seed for sampling.")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    from jaxpaged.async_engine import DEFAULT_MAX_WAITING_REQUESTS

    serve = sub.add_parser("serve", help="Serve the model over an OpenAI-compatible HTTP API.")
    serve.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="Require 'Authorization: Bearer <key>' on /v1/* and /tokenize, /detokenize "
                            "(/health and /metrics stay open).")
    serve.add_argument("--served-model-name", default=None,
                       help="Model name clients must use (default: the --model argument).")
    serve.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                       help="Queued requests beyond this are refused with 503 instead of piling up.")
    serve.add_argument("--log-prompts", action="store_true", help="Log prompt texts (off: only token counts).")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    multi = serve.add_argument_group("multi-host (one engine over several processes, on jax.distributed)")
    multi.add_argument("--coordinator-address", default=None,
                       help="HOST:PORT of process 0, which coordinates, schedules and serves HTTP.")
    multi.add_argument("--num-processes", type=int, default=1, help="Processes (hosts) in all.")
    multi.add_argument("--process-id", type=int, default=0, help="This process's index, 0 = the leader.")
    add_engine_args(serve)
    serve.set_defaults(func=_serve)

    from jaxpaged.config import DEFAULT_MODEL, DTYPES

    convert = sub.add_parser("convert", help="Write a model as an orbax checkpoint (our param tree, model card, "
                                             "tokenizer) that starts up fast; use the directory as --model.")
    convert.add_argument("--model", default=DEFAULT_MODEL, help="HF model directory, a .gguf file, an orbax "
                         f"checkpoint directory or the alias '{DEFAULT_MODEL}' (default).")
    convert.add_argument("--output", required=True, help="New directory to write.")
    convert.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype the params are stored in.")
    convert.set_defaults(func=_convert)

    bench = sub.add_parser("bench", help="Run a benchmark of benchmarks/ (as python -m benchmarks.NAME, from a "
                                         "source checkout); the arguments after NAME are the benchmark's.")
    bench.add_argument("name", choices=_benchmark_names(),
                       help="The benchmark; `jaxpaged bench NAME --help` lists its flags.")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="The benchmark's own arguments.")
    bench.set_defaults(func=_bench)
    return parser


_SOURCE_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _benchmark_names() -> list[str]:
    """The modules of the source checkout's ``benchmarks/`` that run as scripts."""
    return sorted(p.stem for p in (_SOURCE_ROOT / "benchmarks").glob("*.py")
                  if 'if __name__ == "__main__":' in p.read_text())


def _bench(ns: argparse.Namespace) -> int:
    """``benchmarks.<name>`` run as ``__main__`` with ``ns.args`` as its command line."""
    import runpy

    if not (_SOURCE_ROOT / "benchmarks" / "__init__.py").is_file():
        raise FileNotFoundError(f"no benchmarks/ next to the package in {_SOURCE_ROOT}: the benchmarks run from "
                                "a source checkout (pip install -e '.[bench]').")
    sys.path.insert(0, str(_SOURCE_ROOT))
    sys.argv = [f"jaxpaged bench {ns.name}", *ns.args]
    runpy.run_module(f"benchmarks.{ns.name}", run_name="__main__", alter_sys=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxpaged: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
