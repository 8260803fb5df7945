"""``jaxpaged`` command line: thin wrappers over the public Python API, with vLLM's flags and their
semantics (``jaxpaged serve MODEL --dtype auto -tp 1 --enable-prefix-caching ...``), so a copied vLLM
command line works. A bad value or an unknown flag is a usage error (exit code 2) that names the flag."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import gc
import logging
import pathlib
import sys
from collections.abc import Callable

from jaxpaged.cli_args import CHAT_TEMPLATE_HELP, add_engine_args, add_serve_args, load_chat_template
from jaxpaged.config import DEFAULT_MODEL, AsyncEngineArgs, EngineArgs
from jaxpaged.sampling_params import SamplingParams

_BOOL_WORDS = {"true", "false", "True", "False", "yes", "no", "on", "off", "1", "0"}
"""Values of the explicit form ``--flag false`` that boolean flags no longer take."""


class _Parser(argparse.ArgumentParser):
    """argparse with vLLM's conventions: flags are never abbreviated (a typo does not silently pick
    another flag), an unknown flag's error names the closest known one, and ``finish(parser, ns)``
    checks the parsed values as a whole (a bad one is a usage error, exit code 2)."""

    def __init__(self, *args, finish: Callable[[_Parser, argparse.Namespace], None] | None = None, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._finish = finish
        self._commands: argparse._SubParsersAction | None = None

    def add_subparsers(self, **kwargs) -> argparse._SubParsersAction:
        self._commands = super().add_subparsers(**kwargs)
        return self._commands

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if self._finish is not None and not extras:  # an unknown flag is reported first
            self._finish(self, ns)
        return ns, extras

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self._commands.choices.get(getattr(ns, "command", None)) if self._commands else None
            target = command or self
            target.error(f"unrecognized arguments: {' '.join(extras)}{_suggestions(extras, target)}")
        return ns


def _suggestions(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """'; did you mean --y?' naming the known flag of ``parser`` closest to each unknown one in ``extras``."""
    known = list(parser._option_string_actions)
    flags = [e.split("=", 1)[0] for e in extras if e.startswith("-")]
    close = {flag: match[0] for flag in flags if (match := difflib.get_close_matches(flag, known, n=1))}
    if not close:
        return ""
    if len(flags) == 1:
        return f"; did you mean {close[flags[0]]}?"
    return f"; did you mean {', '.join(f'{known} (for {flag})' for flag, known in close.items())}?"


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def _finish_engine_args(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """The model from the positional MODEL (``serve``) or ``--model`` (the same one if both), then every
    engine argument checked as ``EngineConfig.from_args`` checks it, its error naming the flag."""
    positional = getattr(ns, "model_tag", None)
    if positional in _BOOL_WORDS:
        parser.error(
            f"{positional!r} is not a model: boolean flags take no value; write --FLAG or --no-FLAG "
            "(e.g. --no-enable-prefix-caching)."
        )
    if positional and ns.model and positional != ns.model:
        parser.error(
            f"the model is given twice, as {positional!r} and as --model {ns.model!r}; give it once."
        )
    ns.model = positional or ns.model or DEFAULT_MODEL
    try:
        engine_args_from(ns).create_engine_config()
    except ValueError as e:
        name, _, rest = str(e).partition(" ")
        named = name in {f.name for f in dataclasses.fields(EngineArgs)}
        parser.error(f"argument --{name.replace('_', '-')}: {rest}" if named else str(e))


def _finish_serve(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    _finish_engine_args(parser, ns)
    if (ns.ssl_keyfile is None) != (ns.ssl_certfile is None):
        parser.error("argument --ssl-keyfile/--ssl-certfile: HTTPS needs both, the key and its certificate.")
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        parser.error(
            "argument --enable-auto-tool-choice: needs --tool-call-parser, to read the calls in the "
            "model's text."
        )


def _generate(ns: argparse.Namespace) -> int:
    from jaxpaged.llm import LLM

    sp = SamplingParams(
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.sampling_seed,
        max_tokens=ns.max_tokens,
    )
    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    if ns.chat:
        outs = llm.chat(
            [[{"role": "user", "content": p}] for p in ns.prompts],
            sp,
            use_tqdm=False,
            chat_template=ns.chat_template,
        )
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
    from jaxpaged.server.app import EXIT_GRACE, CORSOptions, GracefulServer
    from jaxpaged.server.serving_base import ServerLimits

    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = engine_args_from(ns)
    multihost = ns.num_processes > 1
    if multihost:  # one engine over every process's devices; process 0 serves, the others follow it
        from jaxpaged import distributed

        distributed.initialize(ns.coordinator_address, ns.num_processes, ns.process_id)
        sync_engine = distributed.build_engine(args)
        if sync_engine is None:
            return 0
        engine = AsyncLLMEngine(sync_engine, ns.max_waiting_requests, ns.max_queue_time or None)
    else:
        engine = AsyncLLMEngine.from_engine_args(
            AsyncEngineArgs(
                **vars(args),
                max_waiting_requests=ns.max_waiting_requests,
                max_queue_time=ns.max_queue_time or None,
            )
        )
    try:
        cors = CORSOptions(ns.allowed_origins, ns.allowed_methods, ns.allowed_headers, ns.allow_credentials)
        limits = ServerLimits(ns.max_request_body_bytes, ns.max_seqs_per_request, ns.max_tokens_per_request)
        app = build_app(
            engine,
            ns.served_model_name or [args.model],
            api_key=ns.api_key,
            log_prompts=ns.log_prompts,
            log_requests=ns.log_requests,
            max_log_len=ns.max_log_len,
            chat_template=ns.chat_template,
            cors=cors,
            limits=limits,
            also_jaxpaged_metric_names=ns.also_jaxpaged_metric_names,
            tool_call_parser=ns.tool_call_parser if ns.enable_auto_tool_choice else None,
        )
        # What is loaded by now (JAX, transformers, the model, the app) lives as long as the server: out of
        # the cyclic collector's reach, a full collection walks only what serving allocates, instead of
        # stalling every stream for ~0.3 s over half a million objects.
        gc.collect()
        gc.freeze()
        config = uvicorn.Config(
            app,
            host=ns.host,
            port=ns.port,
            log_level=ns.log_level,
            root_path=ns.root_path,
            ssl_keyfile=ns.ssl_keyfile,
            ssl_certfile=ns.ssl_certfile,
            timeout_graceful_shutdown=EXIT_GRACE,
        )
        GracefulServer(config, engine, ns.shutdown_timeout).run()
    finally:
        engine.shutdown()
        if multihost:
            distributed.stop_followers(engine.engine)
    return 0


def _convert(ns: argparse.Namespace) -> int:
    from jaxpaged.convert import convert_checkpoint

    out = convert_checkpoint(ns.model, ns.output, dtype=ns.dtype)
    print(f"wrote {out} ({ns.dtype}); use it as --model {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxpaged", description="PagedAttention LLM serving on JAX, with vLLM's flags.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate", help="Generate completions for prompts and print them.", finish=_finish_engine_args
    )
    gen.add_argument("prompts", nargs="+", help="Prompt texts.")
    gen.add_argument(
        "--chat", action="store_true", help="Wrap each prompt as a user message in the chat template."
    )
    gen.add_argument(
        "--chat-template", type=load_chat_template, default=None, help=f"With --chat: {CHAT_TEMPLATE_HELP}"
    )
    gen.add_argument("--max-tokens", type=int, default=64, help="Tokens to generate per prompt.")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sampling-seed", type=int, default=None, help="Seed for sampling.")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser(
        "serve", help="Serve the model over an OpenAI-compatible HTTP API.", finish=_finish_serve
    )
    add_serve_args(serve)
    serve.set_defaults(func=_serve)

    from jaxpaged.config import DTYPES

    convert = sub.add_parser(
        "convert",
        help="Write a model as an orbax checkpoint (our param tree, model card, "
        "tokenizer) that starts up fast; use the directory as --model.",
    )
    convert.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="HF model directory, a .gguf file, an orbax "
        f"checkpoint directory or the alias '{DEFAULT_MODEL}' (default).",
    )
    convert.add_argument("--output", required=True, help="New directory to write.")
    convert.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype the params are stored in.")
    convert.set_defaults(func=_convert)

    bench = sub.add_parser(
        "bench",
        help="Run a benchmark of benchmarks/ (as python -m benchmarks.NAME, from a "
        "source checkout); the arguments after NAME are the benchmark's.",
    )
    bench.add_argument(
        "name",
        choices=_benchmark_names(),
        help="The benchmark; `jaxpaged bench NAME --help` lists its flags.",
    )
    bench.add_argument("args", nargs=argparse.REMAINDER, help="The benchmark's own arguments.")
    bench.set_defaults(func=_bench)
    return parser


_SOURCE_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _benchmark_names() -> list[str]:
    """The modules of the source checkout's ``benchmarks/`` that run as scripts."""
    return sorted(
        p.stem
        for p in (_SOURCE_ROOT / "benchmarks").glob("*.py")
        if 'if __name__ == "__main__":' in p.read_text()
    )


def _bench(ns: argparse.Namespace) -> int:
    """``benchmarks.<name>`` run as ``__main__`` with ``ns.args`` as its command line."""
    import runpy

    if not (_SOURCE_ROOT / "benchmarks" / "__init__.py").is_file():
        raise FileNotFoundError(
            f"no benchmarks/ next to the package in {_SOURCE_ROOT}: the benchmarks run from "
            "a source checkout (pip install -e '.[bench]')."
        )
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
