"""``jaxpaged`` command line: thin wrappers over the public Python API, with vLLM's flags and their
semantics (``jaxpaged serve MODEL --dtype auto -tp 1 --enable-prefix-caching ...``), so a copied vLLM
command line works. A bad value or an unknown flag is a usage error (exit code 2) that names the flag."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import gc
import json
import logging
import pathlib
import sys
import typing
from collections.abc import Callable

from jaxpaged.config import (
    ATTENTION_BACKENDS,
    DEFAULT_MODEL,
    DTYPE_CHOICES,
    MATMUL_BACKENDS,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    AsyncEngineArgs,
    EngineArgs,
    parse_size,
)
from jaxpaged.sampling_params import SamplingParams

_CHOICES = {
    "dtype": DTYPE_CHOICES,
    "attention_backend": ATTENTION_BACKENDS,
    "matmul_backend": MATMUL_BACKENDS,
    "quantization": QUANTIZATIONS,
    "preemption_mode": PREEMPTION_MODES,
    "scheduling_policy": SCHEDULING_POLICIES,
}
_ALIASES = {"tensor_parallel_size": "-tp", "data_parallel_size": "-dp"}
"""vLLM's short names of engine arguments."""
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


def _engine_arg_kind(hint) -> type:
    """The type a field's CLI value converts to: bool, str where the field takes strings (``int | str``:
    a size such as 4GiB, parsed by ``EngineConfig.from_args``), else its one other type."""
    kinds = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    return str if str in kinds else kinds[0]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineArgs`` field, typed and documented from the dataclass: bools as
    ``--flag`` / ``--no-flag``, vLLM's ``-tp`` and ``-dp`` aliases. ``--model`` parses as None when not
    given, so a positional model can be told apart (``_finish_engine_args`` fills the default in)."""
    group = parser.add_argument_group("engine arguments")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flags = [f"--{f.name.replace('_', '-')}", *([_ALIASES[f.name]] if f.name in _ALIASES else [])]
        help = f"{f.metadata['help']} (default: {f.default})".replace("%", "%%")
        kind = _engine_arg_kind(hints[f.name])
        if kind is bool:
            group.add_argument(
                *flags, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=help
            )
            continue
        group.add_argument(
            *flags,
            dest=f.name,
            type=kind,
            choices=_CHOICES.get(f.name),
            default=None if f.name == "model" else f.default,
            help=help,
        )


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


def _int_at_least(low: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    return convert


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text, "the size")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {text!r}")
    return value


def _json_list(text: str) -> list[str]:
    """A JSON list of strings, as vLLM's CORS flags take them (``'["https://a.example"]'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"*\"]', got {text!r}")
    return value


def _existing_file(text: str) -> str:
    if not pathlib.Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def load_chat_template(value: str) -> str:
    """``--chat-template``'s value as vLLM reads it: the text of the file it names if it can be read;
    otherwise, if it has any of Jinja's ``{`` ``}`` or a newline, the template itself, its backslash
    escapes (``\\n``) decoded, as a shell passes them; otherwise it was meant as a path: an error."""
    try:
        return pathlib.Path(value).read_text()
    except (OSError, ValueError) as e:
        if not any(c in value for c in "{}\n"):
            reason = e.strerror if isinstance(e, OSError) else e
            raise argparse.ArgumentTypeError(
                f"{value!r} looks like a file path but cannot be read ({reason}); "
                "give a readable Jinja file or the template's text"
            ) from None
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


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
    from jaxpaged.server.serving import ServerLimits

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


DEFAULT_MAX_QUEUE_TIME = 60.0
"""At full load the 1,024-deep queue is minutes long; after a minute (a common load balancer idle time-out) a
client is better off retrying elsewhere."""
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
"""Kubernetes' default grace period is 30 s; give the pod a longer one to use all of it."""

_CHAT_TEMPLATE_HELP = (
    "Jinja chat template used instead of the tokenizer's: a file's path, or the template's text "
    "itself (told apart as vLLM does)."
)


def _add_serve_args(serve: argparse.ArgumentParser) -> None:
    from jaxpaged.async_engine import DEFAULT_MAX_WAITING_REQUESTS
    from jaxpaged.server.serving import DEFAULT_MAX_SEQS_PER_REQUEST, ServerLimits
    from jaxpaged.server.tool_parsers import TOOL_PARSERS

    serve.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="The model, as in `vllm serve MODEL` (or --model; both: the same one).",
    )
    serve.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument(
        "--api-key",
        default=None,
        help="Require 'Authorization: Bearer <key>' on /v1/* and /tokenize, /detokenize "
        "(/health and /metrics stay open).",
    )
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="Names clients may use for the model; responses and /metrics report the first, "
        "/v1/models lists them all (default: the model argument).",
    )
    serve.add_argument("--chat-template", type=load_chat_template, default=None, help=_CHAT_TEMPLATE_HELP)
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='Let the model decide whether to call tools (tool_choice "auto", the default when a request '
        "gives tools): --tool-call-parser then finds the calls in its text. Without it such "
        'requests get 400; "required" and named functions work either way.',
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=list(TOOL_PARSERS),
        default=None,
        help="How the model writes tool calls: hermes (<tool_call>{...}</tool_call>: Qwen2.5, "
        "SmolLM, Hermes) or llama3_json (Llama 3.1+ JSON calls; llama4_json is the same).",
    )
    serve.add_argument(
        "--also-jaxpaged-metric-names",
        action="store_true",
        help="/metrics names its metrics as vLLM does (vllm:*), so that vLLM's dashboards work; this "
        "also exposes each under jaxpaged:* (the prefix jaxpaged used before).",
    )
    limits = serve.add_argument_group("limits (what one request may take; past them: 400, 413 or 503)")
    limits.add_argument(
        "--max-waiting-requests",
        type=_int_at_least(1),
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help="Queued requests (prompts) beyond this are refused with 503 + Retry-After instead of "
        "piling up (default: %(default)s).",
    )
    limits.add_argument(
        "--max-queue-time",
        type=_seconds,
        default=DEFAULT_MAX_QUEUE_TIME,
        help="Seconds a request may wait for its first step; then it ends with 503 + Retry-After "
        "(a stream: an error event), so that a full queue (minutes deep at full load) sends "
        "clients elsewhere instead of holding them; 0: no limit (default: %(default)s).",
    )
    limits.add_argument(
        "--max-request-body-bytes",
        type=_size,
        default=ServerLimits.max_request_body_bytes,
        help="Larger request bodies get 413 before they are read (bytes, or a size such as 4MiB; "
        "default: 4MiB).",
    )
    limits.add_argument(
        "--max-seqs-per-request",
        type=_int_at_least(1),
        default=DEFAULT_MAX_SEQS_PER_REQUEST,
        help="Most sequences one request may run: prompts x n (or best_of); more is a 400 "
        "(default: %(default)s).",
    )
    limits.add_argument(
        "--max-tokens-per-request",
        type=_int_at_least(1),
        default=None,
        help="Largest max_tokens a request gets: larger or unset ones are capped to it, as a model's "
        "max_new_tokens caps them (default: only --max-model-len bounds it).",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        help="On SIGTERM/SIGINT: seconds requests in flight may take to finish while new ones get 503; "
        "then the rest end with an error and the server exits 0. A second signal exits at once. "
        "(vLLM's flag; default: %(default)s, vLLM's is 0.)",
    )
    serve.add_argument(
        "--root-path", default="", help="Path prefix a proxy serves the API under (uvicorn's root_path)."
    )
    serve.add_argument(
        "--ssl-keyfile", type=_existing_file, default=None, help="Serve HTTPS with this private key."
    )
    serve.add_argument("--ssl-certfile", type=_existing_file, default=None, help="... and this certificate.")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    log = serve.add_argument_group(
        "request logging (a line per request at INFO: its token counts and latency)"
    )
    log.add_argument(
        "--enable-log-requests",
        dest="log_requests",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Log each request (vLLM's newer flag; on here by default).",
    )
    log.add_argument(
        "--disable-log-requests",
        dest="log_requests",
        action="store_false",
        help="No per-request log lines (vLLM's flag; the same as --no-enable-log-requests).",
    )
    log.add_argument(
        "--log-prompts", action="store_true", help="Log prompt texts too (off: only token counts)."
    )
    log.add_argument(
        "--max-log-len",
        type=_int_at_least(0),
        default=None,
        help="Log at most this many characters (or token ids) of a prompt, with --log-prompts "
        "(default: all of it).",
    )
    cors = serve.add_argument_group("CORS (browser requests from other origins; vLLM's flags and defaults)")
    for what in ("origins", "methods", "headers"):
        cors.add_argument(
            f"--allowed-{what}",
            type=_json_list,
            default=["*"],
            help=f'Allowed {what}, a JSON list (default: ["*"], any).',
        )
    cors.add_argument(
        "--allow-credentials", action="store_true", help="Allow credentials (cookies, auth headers)."
    )
    multi = serve.add_argument_group("multi-host (one engine over several processes, on jax.distributed)")
    multi.add_argument(
        "--coordinator-address",
        default=None,
        help="HOST:PORT of process 0, which coordinates, schedules and serves HTTP.",
    )
    multi.add_argument("--num-processes", type=_int_at_least(1), default=1, help="Processes (hosts) in all.")
    multi.add_argument(
        "--process-id", type=_int_at_least(0), default=0, help="This process's index, 0 = the leader."
    )
    add_engine_args(serve)


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
        "--chat-template", type=load_chat_template, default=None, help=f"With --chat: {_CHAT_TEMPLATE_HELP}"
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
    _add_serve_args(serve)
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
