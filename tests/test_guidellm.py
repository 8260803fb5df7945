"""guidellm against ``jaxpaged serve`` (issue 54): a few seconds of its benchmark on SmolLM2 (synthetic
prompts of 32 tokens, 16 output tokens, 4 concurrent streams to ``/v1/chat/completions``, guidellm's
default), offline with a local tokenizer; its own report must count every request successful, with the
token counts it asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxpaged.config import DEFAULT_MODEL
from test_lm_eval import OFFLINE, SERVED, jaxpaged_serve

pytestmark = pytest.mark.slow

PROMPT_TOKENS, OUTPUT_TOKENS, REQUESTS, STREAMS = 32, 16, 12, 4


def test_guidellm_benchmark_every_request_succeeds(smollm2_tokenizer, tmp_path):
    tokenizer_dir, report = tmp_path / "tokenizer", tmp_path / "benchmarks.json"
    smollm2_tokenizer.hf.save_pretrained(tokenizer_dir)  # guidellm sizes its synthetic prompts with it
    with jaxpaged_serve(
        tmp_path / "server.log",
        DEFAULT_MODEL,
        "--served-model-name",
        SERVED,
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
    ) as url:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "guidellm",
                "run",
                "--backend",
                f"kind=openai_http,target={url},model={SERVED}",
                "--tokenizer",
                f"kind=huggingface_auto,model={tokenizer_dir}",
                "--data",
                f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
                "--profile",
                f"kind=concurrent,streams={STREAMS}",
                "--constraint",
                f"kind=max_requests,count={REQUESTS}",
                "--output",
                f"kind=json,path={report}",
                "--disable-console-interactive",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **OFFLINE},
        )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    print(proc.stdout[proc.stdout.find("Request Latency Statistics") :])
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    assert benchmark["metrics"]["request_totals"] == {
        "successful": REQUESTS,
        "errored": 0,
        "incomplete": 0,
        "total": REQUESTS,
    }
    # guidellm reports the server's usage: every request generated what it asked for (guidellm sends
    # ignore_eos), and its prompt is the chat template around the text guidellm sent.
    for request in benchmark["requests"]["successful"]:
        (message,) = json.loads(request["request_args"])["body"]["messages"]
        (part,) = message["content"]
        assert len(smollm2_tokenizer.encode(part["text"], add_special_tokens=False)) == PROMPT_TOKENS
        assert request["input_metrics"]["text_tokens"] == len(
            smollm2_tokenizer.apply_chat_template([{"role": "user", "content": part["text"]}])
        )
        assert request["output_metrics"]["text_tokens"] == OUTPUT_TOKENS
