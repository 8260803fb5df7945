"""Seeded synthetic ShareGPT-like workloads: the same seed gives the same requests anywhere.

Prompt and output lengths are lognormal (means about 128 tokens, sigma 1.0 and 0.8), clipped
so prompt + output <= 512; prompts are random token ids and requests ignore EOS, so each one
produces exactly its output length. ``chat_prompts`` gives a real-text variant.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOTAL = 512


@dataclass(frozen=True)
class WorkloadRequest:
    prompt_token_ids: list[int]
    output_len: int


def _lognormal_lengths(rng: np.random.Generator, n: int, mean: float, sigma: float) -> np.ndarray:
    mu = np.log(mean) - sigma ** 2 / 2          # so that the distribution's mean is `mean`
    return np.maximum(1, np.round(rng.lognormal(mu, sigma, n))).astype(int)


def synthetic(n: int, seed: int = 0, vocab_size: int = 49152, prompt_mean: float = 128,
              output_mean: float = 128, max_total: int = MAX_TOTAL) -> list[WorkloadRequest]:
    rng = np.random.default_rng(seed)
    prompt_lens = np.minimum(_lognormal_lengths(rng, n, prompt_mean, 1.0), max_total - 1)
    output_lens = np.minimum(_lognormal_lengths(rng, n, output_mean, 0.8), max_total - prompt_lens)
    # Token ids avoid the first 32 ids, where tokenizers keep their special tokens.
    return [WorkloadRequest(rng.integers(32, vocab_size, p).tolist(), int(o))
            for p, o in zip(prompt_lens, output_lens)]


def model_flops(reqs: list[WorkloadRequest], cfg) -> int:
    """FLOPs (2 per multiply-add) that the model's own arithmetic takes on ``reqs``, for a decoder
    config (``models.decoder.DecoderConfig``): each request's prompt and every output but the last
    pass through all layers (the projections, and attention over the context so far), and each
    output is sampled from the LM head. Norms, activations, padding and recomputation are not
    counted: a floor that every exact implementation spends, whatever its batching."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    mlp = (3 if cfg.gated_mlp else 2) * h * cfg.intermediate_size
    per_token = 2 * cfg.num_layers * (h * (q + 2 * kv) + q * h + mlp)
    per_context = 4 * cfg.num_layers * q          # q.k and p.v for each key of a token's context
    total = 0
    for r in reqs:
        t = len(r.prompt_token_ids) + r.output_len - 1
        total += t * per_token + per_context * t * (t + 1) // 2 + r.output_len * 2 * cfg.embed_dim * cfg.vocab_size
    return total


TOPICS = ["the history of paper", "how bridges carry load", "why the sea is salty", "a recipe for bread",
          "the rules of chess", "how vaccines work", "the life of bees", "what a compiler does"]


def chat_prompts(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Real-text chat conversations for the text variant of the workload."""
    rng = np.random.default_rng(seed)
    return [[{"role": "user", "content": f"Explain {TOPICS[i]} in {int(w)} words."}]
            for i, w in zip(rng.integers(0, len(TOPICS), n), rng.integers(20, 200, n))]
