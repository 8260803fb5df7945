"""Grammar backends for structured outputs: llguidance (jaxpaged's) against xgrammar (vLLM's default).

On one tokenizer (SmolLM2's by default), for a few JSON schemas: the backend's set-up for the
tokenizer (once per engine), a schema's compile time (median of ``--rounds``, no cache), its first
mask, and along a valid output (an instance of the schema, tokenized) the median time to fill one
row of the packed token bitmask and to accept a token. Each backend is timed where it imports:
xgrammar requires torch, which jaxpaged runs without, so time it from a throwaway virtual
environment with both installed and a tokenizer saved from jaxpaged:

    python -m benchmarks.grammar_backends --save-tokenizer /tmp/smollm2_tok
    python -m venv /tmp/xg && /tmp/xg/bin/pip install xgrammar llguidance transformers
    PYTHONPATH=. /tmp/xg/bin/python -m benchmarks.grammar_backends --tokenizer /tmp/smollm2_tok

When both run in one process, "same masks" counts the steps where their masks allow the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from benchmarks.common import UNDER_LOAD, print_table, write_json

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "status": {"enum": ["active", "inactive", "banned"]},
    },
    "required": ["name", "age", "address", "tags", "status"],
}
WIDE_TYPES = [
    {"type": "string"},
    {"type": "integer"},
    {"type": "number"},
    {"type": "boolean"},
    {"enum": ["red", "green", "blue"]},
    {"type": "array", "items": {"type": "integer"}},
]
WIDE_VALUES = ["text", 42, 3.25, True, "green", [1, 2, 3]]

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
        {"name": "Ada Lovelace", "age": 36},
    ),
    "nested": (
        PERSON,
        {
            "name": "Alan Turing",
            "age": 41,
            "address": {"street": "Hampton Road", "city": "Teddington", "zip": "12345"},
            "tags": ["logic", "computing"],
            "status": "inactive",
        },
    ),
    "wide": (
        {
            "type": "object",
            "properties": {f"field_{i}": WIDE_TYPES[i % 6] for i in range(24)},
            "required": [f"field_{i}" for i in range(24)],
        },
        {f"field_{i}": WIDE_VALUES[i % 6] for i in range(24)},
    ),
    "any_object": ({"type": "object"}, {"id": 7, "items": [{"name": "tea", "price": 2.5}], "paid": False}),
}
"""Name -> (schema, an instance of it): the instance, tokenized, is the output the masks are filled along."""


class Llguidance:
    name = "llguidance"

    def __init__(self, hf, vocab_size: int) -> None:
        import llguidance
        import llguidance.numpy

        self._ll, self._np = llguidance, llguidance.numpy
        backend = hf.backend_tokenizer
        backend.no_padding()
        backend.no_truncation()
        self.tokenizer = llguidance.LLTokenizer(
            backend.to_str(), n_vocab=vocab_size, eos_token=hf.eos_token_id
        )
        self.mask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: str):
        matcher = self._ll.LLMatcher(
            self.tokenizer, self._ll.LLMatcher.grammar_from_json_schema(schema), log_level=0
        )
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled):
        return compiled

    def fill(self, matcher) -> np.ndarray:
        self._np.fill_next_token_bitmask(matcher, self.mask, 0)
        return self.mask

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab_size: int) -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.mask = np.asarray(xgrammar.allocate_token_bitmask(1, vocab_size))

    def compile(self, schema: str):
        return self._compiler.compile_json_schema(schema, any_whitespace=True)

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, matcher) -> np.ndarray:
        matcher.fill_next_token_bitmask(self.mask, 0)
        return self.mask

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


def allowed(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The packed row's allowed tokens as bools."""
    return np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


def run(backend_cls, hf, vocab_size: int, rounds: int) -> tuple[dict, dict[str, list[np.ndarray]]]:
    """One backend's figures (set-up s; per schema compile ms, first mask ms, fill us, accept us,
    tokens) and its masks along each schema's output."""
    t0 = time.perf_counter()
    b = backend_cls(hf, vocab_size)
    figures = {"setup_s": time.perf_counter() - t0, "schemas": {}}
    masks = {}
    for name, (schema, instance) in SCHEMAS.items():
        text = json.dumps(schema)
        compile_s = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            compiled = b.compile(text)
            compile_s.append(time.perf_counter() - t0)
        tokens = hf.encode(json.dumps(instance), add_special_tokens=False) + [hf.eos_token_id]
        m = b.matcher(compiled)
        t0 = time.perf_counter()
        first = allowed(b.fill(m), vocab_size)
        first_s = time.perf_counter() - t0
        steps, fill_s, accept_s = [first], [], []
        if not b.accept(m, tokens[0]):
            raise RuntimeError(f"{b.name} refused token 0 of the {name} instance")
        for i, t in enumerate(tokens[1:], start=1):
            t0 = time.perf_counter()
            mask = b.fill(m)
            t1 = time.perf_counter()
            ok = b.accept(m, t)
            accept_s.append(time.perf_counter() - t1)
            fill_s.append(t1 - t0)
            steps.append(allowed(mask, vocab_size))
            if not ok:
                raise RuntimeError(f"{b.name} refused token {i} ({t}) of the {name} instance")
        masks[name] = steps
        figures["schemas"][name] = {
            "compile_ms": 1e3 * statistics.median(compile_s),
            "first_mask_ms": 1e3 * first_s,
            "fill_us": 1e6 * statistics.median(fill_s),
            "accept_us": 1e6 * statistics.median(accept_s),
            "tokens": len(tokens),
        }
    return figures, masks


def load_tokenizer(path: str | None):
    """A Hugging Face fast tokenizer: from ``path``, or SmolLM2's as jaxpaged loads it (from its GGUF)."""
    if path:
        import transformers

        return transformers.AutoTokenizer.from_pretrained(path)
    from jaxpaged.tokenizer import Tokenizer
    from jaxpaged.weights import DEFAULT_MODEL_ALIAS

    return Tokenizer.load(DEFAULT_MODEL_ALIAS).hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--tokenizer", help="a Hugging Face tokenizer directory (default: SmolLM2's, through jaxpaged)"
    )
    ap.add_argument(
        "--save-tokenizer", metavar="DIR", help="save the tokenizer to DIR (for another environment) and exit"
    )
    ap.add_argument("--rounds", type=int, default=5, help="compiles per schema (median)")
    args = ap.parse_args()
    hf = load_tokenizer(args.tokenizer)
    if args.save_tokenizer:
        hf.save_pretrained(args.save_tokenizer)
        print(f"saved the tokenizer to {args.save_tokenizer}")
        return
    vocab_size = len(hf)
    results, masks = {}, {}
    for cls in (Llguidance, Xgrammar):
        try:
            results[cls.name], masks[cls.name] = run(cls, hf, vocab_size, args.rounds)
        except ImportError as e:
            print(f"{cls.name}: not importable here ({e})")
    print(f"vocabulary {vocab_size}; {UNDER_LOAD}")
    rows = []
    for backend, r in results.items():
        for name, f in r["schemas"].items():
            same = ""
            if len(masks) == 2:
                a, b = masks.values()
                same = f"{sum(np.array_equal(x, y) for x, y in zip(a[name], b[name]))}/{len(a[name])}"
            rows.append(
                [
                    backend,
                    name,
                    f["compile_ms"],
                    f["first_mask_ms"],
                    f["fill_us"],
                    f["accept_us"],
                    f["tokens"],
                    same,
                ]
            )
    print_table(
        ["backend", "schema", "compile ms", "1st mask ms", "fill us", "accept us", "tokens", "same masks"],
        rows,
        [11, 11, 11, 12, 10, 10, 7, 11],
    )
    for backend, r in results.items():
        print(f"{backend}: tokenizer set-up {r['setup_s']:.2f} s")
    write_json("grammar_backends", {"vocab_size": vocab_size, "backends": results})


if __name__ == "__main__":
    main()
