"""The command line's argument definitions: the engine's flags, generated from ``EngineArgs``, and
``serve``'s own flags with the converters that check their values (``jaxpaged.cli`` parses and runs them)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import typing
from collections.abc import Callable

from jaxpaged.config import (
    ATTENTION_BACKENDS,
    DTYPE_CHOICES,
    MATMUL_BACKENDS,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    EngineArgs,
    parse_size,
)

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


DEFAULT_MAX_QUEUE_TIME = 60.0
"""At full load the 1,024-deep queue is minutes long; after a minute (a common load balancer idle time-out) a
client is better off retrying elsewhere."""
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
"""Kubernetes' default grace period is 30 s; give the pod a longer one to use all of it."""

CHAT_TEMPLATE_HELP = (
    "Jinja chat template used instead of the tokenizer's: a file's path, or the template's text "
    "itself (told apart as vLLM does)."
)


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    """``serve``'s flags: the server's own, then the engine's (``add_engine_args``)."""
    from jaxpaged.async_engine import DEFAULT_MAX_WAITING_REQUESTS
    from jaxpaged.server.serving_base import DEFAULT_MAX_SEQS_PER_REQUEST, ServerLimits
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
    serve.add_argument("--chat-template", type=load_chat_template, default=None, help=CHAT_TEMPLATE_HELP)
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
