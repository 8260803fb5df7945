"""On-device sampling of one token per row, with per-row parameters and no Python loop.

Randomness comes from each request's seed folded with the position of the token being
sampled, so a seeded request draws the same tokens whatever batch or step it lands in.
Sampling uses one uniform number per row and the inverse CDF, not a vocabulary-sized
noise draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass
class SamplingTensors:
    """Per-row sampling inputs (padding rows: temperature 0)."""

    temperature: jax.Array   # [R] f32; 0 = greedy
    top_k: jax.Array         # [R] int32; 0 = off
    top_p: jax.Array         # [R] f32; 1 = off
    seed_lo: jax.Array       # [R] uint32
    seed_hi: jax.Array       # [R] uint32
    position: jax.Array      # [R] int32: sequence index of the token being sampled


def _row_uniform(seed_lo: jax.Array, seed_hi: jax.Array, position: jax.Array) -> jax.Array:
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed_lo), seed_hi), position)
    return jax.random.uniform(key, (), jnp.float32)


def _apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask logits outside each row's top-k and nucleus (top-p); one sort of the batch."""
    V = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    ranks = jnp.arange(V)[None, :]
    sorted_logits = jnp.where(ranks < k[:, None], sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep = cum_before < top_p[:, None]          # always keeps the top token
    n_keep = jnp.sum(keep, axis=-1)
    pth = jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth, pth)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample(logits: jax.Array, st: SamplingTensors, *, all_greedy: bool, use_top_k_top_p: bool
           ) -> tuple[jax.Array, jax.Array]:
    """Returns ``(token_ids[R] int32, logprobs[R] f32)``; logprobs are of the raw model distribution."""
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if all_greedy:
        tokens = greedy
    else:
        t = jnp.where(st.temperature > 0, st.temperature, 1.0)
        scaled = logits / t[:, None]
        if use_top_k_top_p:
            scaled = _apply_top_k_top_p(scaled, st.top_k, st.top_p)
        probs = jax.nn.softmax(scaled, axis=-1)
        cdf = jnp.cumsum(probs, axis=-1)
        u = jax.vmap(_row_uniform)(st.seed_lo, st.seed_hi, st.position) * cdf[:, -1]
        drawn = jnp.minimum(jnp.sum(cdf <= u[:, None], axis=-1), logits.shape[-1] - 1)
        # Never pick a masked (zero-probability) token through rounding at the CDF's tail.
        drawn = jnp.where(probs[jnp.arange(logits.shape[0]), drawn] > 0, drawn,
                          jnp.argmax(scaled, axis=-1)).astype(jnp.int32)
        tokens = jnp.where(st.temperature > 0, drawn, greedy)
    chosen = jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen
