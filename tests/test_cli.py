"""vLLM's command line and argument semantics: a copied ``vllm serve`` command parses into the same
settings (positional model, ``--dtype auto``, ``--gpu-memory-utilization``, ``--swap-space`` in GiB, sizes
with units, bare boolean flags, ``-tp`` / ``-dp``, several served names, a chat template, CORS, request
logging), and a bad value or unknown flag is a usage error naming the flag."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging

import httpx
import jinja2
import pytest
import transformers
import uvicorn
from starlette.testclient import TestClient

from jaxpaged import LLM, EngineArgs, SamplingParams, auto_dtype
from jaxpaged.async_engine import AsyncLLMEngine
from jaxpaged.cli import build_parser, engine_args_from, main
from jaxpaged.cli_args import load_chat_template
from jaxpaged.config import DEFAULT_MODEL, EngineConfig
from jaxpaged.kernels import cpu_matmul
from jaxpaged.server import app as server_app
from jaxpaged.server import build_app
from jaxpaged.server.app import CORSOptions
from jaxpaged.server.serving_base import ServerLimits
from test_server import ENGINE_ARGS, serve

VLLM_COMMAND = (
    "serve HuggingFaceTB/SmolLM2-135M-Instruct --dtype auto --gpu-memory-utilization 0.9 --swap-space 4 "
    "--enable-prefix-caching -tp 1 --served-model-name a b --max-log-len 100 --disable-log-requests "
    "--kv-cache-memory 4GiB"
)
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]


def parse(command: str | list[str]):
    return build_parser().parse_args(command.split() if isinstance(command, str) else command)


def usage_error(capsys, command: str | list[str]) -> str:
    """The error ``main`` prints for ``command``, which must be a usage error (exit code 2, no traceback)."""
    with pytest.raises(SystemExit) as exc:
        main(command.split() if isinstance(command, str) else command)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


# ---- parsing -------------------------------------------------------------------------------------


def test_a_copied_vllm_command_line_parses_into_the_same_settings():
    ns = parse(VLLM_COMMAND)
    args = engine_args_from(ns)
    assert args.model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (args.dtype, args.gpu_memory_utilization, args.swap_space) == ("auto", 0.9, 4.0)
    assert (args.enable_prefix_caching, args.tensor_parallel_size, args.kv_cache_memory) == (True, 1, "4GiB")
    assert (ns.served_model_name, ns.max_log_len, ns.log_requests) == (["a", "b"], 100, False)
    config = dataclasses.replace(args, preemption_mode="swap").create_engine_config()
    assert (config.cache.kv_cache_memory, config.cache.swap_space) == (4 * 2**30, 4 * 2**30)
    assert (config.cache.gpu_memory_utilization, config.model.dtype) == (0.9, "auto")


def test_model_is_positional_or_a_flag_but_not_two_different_ones(capsys):
    assert parse("serve m1").model == "m1"
    assert parse("serve --model m1").model == "m1"
    assert parse("serve m1 --model m1 --port 9000").model == "m1"
    assert parse("serve --port 9000").model == DEFAULT_MODEL
    assert "given twice, as 'm1' and as --model 'm2'" in usage_error(capsys, "serve m1 --model m2")
    ns = parse("generate --model m1 hello world")  # generate's positionals are its prompts
    assert (ns.model, ns.prompts) == ("m1", ["hello", "world"])


def test_boolean_flags_are_bare_with_a_no_form(capsys):
    defaults = engine_args_from(parse("serve m"))
    assert (defaults.enable_prefix_caching, defaults.enable_chunked_prefill, defaults.precompile) == (
        True,
    ) * 3
    args = engine_args_from(
        parse(
            "serve m --no-enable-prefix-caching --no-enable-chunked-prefill --no-precompile "
            "--no-async-scheduling"
        )
    )
    assert not (
        args.enable_prefix_caching or args.enable_chunked_prefill or args.precompile or args.async_scheduling
    )
    assert engine_args_from(parse("serve m --no-precompile --precompile")).precompile
    # The explicit form of earlier versions is gone: a value after the flag is an error, not a model.
    assert "boolean flags take no value" in usage_error(capsys, "serve --enable-prefix-caching false")
    assert "unrecognized arguments: false" in usage_error(capsys, "serve m --enable-prefix-caching false")


def test_parallel_size_aliases():
    args = engine_args_from(parse("serve m -tp 2 -dp 4"))
    assert (args.tensor_parallel_size, args.data_parallel_size) == (2, 4)
    assert engine_args_from(parse("serve m --tensor-parallel-size 8")).tensor_parallel_size == 8


def test_sizes_fractions_and_swap_space_in_gib():
    def cache(flags: str):
        return engine_args_from(parse(f"serve m --preemption-mode swap {flags}")).create_engine_config().cache

    assert cache("--kv-cache-memory 1.5GiB").kv_cache_memory == 3 * 2**29
    assert cache("--kv-cache-memory 512M").kv_cache_memory == 512 * 2**20
    assert cache("--kv-cache-memory 123456").kv_cache_memory == 123456
    assert cache("--swap-space 0.25").swap_space == 2**28
    assert cache("").swap_space == 2**29  # the default, 0.5 GiB
    assert cache("--gpu-memory-utilization 1").gpu_memory_utilization == 1.0
    # Without preemption_mode=swap there is no host pool.
    assert engine_args_from(parse("serve m --swap-space 4")).create_engine_config().cache.swap_space == 0
    assert EngineConfig.from_args(EngineArgs(swap_space=1, preemption_mode="swap")).cache.swap_space == 2**30


@pytest.mark.parametrize(
    "flags, error",
    [
        (
            "--kv-cache-memory 4XB",
            "argument --kv-cache-memory: must be a whole number of bytes or a size such as 4GiB",
        ),
        ("--kv-cache-memory 0GiB", "argument --kv-cache-memory: must be a positive size"),
        (
            "--gpu-memory-utilization 0",
            r"argument --gpu-memory-utilization: must be a fraction in (0, 1], got 0.0",
        ),
        (
            "--gpu-memory-utilization 1.5",
            r"argument --gpu-memory-utilization: must be a fraction in (0, 1], got 1.5",
        ),
        ("--gpu-memory-utilization x", "argument --gpu-memory-utilization: invalid float value: 'x'"),
        ("--swap-space -1", "argument --swap-space: must be a number of GiB >= 0, got -1.0"),
        ("--dtype fp8", "argument --dtype: invalid choice: 'fp8' (choose from 'auto', 'float32'"),
        ("--block-size 7", "argument --block-size: must be a power of two from 1 to 128, got 7"),
        ("-tp 0", "argument --tensor-parallel-size: must be an integer >= 1, got 0"),
        ("--port 70000", "argument --port: expected a port from 0 to 65535"),
        ("--max-log-len -1", "argument --max-log-len: expected an integer >= 0"),
        (
            "--allowed-origins https://a.example",
            "argument --allowed-origins: expected a JSON list of strings",
        ),
        (
            "--chat-template no/such/template.jinja",
            "argument --chat-template: 'no/such/template.jinja' looks like a file path but cannot be read",
        ),
    ],
)
def test_bad_values_are_usage_errors_naming_the_flag(capsys, flags, error):
    assert error in usage_error(capsys, f"serve m {flags}")


def test_unknown_and_abbreviated_flags_fail_naming_the_closest(capsys):
    assert usage_error(capsys, "serve m --enable-prefix-cachin").endswith(
        "unrecognized arguments: --enable-prefix-cachin; did you mean --enable-prefix-caching?"
    )
    assert "did you mean --max-num-seqs?" in usage_error(
        capsys, "serve m --max-num-seq 4"
    )  # no abbreviations
    assert "did you mean --max-tokens?" in usage_error(capsys, "generate --max-token 4 hi")
    err = usage_error(capsys, "serve m --gpu-memory-utilisation 0.9 --served-model 1")
    assert "--gpu-memory-utilization (for --gpu-memory-utilisation)" in err
    assert "--served-model-name (for --served-model)" in err


def test_server_options_parse(tmp_path, capsys):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    key.write_text("k")
    cert.write_text("c")
    ns = parse(
        [
            "serve",
            "m",
            "--allowed-origins",
            '["https://a.example"]',
            "--allowed-methods",
            '["GET", "POST"]',
            "--allow-credentials",
            "--root-path",
            "/llm",
            "--ssl-keyfile",
            str(key),
            "--ssl-certfile",
            str(cert),
            "--log-prompts",
            "--enable-log-requests",
        ]
    )
    assert (ns.allowed_origins, ns.allowed_methods, ns.allowed_headers) == (
        ["https://a.example"],
        ["GET", "POST"],
        ["*"],
    )
    assert (ns.allow_credentials, ns.root_path, ns.log_prompts, ns.log_requests) == (True, "/llm", True, True)
    assert (ns.ssl_keyfile, ns.ssl_certfile) == (str(key), str(cert))
    defaults = parse("serve m")
    assert (defaults.allowed_origins, defaults.allow_credentials, defaults.log_requests) == (
        ["*"],
        False,
        True,
    )
    assert (defaults.served_model_name, defaults.max_log_len, defaults.chat_template) == (None, None, None)
    assert "HTTPS needs both" in usage_error(capsys, f"serve m --ssl-keyfile {key}")


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert parse(["serve", "m", "--chat-template", str(path)]).chat_template == TEMPLATE
    assert parse(["serve", "m", "--chat-template", TEMPLATE]).chat_template == TEMPLATE
    # Escapes typed in a shell are decoded (vLLM's rule); other characters are kept as they are.
    assert load_chat_template("{{ 'é' }}\\n{{ x }}") == "{{ 'é' }}\n{{ x }}"


# ---- dtype auto ----------------------------------------------------------------------------------


def _cpu(monkeypatch, *, flags=(), amx=False, vectorized=True):
    monkeypatch.setattr(auto_dtype, "cpu_flags", lambda: set(flags))
    monkeypatch.setattr(cpu_matmul, "use_amx", lambda enable=None: amx)
    monkeypatch.setattr(cpu_matmul, "native_matmul_available", lambda: True)
    monkeypatch.setattr(cpu_matmul, "native_matmul_vectorized", lambda: vectorized)


def _auto(platform: str, model: str = "m", **kwargs) -> str:
    config = EngineArgs(model=model, dtype="auto", **kwargs).create_engine_config()
    return auto_dtype.resolve_auto_dtype(config, platform).model.dtype


def test_dtype_auto_on_cpu_is_bfloat16_only_with_native_bfloat16_hardware(monkeypatch):
    _cpu(monkeypatch, flags={"avx512f", "avx512_bf16"})
    assert _auto("cpu") == "bfloat16"
    assert _auto("cpu", matmul_backend="xla") == "float32"  # XLA's dot is no faster in bfloat16
    assert _auto("cpu", tensor_parallel_size=2) == "float32"  # nor does the native matmul run split models
    _cpu(monkeypatch, flags={"avx512f"}, amx=True)
    assert _auto("cpu") == "bfloat16"
    _cpu(monkeypatch, flags={"avx512f", "avx2"})
    assert _auto("cpu") == "float32"
    _cpu(monkeypatch, flags={"avx512_bf16"}, vectorized=False)  # the portable loops
    assert _auto("cpu") == "float32"


def test_dtype_auto_on_accelerators_follows_vllm(tmp_path):
    def hf_dir(name: str, config: dict) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return str(tmp_path / name)

    assert _auto("gpu", hf_dir("bf16", {"torch_dtype": "bfloat16"})) == "bfloat16"
    assert _auto("gpu", hf_dir("new-bf16", {"dtype": "bfloat16"})) == "bfloat16"  # newer transformers' key
    assert _auto("gpu", hf_dir("f32", {"torch_dtype": "float32"})) == "float16"
    assert _auto("gpu", hf_dir("f16", {"torch_dtype": "float16"})) == "float16"
    assert _auto("gpu", hf_dir("none", {})) == "float16"
    (tmp_path / "m.gguf").write_bytes(b"")
    assert _auto("gpu", str(tmp_path / "m.gguf")) == "float16"
    assert _auto("tpu", hf_dir("tpu-f16", {"torch_dtype": "float16"})) == "bfloat16"


def test_explicit_dtypes_and_vllm_aliases_are_kept():
    def dtype(value: str) -> str:
        return auto_dtype.resolve_auto_dtype(
            EngineArgs(dtype=value).create_engine_config(), "gpu"
        ).model.dtype

    assert [dtype(d) for d in ("float32", "bfloat16", "half", "float")] == [
        "float32",
        "bfloat16",
        "float16",
        "float32",
    ]


def test_engine_resolves_dtype_auto_once_and_logs_it(tiny, caplog):
    expected = auto_dtype.cpu_dtype("auto", 1)
    with caplog.at_level(logging.INFO, logger="jaxpaged.auto_dtype"):
        llm = LLM(str(tiny[0]), dtype="auto", precompile=False, max_num_seqs=2, max_model_len=64)
    assert llm.engine.config.model.dtype == expected
    assert [r.getMessage() for r in caplog.records if r.name == "jaxpaged.auto_dtype"] == [
        f"dtype auto: {expected} on cpu"
    ]
    assert (
        llm.generate("The quick brown", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    )


# ---- chat template -------------------------------------------------------------------------------


def _reference_ids(tiny_dir, messages) -> list[int]:
    """The template rendered by jinja2 and encoded by the HF tokenizer: what the override must give."""
    text = jinja2.Environment().from_string(TEMPLATE).render(messages=messages, add_generation_prompt=True)
    return transformers.AutoTokenizer.from_pretrained(tiny_dir).encode(text, add_special_tokens=False)


def test_llm_chat_takes_a_chat_template(tiny):
    llm = LLM(str(tiny[0]), precompile=False, max_num_seqs=2, max_model_len=128)
    params = SamplingParams(max_tokens=1)
    want = _reference_ids(tiny[0], MESSAGES)
    assert llm.chat(MESSAGES, params, use_tqdm=False, chat_template=TEMPLATE)[0].prompt_token_ids == want
    assert llm.chat(MESSAGES, params, use_tqdm=False)[0].prompt_token_ids != want  # the tokenizer's own


# ---- the server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny):
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny[0]), **ENGINE_ARGS))
    yield eng
    eng.shutdown()


def test_served_model_names_are_aliases(engine):
    with serve(build_app(engine, ["tiny-a", "tiny-b"])) as base:
        assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == ["tiny-a", "tiny-b"]
        assert httpx.get(f"{base}/v1/models/tiny-b").json()["id"] == "tiny-b"
        for name in ("tiny-a", "tiny-b"):
            resp = httpx.post(
                f"{base}/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2}, timeout=60
            )
            assert resp.status_code == 200 and resp.json()["model"] == "tiny-a"  # responses report the first
        resp = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_cors_preflight_and_responses(engine):
    preflight = {
        "Origin": "https://a.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    with serve(build_app(engine, "tiny")) as base:  # vLLM's defaults: any origin
        resp = httpx.options(f"{base}/v1/chat/completions", headers=preflight)
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "*"
        assert "POST" in resp.headers["access-control-allow-methods"]
    cors = CORSOptions(
        allowed_origins=["https://a.example"], allowed_methods=["GET", "POST"], allow_credentials=True
    )
    with serve(build_app(engine, "tiny", api_key="k", cors=cors)) as base:
        resp = httpx.options(f"{base}/v1/chat/completions", headers=preflight)  # before the key check
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "https://a.example"
        assert resp.headers["access-control-allow-credentials"] == "true"
        other = httpx.options(
            f"{base}/v1/chat/completions", headers={**preflight, "Origin": "https://b.example"}
        )
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        models = httpx.get(
            f"{base}/v1/models", headers={"Origin": "https://a.example", "Authorization": "Bearer k"}
        )
        assert (
            models.status_code == 200 and models.headers["access-control-allow-origin"] == "https://a.example"
        )


def test_server_chat_template_override(engine, tiny):
    with serve(build_app(engine, "tiny", chat_template=TEMPLATE)) as base:
        tokens = httpx.post(f"{base}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert tokens == _reference_ids(tiny[0], MESSAGES)


def test_request_log_flags(engine, caplog):
    prompt = "The quick brown fox jumps over the lazy dog"

    def log_lines(**options) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="jaxpaged.server"):
            with serve(build_app(engine, "tiny", **options)) as base:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
                assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        return [r.getMessage() for r in caplog.records if r.name == "jaxpaged.server"]

    default = log_lines()
    assert len(default) == 1 and "prompt tokens" in default[0] and prompt not in default[0]
    assert log_lines(log_requests=False) == []
    assert log_lines(log_requests=False, log_prompts=True) == []
    excerpt = [line for line in log_lines(log_prompts=True, max_log_len=9) if ": prompt " in line]
    assert len(excerpt) == 1 and excerpt[0].endswith(": prompt 'The quick'")


def test_serve_command_wires_the_server_options(tiny, tmp_path, monkeypatch):
    """``jaxpaged serve`` builds the app, uvicorn's config and the draining server from the flags (uvicorn's
    config and the server faked)."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    key.write_text("k")
    cert.write_text("c")
    seen = {}

    class FakeServer:
        def __init__(self, config, engine, shutdown_timeout):
            seen.update(config, shutdown_timeout=shutdown_timeout)

        def run(self):
            pass

    monkeypatch.setattr(uvicorn, "Config", lambda app, **kwargs: dict(app=app, **kwargs))
    monkeypatch.setattr(server_app, "GracefulServer", FakeServer)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_ARGS.items()]
    try:
        assert (
            main(
                [
                    "serve",
                    str(tiny[0]),
                    "--served-model-name",
                    "x",
                    "y",
                    "--root-path",
                    "/llm",
                    "--ssl-keyfile",
                    str(key),
                    "--ssl-certfile",
                    str(cert),
                    "--no-precompile",
                    "--shutdown-timeout",
                    "7",
                    "--max-request-body-bytes",
                    "1MiB",
                    "--max-seqs-per-request",
                    "3",
                    *flags,
                ]
            )
            == 0
        )
    finally:
        gc.unfreeze()
    assert (seen["ssl_keyfile"], seen["ssl_certfile"], seen["root_path"]) == (str(key), str(cert), "/llm")
    assert seen["shutdown_timeout"] == 7.0
    app = seen["app"]
    assert [m.cls.__name__ for m in app.user_middleware] == [
        "CORSMiddleware",
        "RefuseWhileDraining",
        "BodySizeLimit",
    ]
    assert app.state.serving.limits == ServerLimits(2**20, 3, None)
    models = TestClient(app).get("/v1/models", headers={"Origin": "https://a.example"})
    assert [m["id"] for m in models.json()["data"]] == ["x", "y"]
    assert models.headers["access-control-allow-origin"] == "*"
