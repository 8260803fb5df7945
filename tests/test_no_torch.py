"""The run-time path needs no torch (a test-only dependency): in a process where ``import torch``
fails, the default model's tokenizer and engine load, generate, and the server app answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import transformers

from tiny_models import hf_greedy

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 6

# Runs in a fresh interpreter. ``sys.modules["torch"] = None`` is what a missing package looks like to
# ``import torch`` (ImportError) and to ``importlib.util.find_spec`` (None), set before anything else.
CHILD = r"""
import json, sys
sys.modules["torch"] = None

from fastapi.testclient import TestClient

from jaxpaged import LLM, SamplingParams
from jaxpaged.async_engine import AsyncLLMEngine
from jaxpaged.server import build_app

messages, max_tokens = json.loads(sys.argv[1]), int(sys.argv[2])
llm = LLM("smollm2-135m-instruct", kv_cache_memory=64 << 20, precompile=False, max_num_seqs=2)
prompt = llm.get_tokenizer().apply_chat_template(messages)
params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
(out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
engine = AsyncLLMEngine(llm.engine)
try:
    with TestClient(build_app(engine, "smollm2")) as client:
        reply = client.post("/v1/chat/completions", json={
            "model": "smollm2", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0})
        reply.raise_for_status()
finally:
    engine.shutdown()
torch_modules = sorted(m for m, v in sys.modules.items() if m.split(".")[0] == "torch" and v is not None)
print(json.dumps({"prompt": prompt, "tokens": out.outputs[0].token_ids, "text": out.outputs[0].text,
                  "served": reply.json()["choices"][0]["message"]["content"], "torch_modules": torch_modules}))
"""


@pytest.fixture(scope="module")
def without_torch() -> dict:
    """What the child process reports (its last stdout line)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(MESSAGES), str(MAX_TOKENS)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "stderr": proc.stderr}


def test_generates_without_torch_as_transformers_does(without_torch, smollm2_gguf, hf_smollm2_model):
    """The prompt's ids are transformers' (its GGUF tokenizer and chat template), the greedy tokens
    are transformers' model's on that file, and the server app serves the same text."""
    reference = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    prompt = list(
        reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    assert without_torch["prompt"] == prompt
    tokens, _, margins = hf_greedy(hf_smollm2_model, prompt, MAX_TOKENS)
    assert without_torch["tokens"] == tokens, f"HF top1-top2 margins {margins}"
    assert without_torch["text"] == reference.decode(tokens, skip_special_tokens=True)
    assert without_torch["served"] == without_torch["text"]
    assert without_torch["torch_modules"] == []
    # transformers' warning that torch is missing (its models are not used here) is not shown to users.
    assert "PyTorch was not found" not in without_torch["stderr"]
