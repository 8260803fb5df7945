"""The scripts in examples/ run as their docstrings say and print what transformers computes."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from tiny_models import hf_greedy

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_async_streams_interleaves_two_greedy_streams(tiny):
    """Two streams of one ``AsyncLLMEngine`` in a plain asyncio program: each stream's deltas add up to its
    final text, which is transformers' greedy continuation. (How their lines interleave depends on timing: a
    reader that falls behind gets its deltas merged, so the test does not ask for it.)"""
    max_tokens = 8
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "async_streams.py"),
            "--model",
            str(tiny[0]),
            "--max-tokens",
            str(max_tokens),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    deltas = [re.fullmatch(r"\[(stream-[ab])\] (.*)", line) for line in lines]
    deltas = [(m[1], ast.literal_eval(m[2])) for m in deltas if m]
    finals = {
        m[1]: (ast.literal_eval(m[2]), ast.literal_eval(m[3]))
        for m in (re.fullmatch(r"=== (stream-[ab]): (.*) -> (.*)", line) for line in lines)
        if m
    }
    assert set(finals) == {"stream-a", "stream-b"}
    tokenizer = AutoTokenizer.from_pretrained(tiny[0])
    for rid, (prompt, text) in finals.items():
        assert "".join(d for r, d in deltas if r == rid) == text
        tokens = hf_greedy(tiny[1], tokenizer.encode(prompt), max_tokens)[0]
        if tokenizer.eos_token_id in tokens:
            tokens = tokens[: tokens.index(tokenizer.eos_token_id)]
        assert text == tokenizer.decode(tokens, skip_special_tokens=True), rid
