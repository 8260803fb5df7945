"""Seeded synthetic ShareGPT-like workloads: the same seed gives the same requests anywhere.

Prompt and output lengths are lognormal (means about 128 tokens, sigma 1.0 and 0.8), clipped
so prompt + output <= 512; prompts are random token ids and requests ignore EOS, so each one
produces exactly its output length. ``chat`` gives a real-text variant: the same lengths, prompts that
are chat conversations in plain English.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

MAX_TOTAL = 512


@dataclass(frozen=True)
class WorkloadRequest:
    prompt_token_ids: list[int]
    output_len: int
    messages: list[dict[str, str]] | None = None
    """The chat conversation whose templated tokens are ``prompt_token_ids`` (the real-text variant)."""


def _lognormal_lengths(rng: np.random.Generator, n: int, mean: float, sigma: float) -> np.ndarray:
    mu = np.log(mean) - sigma**2 / 2  # so that the distribution's mean is `mean`
    return np.maximum(1, np.round(rng.lognormal(mu, sigma, n))).astype(int)


def synthetic(
    n: int,
    seed: int = 0,
    vocab_size: int = 49152,
    prompt_mean: float = 128,
    output_mean: float = 128,
    max_total: int = MAX_TOTAL,
) -> list[WorkloadRequest]:
    rng = np.random.default_rng(seed)
    prompt_lens = np.minimum(_lognormal_lengths(rng, n, prompt_mean, 1.0), max_total - 1)
    output_lens = np.minimum(_lognormal_lengths(rng, n, output_mean, 0.8), max_total - prompt_lens)
    # Token ids avoid the first 32 ids, where tokenizers keep their special tokens.
    return [
        WorkloadRequest(rng.integers(32, vocab_size, p).tolist(), int(o))
        for p, o in zip(prompt_lens, output_lens)
    ]


def model_flops(reqs: list[WorkloadRequest], cfg) -> int:
    """FLOPs (2 per multiply-add) that the model's own arithmetic takes on ``reqs``, for a decoder
    config (``models.decoder.DecoderConfig``): each request's prompt and every output but the last
    pass through all layers (the projections, and attention over the context so far), and each
    output is sampled from the LM head. Norms, activations, padding and recomputation are not
    counted: a floor that every exact implementation spends, whatever its batching."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    mlp = (3 if cfg.gated_mlp else 2) * h * cfg.intermediate_size
    per_token = 2 * cfg.num_layers * (h * (q + 2 * kv) + q * h + mlp)
    per_context = 4 * cfg.num_layers * q  # q.k and p.v for each key of a token's context
    total = 0
    for r in reqs:
        t = len(r.prompt_token_ids) + r.output_len - 1
        total += (
            t * per_token + per_context * t * (t + 1) // 2 + r.output_len * 2 * cfg.embed_dim * cfg.vocab_size
        )
    return total


TOPICS = [
    "the history of paper",
    "how bridges carry load",
    "why the sea is salty",
    "a recipe for bread",
    "the rules of chess",
    "how vaccines work",
    "the life of bees",
    "what a compiler does",
]

NOTES = """\
The town kept its records in a long room above the market, where the light came in through tall windows
and the paper smelled of dust and rain. Every spring the clerks opened the oldest boxes to see what the
damp had done, and every spring they found that the ledgers written on rag paper had survived while the
cheaper pulp had browned and cracked at the edges. A bridge over the river had been rebuilt three times;
the first was timber and burned, the second was stone and stood until a flood undercut one pier, and the
third, an iron truss, still carries carts and bicycles across. Engineers who visit point out how the load
runs along the diagonal members into the abutments, and how the rivets were set hot so that they would
shrink and pull the plates together as they cooled. Below the bridge the water turns brackish twice a day,
because the tide pushes salt water up the estuary faster than the river can push it back, and the fishermen
know exactly which reach holds which fish at which hour. The baker on the corner starts at four: flour,
water, salt and a spoon of yesterday's dough, folded every half hour until it holds its shape, then left in
cloth-lined baskets while the oven heats. In the evenings the same room above the market fills with chess
players who argue about openings, about whether a knight on the rim is really dim, and about the endgame
where a single pawn decides everything. A retired nurse teaches a class there on how the body learns to
recognise an invader it has never met, using a chalk drawing of a lock and many keys. In summer the roof
hums with bees from the hives a beekeeper placed there years ago; they forage across the river, return
heavy with pollen, and dance on the comb to tell the others where the flowers are. The youngest clerk,
who writes small programs to index the ledgers, likes to say that a compiler is only a very patient
translator that reads the whole book before it writes a single word of the translation."""

_NOTE_WORDS = NOTES.split()


def _conversation(topic: str, start: int, num_words: int) -> list[dict[str, str]]:
    """A question on ``topic`` with ``num_words`` words of ``NOTES`` from word ``start`` on (cyclic) as context."""
    question = f"Explain {topic} in plain words."
    if not num_words:
        return [{"role": "user", "content": question}]
    notes = " ".join(_NOTE_WORDS[(start + j) % len(_NOTE_WORDS)] for j in range(num_words))
    return [{"role": "user", "content": f"{question} My notes so far: {notes}"}]


def chat(
    n: int,
    seed: int,
    chat_template: Callable[[list[dict[str, str]]], list[int]],
    prompt_mean: float = 128,
    output_mean: float = 128,
    max_total: int = MAX_TOTAL,
) -> list[WorkloadRequest]:
    """The real-text variant: ``synthetic``'s lengths for the same seed, with each prompt a chat
    conversation in plain English (a question on one of ``TOPICS``, with a window of ``NOTES`` as
    context) sized to the synthetic prompt's token count under ``chat_template`` (a tokenizer's
    ``apply_chat_template``; the template's own tokens set a floor: shorter targets get the bare
    question). Outputs keep the synthetic lengths (clipped so prompt + output <= ``max_total``) and
    ignore EOS, so every system does the same work on real text."""
    rng = np.random.default_rng(seed)
    out = []
    for r in synthetic(n, seed, prompt_mean=prompt_mean, output_mean=output_mean, max_total=max_total):
        topic, start = TOPICS[int(rng.integers(len(TOPICS)))], int(rng.integers(len(_NOTE_WORDS)))
        # The most words whose prompt fits the target (binary search), and that prompt's tokens.
        lo, hi, fits = 0, 4 * len(r.prompt_token_ids), None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            ids = chat_template(_conversation(topic, start, mid))
            if len(ids) <= len(r.prompt_token_ids):
                lo, fits = mid, ids
            else:
                hi = mid - 1
        messages = _conversation(topic, start, lo)
        ids = fits if lo else chat_template(messages)
        out.append(WorkloadRequest(ids, max(1, min(r.output_len, max_total - len(ids))), messages))
    return out


WORKLOADS = ("synthetic", "chat")


def requests(kind: str, n: int, seed: int, model: str, **lengths) -> list[WorkloadRequest]:
    """The ``synthetic`` workload (random token ids), or its ``chat`` variant in ``model``'s tokenizer
    and chat template; ``lengths``: ``synthetic``'s."""
    if kind == "synthetic":
        return synthetic(n, seed, **lengths)
    if kind != "chat":
        raise ValueError(f"unknown workload {kind!r}; choose one of {', '.join(WORKLOADS)}")
    from jaxpaged.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(model)
    return chat(n, seed, tokenizer.apply_chat_template, **lengths)
