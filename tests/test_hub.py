"""Models and tokenizers from the Hugging Face Hub (as vLLM loads them), and the generation config's defaults.

No network: a Hub cache in huggingface_hub's layout is built from tiny random Llamas, and the Hub is
offline (``HF_HUB_OFFLINE``: set in a subprocess's environment, or its constant patched in-process,
since huggingface_hub reads the variable at import).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

import huggingface_hub
import httpx
import pytest
import transformers

from jaxpaged import LLM, EngineArgs, SamplingParams
from jaxpaged.async_engine import AsyncLLMEngine
from jaxpaged.generation_config import load_generation_defaults
from jaxpaged.server import build_app
from jaxpaged.tokenizer import Tokenizer
from jaxpaged.weights import resolve_model_path
from test_server import serve
from tiny_models import hf_greedy, save_tiny_llama

REPO = "org/tiny"
MAIN, V2 = "a" * 40, "b" * 40
"""The commits of the repo's two snapshots: ``main`` and the tag ``v2`` (other weights)."""
# The engine shape of tests/test_server.py, so that the compiled step programs are reused.
ENGINE_ARGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=129)
PROMPT = "The quick brown fox"
N = 12
DEFAULTS = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "max_new_tokens": 40,
}


def add_snapshot(
    cache: pathlib.Path, commit: str, ref: str, model_dir: pathlib.Path, generation_config: dict
) -> None:
    """``model_dir``'s files as the snapshot ``commit`` of REPO, named by ``ref`` (plain files, not links
    to blobs: huggingface_hub accepts them offline), with ``generation_config``."""
    repo = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (snapshot / "generation_config.json").write_text(json.dumps(generation_config))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)


def first_extra_eos(tokens: list[int], eos: int) -> int:
    """A token of the greedy output, past its first two, that ends it early when it is an EOS id."""
    return next(t for i, t in enumerate(tokens) if i >= 2 and t != eos and t not in tokens[:i])


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_tokenizer_dir):
    """``(cache, {commit: (HF model, prompt ids, greedy tokens)}, extra EOS id of main)``."""
    cache, models, dirs = tmp_path_factory.mktemp("hub-cache").resolve(), {}, {}
    for commit, seed in ((MAIN, 0), (V2, 1)):
        dirs[commit] = tmp_path_factory.mktemp("hub-model")
        model = save_tiny_llama(dirs[commit], tiny_tokenizer_dir, seed=seed)
        ids = transformers.AutoTokenizer.from_pretrained(dirs[commit]).encode(PROMPT)
        models[commit] = model, ids, hf_greedy(model, ids, N)[0]
    eos = first_extra_eos(models[MAIN][2], eos=2)
    add_snapshot(cache, MAIN, "main", dirs[MAIN], {**DEFAULTS, "eos_token_id": [2, eos]})
    add_snapshot(cache, V2, "v2", dirs[V2], {"temperature": 0.3, "eos_token_id": 2})
    return cache, models, eos


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def hub_llm(hub):
    with pytest.MonkeyPatch.context() as m:
        m.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        return LLM(REPO, download_dir=str(hub[0]), **ENGINE_ARGS)


def test_hub_model_greedy_matches_transformers(hub, hub_llm):
    _, models, _ = hub
    _, ids, expected = models[MAIN]
    out = hub_llm.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True), use_tqdm=False
    )
    assert out[0].prompt_token_ids == ids
    assert out[0].outputs[0].token_ids == expected


def test_generation_config_sets_the_defaults(hub_llm):
    sp = hub_llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty, sp.max_tokens) == (
        0.7,
        0.9,
        20,
        0.05,
        1.1,
        40,
    )
    assert hub_llm.engine.generation_defaults.sampling == {
        **{k: v for k, v in DEFAULTS.items() if k != "max_new_tokens"},
        "max_tokens": 40,
    }


def test_generation_config_eos_stops_generation(hub, hub_llm):
    """An id of the generation config's eos_token_id (not the tokenizer's EOS) ends the output there, as a
    stop token id does in vLLM; ignore_eos keeps going (the test above)."""
    _, models, eos = hub
    expected = models[MAIN][2]
    expected = expected[: expected.index(eos) + 1]
    assert len(expected) < N
    c = hub_llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=N), use_tqdm=False)[0].outputs[0]
    assert c.token_ids == expected
    assert (c.finish_reason, c.stop_reason) == ("stop", eos)


def test_revision_picks_its_snapshot_and_vllm_ignores_its_defaults(hub):
    cache, models, _ = hub
    llm = LLM(REPO, revision="v2", download_dir=str(cache), generation_config="vllm", **ENGINE_ARGS)
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == models[V2][2] != models[MAIN][2]
    assert llm.get_default_sampling_params() == SamplingParams()
    assert (
        resolve_model_path(REPO, revision=V2, download_dir=str(cache))
        == cache / f"models--org--tiny/snapshots/{V2}"
    )


def test_tokenizer_from_the_hub(hub):
    cache = hub[0]
    tok = Tokenizer.load(REPO, revision="v2", download_dir=str(cache))
    assert pathlib.Path(tok.hf.name_or_path) == cache / f"models--org--tiny/snapshots/{V2}"
    assert tok.encode(PROMPT) == hub[1][V2][1]


@pytest.mark.parametrize("revision", [None, "no-such-branch"])
def test_missing_repo_or_revision_names_what_was_tried(hub, revision):
    cache = str(hub[0])
    repo = "org/absent" if revision is None else REPO
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path(repo, revision=revision, download_dir=cache)
    msg = str(e.value)
    assert (
        repr(repo) in msg and repr(revision or "main") in msg and cache in msg and "HF_HUB_OFFLINE=1" in msg
    )
    assert str(pathlib.Path(repo).absolute()) in msg
    with pytest.raises(FileNotFoundError, match="tokenizer 'org/absent'"):
        Tokenizer.load("org/absent", download_dir=cache)


def test_missing_local_path_is_not_looked_up(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a Hugging Face model directory"):
        resolve_model_path(str(tmp_path / "absent"))


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
def test_hub_environment_is_honoured(hub, tmp_path, variable):
    """huggingface_hub's own environment picks the cache and offline mode (read at its import: a subprocess)."""
    cache = hub[0]
    if variable == "HF_HOME":  # the Hub cache is $HF_HOME/hub
        (tmp_path / "hub").symlink_to(cache)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update({variable: str(cache if variable == "HF_HUB_CACHE" else tmp_path), "HF_HUB_OFFLINE": "1"})
    code = (
        "from jaxpaged.weights import resolve_model_path; from jaxpaged.tokenizer import Tokenizer; "
        f"print(resolve_model_path({REPO!r})); print(Tokenizer.load({REPO!r}).hf.name_or_path)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(cache / f"models--org--tiny/snapshots/{MAIN}")] * 2


def test_generation_config_modes(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"top_k": 0, "temperature": 0.5, "eos_token_id": 7})
    )
    with caplog.at_level(logging.INFO, logger="jaxpaged.generation_config"):
        assert load_generation_defaults(tmp_path, "auto").sampling == {"top_k": -1, "temperature": 0.5}
    assert "default sampling parameters from" in caplog.text and "'temperature': 0.5" in caplog.text
    vllm = load_generation_defaults(tmp_path, "vllm")
    assert (vllm.sampling, vllm.eos_token_ids) == ({}, (7,))
    assert load_generation_defaults(tmp_path / "model.gguf", str(tmp_path)).eos_token_ids == (7,)
    assert load_generation_defaults(tmp_path / "model.gguf", "auto").eos_token_ids == ()
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ValueError, match="generation_config.json: top_p must be in"):
        load_generation_defaults(tmp_path, "auto")
    with pytest.raises(ValueError, match="generation_config must be one of"):
        EngineArgs(generation_config=str(tmp_path / "absent")).create_engine_config()


def test_tokenizer_revision_defaults_to_the_models():
    def source(**kw):
        model = EngineArgs(model=REPO, **kw).create_engine_config().model
        return model.tokenizer_source, model.tokenizer_revision

    assert source(revision="v2") == (None, "v2")  # the model's own snapshot
    assert source(tokenizer_revision="v2") == (REPO, "v2")
    assert source(tokenizer="org/tok") == ("org/tok", None)


def test_server_request_takes_the_models_defaults_for_what_it_leaves_out(hub_llm, monkeypatch):
    """Fields the client does not send (or sends as null) take the generation config's values; max_new_tokens
    also caps max_tokens (vLLM's rule)."""
    seen = []
    make_request = hub_llm.engine.make_request

    def recording(request_id, prompt, sp=None, *args):
        seen.append(sp)
        return make_request(request_id, prompt, sp, *args)

    monkeypatch.setattr(hub_llm.engine, "make_request", recording)
    engine = AsyncLLMEngine(hub_llm.engine)
    try:
        with serve(build_app(engine, "tiny")) as url, httpx.Client(base_url=url, timeout=60) as http:
            for body in (
                {"prompt": PROMPT},
                {"prompt": PROMPT, "temperature": 0.0, "top_k": None, "max_tokens": 50},
                {"prompt": PROMPT, "max_tokens": 3, "top_p": 0.5},
            ):
                assert http.post("/v1/completions", json=body).status_code == 200
            chat = {"messages": [{"role": "user", "content": "hi"}]}
            assert http.post("/v1/chat/completions", json=chat).status_code == 200
    finally:
        engine.shutdown()
    got = [
        (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty, sp.max_tokens) for sp in seen
    ]
    assert got == [
        (0.7, 0.9, 20, 0.05, 1.1, 16),
        (0.0, 0.9, 20, 0.05, 1.1, 40),
        (0.7, 0.5, 20, 0.05, 1.1, 3),
        (0.7, 0.9, 20, 0.05, 1.1, 40),
    ]
