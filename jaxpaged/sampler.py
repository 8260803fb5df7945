"""On-device sampling of one token per row, with per-row parameters and no Python loop.

The pipeline follows vLLM: raw logprobs are taken first; then the grammar bitmask of
constrained rows (structured outputs: disallowed tokens to -inf), ``logit_bias`` and the
``min_tokens`` mask (one sparse scatter), the repetition / frequency / presence penalties
(token counts scattered on device from a compact list of (row, token) pairs), greedy
argmax; for sampled rows temperature, ``min_p``, ``top_k`` and ``top_p``, and a draw.

Costs on CPU shape the choices: a full sort of a [256, 49152] batch takes seconds and a
full-vocabulary cumsum a quarter of a second here, so neither is used. ``top_k``/``top_p``
thresholds come from the row's ``CANDIDATES`` largest logits, which settle most rows
exactly; rows they do not settle (``top_k`` above ``CANDIDATES``, or a nucleus wider than
that) get the exact threshold by bisection over the float bit patterns, run only when some
row needs it. Filters are per-row thresholds on the scaled logits rather than masked copies
of the batch. The draw is an inverse CDF over two levels (block sums, then one block), one
uniform number per row; argmax also goes through block maxima.

Randomness comes from each request's seed folded with the position of the token being
sampled, and every operation is row-wise, so a seeded request draws the same tokens
whatever batch or step it lands in. Static ``SamplerFlags`` switch whole stages on or off
for the batch, which bounds the number of compiled variants; the sampler is its own jitted
program, so a new combination of flags never recompiles the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.math_utils import cdiv

CANDIDATES = 64
"""Largest logits per row examined for top-k/top-p before falling back to bisection."""
DRAW_BLOCK = 256
"""Vocabulary block of the two-level inverse CDF and argmax (smaller if it does not divide V)."""
_ROW_CHUNK = 8
"""Rows bisected together: a chunk of rows stays in cache across the 32 passes."""


@dataclass(frozen=True)
class SamplerFlags:
    """Which stages the batch needs; static, so each combination is one compiled program."""

    all_greedy: bool = True
    penalties: bool = False
    bias: bool = False
    top_k_top_p: bool = False
    chosen_logprobs: bool = False
    """Some row wants its sampled token's logprob (a full-vocabulary logsumexp per row)."""
    num_logprobs: int = -1
    """-1: no row wants top logprobs; else how many to compute per row (implies ``chosen_logprobs``)."""
    bitmask: bool = False
    """Some row is constrained by a grammar: ``SamplingTensors.allowed`` masks the logits first."""


@jax.tree_util.register_dataclass
@dataclass
class SamplingTensors:
    """Per-row sampling inputs (padding rows: temperature 0, no penalties) and compact lists.

    Penalty and bias lists are flat and hold each (row, token) at most once; they are padded
    with row index ``R`` (out of range: dropped). A penalty pair is a token seen in the row's
    prompt (when it has a repetition penalty) or output, with its count in the output.
    """

    temperature: jax.Array  # [R] f32; 0 = greedy
    top_k: jax.Array  # [R] int32; 0 = off
    top_p: jax.Array  # [R] f32; 1 = off
    min_p: jax.Array  # [R] f32; 0 = off
    presence_penalty: jax.Array  # [R] f32
    frequency_penalty: jax.Array  # [R] f32
    repetition_penalty: jax.Array  # [R] f32
    seed_lo: jax.Array  # [R] uint32
    seed_hi: jax.Array  # [R] uint32
    position: jax.Array  # [R] int32: sequence index of the token being sampled
    penalty_rows: jax.Array  # [Np] int32
    penalty_tokens: jax.Array  # [Np] int32
    penalty_counts: jax.Array  # [Np] f32: occurrences in the output
    bias_rows: jax.Array  # [Nb] int32
    bias_tokens: jax.Array  # [Nb] int32
    bias_values: jax.Array  # [Nb] f32 (-inf masks a token)
    allowed: jax.Array = field(default_factory=lambda: np.zeros((0, 0), np.int32))
    """[R, ceil(V / 32)] int32 with ``SamplerFlags.bitmask``: bit ``t % 32`` of word ``t // 32`` set where
    token ``t`` is allowed (all set on unconstrained rows; none past V), llguidance's packed layout; else [0, 0]."""


@jax.tree_util.register_dataclass
@dataclass
class SamplerOutput:
    """Sampled tokens with their raw logprobs; with ``num_logprobs`` = N >= 0, ranks and top N."""

    tokens: jax.Array  # [R] int32
    logprobs: jax.Array  # [R] f32: log_softmax(raw logits)[token], or [0] when no row wants them
    ranks: jax.Array  # [R] int32 (1 = most likely), or [0] without logprobs
    top_ids: jax.Array  # [R, N] int32
    top_logprobs: jax.Array  # [R, N] f32


def _mix32(h: jax.Array) -> jax.Array:
    """A 32-bit integer finalizer (xorshift-multiply rounds) with full avalanche."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x7FEB352D)
    h = (h ^ (h >> 15)) * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def _row_uniform(seed_lo: jax.Array, seed_hi: jax.Array, position: jax.Array) -> jax.Array:
    """Uniform in [0, 1) from (seed, position) alone: a counter-based hash, so a row's draw depends
    on nothing else in the batch. (Threefry via ``jax.random`` added a second of compile time to
    every sampler program on CPU.)"""
    h = _mix32(position.astype(jnp.uint32) + jnp.uint32(0x9E3779B9))
    h = _mix32(h ^ seed_hi)
    h = _mix32(_mix32(h ^ seed_lo) + jnp.uint32(0x632BE5AB))
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def _prefix_sums(w: jax.Array) -> jax.Array:
    """Inclusive prefix sums along the last (short) axis, as a product with a triangular matrix:
    far cheaper to compile than ``jnp.cumsum`` on CPU. Not guaranteed monotone to the last ulp,
    so callers never rely on that."""
    n = w.shape[-1]
    return jnp.dot(w, jnp.triu(jnp.ones((n, n), w.dtype)), precision=jax.lax.Precision.HIGHEST)


def _first_true(mask: jax.Array, otherwise: jax.Array) -> jax.Array:
    """Index of the first True per row, or ``otherwise`` where there is none."""
    return jnp.where(mask.any(-1), jnp.argmax(mask, -1), otherwise)


def _last_true(mask: jax.Array) -> jax.Array:
    return mask.shape[-1] - 1 - jnp.argmax(mask[:, ::-1], -1)


def _float_key(x: jax.Array) -> jax.Array:
    """int32 keys ordered like the float32 values (for bisection over exact float thresholds)."""
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(b < 0, b ^ jnp.int32(0x7FFFFFFF), b)


def _key_float(k: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(jnp.where(k < 0, k ^ jnp.int32(0x7FFFFFFF), k), jnp.float32)


def _midpoint(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """floor((lo + hi) / 2) without int32 overflow."""
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1)


def _on_rows(fn, need: jax.Array, fast: jax.Array, *row_args: jax.Array) -> jax.Array:
    """``fast`` with its rows where ``need`` holds replaced by ``fn(*row_args)`` on those rows.

    The needed rows are gathered ``_ROW_CHUNK`` at a time in a device loop that runs once per
    chunk of them (zero times when none needs it): the cost follows the number of such rows,
    and each chunk stays in cache across the bisection's passes.
    """
    R = need.shape[0]
    C = min(_ROW_CHUNK, R)
    idx = jnp.nonzero(need, size=cdiv(R, C) * C, fill_value=R)[0]  # needed rows first, then R (none)

    def chunk(g: jax.Array, out: jax.Array) -> jax.Array:
        sel = jax.lax.dynamic_slice(idx, (g * C,), (C,))
        take = jnp.minimum(sel, R - 1)
        return out.at[sel].set(fn(*(a[take] for a in row_args)), mode="drop")

    return jax.lax.fori_loop(0, (jnp.sum(need) + C - 1) // C, chunk, fast)


def _bisect_top_k(xs: jax.Array, k: jax.Array) -> jax.Array:
    """Exact k-th largest value per row: the largest v with #{xs >= v} >= k (ties all kept)."""
    keys = _float_key(xs)
    lo, hi = keys.min(-1), keys.max(-1) + 1  # #{>= lo} = V >= k; #{>= hi} = 0 < k

    def body(_, c):
        lo, hi = c
        mid = _midpoint(lo, hi)
        ok = jnp.sum(keys >= mid[:, None], -1) >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return _key_float(lo)


def _bisect_top_p(xs: jax.Array, w: jax.Array, target: jax.Array) -> jax.Array:
    """Exact nucleus threshold per row: the smallest v whose mass strictly above is < target.

    ``w`` holds the kept tokens' weights (0 elsewhere), ``target`` is top_p times their sum.
    """
    keys = _float_key(jnp.where(w > 0, xs, -jnp.inf))
    lo, hi = keys.min(-1) - 1, keys.max(-1)  # mass above lo = all >= target; above hi = 0

    def body(_, c):
        lo, hi = c
        mid = _midpoint(lo, hi)
        ok = jnp.sum(jnp.where(keys > mid[:, None], w, 0.0), -1) < target
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    _, hi = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return _key_float(hi)


def _kept_weights(x: jax.Array, t: jax.Array, m: jax.Array, tau: jax.Array) -> jax.Array:
    """Unnormalized probabilities ``exp(x/t - m)`` of the tokens with ``x/t >= tau``, 0 elsewhere."""
    xs = x / t[:, None]
    return jnp.where(xs >= tau[:, None], jnp.exp(xs - m[:, None]), 0.0)


def _top_k_top_p(
    x: jax.Array, t: jax.Array, m: jax.Array, floor: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``(tau, block_sums)``: the smallest kept scaled logit per row after top-k, then top-p on the
    renormalized rest, and the kept weights summed per vocabulary block (for the draw).

    ``x / t`` are the temperature-scaled logits, ``m`` their row max, ``floor`` the min-p threshold.
    Top-k and min-p keep upper sets of the same row, so their intersection is the larger threshold.
    One full pass sums the weights kept by top-k and min-p per block: their total normalizes top-p,
    and they are the draw's block sums for rows top-p leaves whole. Rows whose nucleus lies within
    the candidates get their block sums from the candidates; only the others take a second pass.
    """
    R, V = x.shape
    K = min(CANDIDATES, V)
    rows = jnp.arange(R)
    neg_inf = jnp.float32(-jnp.inf)
    cand, cand_ids = jax.lax.top_k(x, K)  # descending (t > 0 keeps the order)
    cand = cand / t[:, None]

    tau_k = jnp.where(top_k > 0, cand[rows, jnp.clip(top_k - 1, 0, K - 1)], neg_inf)
    tau_k = _on_rows(lambda x, t, k: _bisect_top_k(x / t[:, None], k), top_k > K, tau_k, x, t, top_k)
    t1 = jnp.maximum(floor, tau_k)
    sums1 = _block_sums(x, t, m, t1)

    target = top_p * sums1.sum(-1)
    cw = jnp.where(cand >= t1[:, None], jnp.exp(cand - m[:, None]), 0.0)
    reached = _prefix_sums(cw) >= target[:, None]  # the nucleus ends at the first True
    use_p = top_p < 1.0
    tau_p = jnp.where(use_p, cand[rows, jnp.argmax(reached, -1)], neg_inf)
    tau_p = _on_rows(
        lambda x, t, m, t1, target: _bisect_top_p(x / t[:, None], _kept_weights(x, t, m, t1), target),
        use_p & ~reached[:, -1],
        tau_p,
        x,
        t,
        m,
        t1,
        target,
    )
    tau = jnp.maximum(t1, tau_p)

    narrowed = tau > t1
    in_cands = cand.min(-1) < tau  # every kept token is a candidate
    from_cands = (
        jnp.zeros_like(sums1)
        .at[rows[:, None], cand_ids // _block_len(V)]
        .add(jnp.where(cand >= tau[:, None], jnp.exp(cand - m[:, None]), 0.0))
    )
    sums = jnp.where((narrowed & in_cands)[:, None], from_cands, sums1)
    sums = _on_rows(_block_sums, narrowed & ~in_cands, sums, x, t, m, tau)
    return tau, sums


def _block_len(V: int) -> int:
    return next((b for b in (256, 128, 64) if V % b == 0), min(DRAW_BLOCK, V))


def _blocks(x: jax.Array, fill: float) -> jax.Array:
    """``x[R, V]`` as ``[R, B, L]`` vocabulary blocks (padded with ``fill`` only if no block size divides V).

    XLA on CPU reduces a short minor axis much faster than it runs an argmax or a
    select-heavy reduction over the whole row.
    """
    R, V = x.shape
    L = _block_len(V)
    B = cdiv(V, L)
    if B * L != V:
        x = jnp.pad(x, ((0, 0), (0, B * L - V)), constant_values=fill)
    return x.reshape(R, B, L)


def argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, -1)`` (first maximum) through block maxima: a fraction of its cost on CPU. The
    tokens ``sample`` draws with ``SamplerFlags()`` (greedy, nothing else)."""
    blocks = _blocks(x, -jnp.inf)
    L = blocks.shape[2]
    b = jnp.argmax(blocks.max(-1), -1)
    inner = jnp.take_along_axis(blocks, b[:, None, None], 1)[:, 0]
    return (b * L + jnp.argmax(inner, -1)).astype(jnp.int32)


def _block_sums(x: jax.Array, t: jax.Array, m: jax.Array, tau: jax.Array) -> jax.Array:
    """``[R, B]``: per vocabulary block, the summed ``exp(x/t - m)`` of tokens with ``x/t >= tau``."""
    blocks = _blocks(x / t[:, None], -jnp.inf)
    return jnp.where(blocks >= tau[:, None, None], jnp.exp(blocks - m[:, None, None]), 0.0).sum(-1)


def _inverse_cdf(
    x: jax.Array, t: jax.Array, m: jax.Array, tau: jax.Array, sums: jax.Array, u: jax.Array
) -> jax.Array:
    """Index drawn with probability proportional to ``exp(x/t - m)`` over ``x/t >= tau``, for ``u`` in
    [0, 1), given the kept weights' ``_block_sums``.

    Two levels: prefix sums of the block sums pick a block, prefix sums inside it pick the token;
    only blocks and tokens of non-zero weight can be picked, whatever the rounding.
    """
    blocks = _blocks(x / t[:, None], -jnp.inf)
    L = blocks.shape[2]
    csum = _prefix_sums(sums)
    target = u * csum[:, -1]
    nonzero = sums > 0
    b = _first_true((csum > target[:, None]) & nonzero, _last_true(nonzero))
    base = jnp.where(b > 0, jnp.take_along_axis(csum, jnp.maximum(b - 1, 0)[:, None], -1)[:, 0], 0.0)
    inner = jnp.take_along_axis(blocks, b[:, None, None], 1)[:, 0]  # [R, L]
    inner = jnp.where(inner >= tau[:, None], jnp.exp(inner - m[:, None]), 0.0)
    nonzero = inner > 0
    j = _first_true((_prefix_sums(inner) > (target - base)[:, None]) & nonzero, _last_true(nonzero))
    return (b * L + j).astype(jnp.int32)


def _apply_penalties(x: jax.Array, st: SamplingTensors) -> jax.Array:
    """Repetition penalty on tokens seen in prompt or output, then frequency and presence on output
    counts: gathered, adjusted and scattered back at the listed pairs only."""
    rows = jnp.minimum(st.penalty_rows, x.shape[0] - 1)  # padding reads a real row, writes nothing
    v = x[rows, st.penalty_tokens]
    rep = st.repetition_penalty[rows]
    cnt = st.penalty_counts
    v = (
        jnp.where(v > 0, v / rep, v * rep)
        - st.frequency_penalty[rows] * cnt
        - st.presence_penalty[rows] * (cnt > 0).astype(jnp.float32)
    )
    return x.at[st.penalty_rows, st.penalty_tokens].set(v, mode="drop")


def _draw(x: jax.Array, st: SamplingTensors, top_k_top_p: bool) -> jax.Array:
    t = jnp.where(st.temperature > 0, st.temperature, 1.0)
    m = jnp.max(x / t[:, None], -1)
    tau = m + jnp.log(st.min_p)  # p >= min_p * p_max; log(0) = -inf
    if top_k_top_p:
        tau, sums = _top_k_top_p(x, t, m, tau, st.top_k, st.top_p)
    else:
        sums = _block_sums(x, t, m, tau)
    u = jax.vmap(_row_uniform)(st.seed_lo, st.seed_hi, st.position)
    return _inverse_cdf(x, t, m, tau, sums, u)


def _logsumexp(x: jax.Array) -> jax.Array:
    m = jnp.max(x, -1)
    return m + jnp.log(jnp.sum(jnp.exp(x - m[:, None]), -1))


def _top_logprobs(
    raw: jax.Array, lse: jax.Array, chosen: jax.Array, n: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rank of ``chosen`` (1 = best) and the ``n`` best (ids, logprobs) of each row.

    A chosen token within the top ``n`` gets its rank from them; only the other rows are counted.
    """
    chosen_logit = jnp.take_along_axis(raw, chosen[:, None], -1)[:, 0]

    def counted(raw: jax.Array, c: jax.Array) -> jax.Array:
        return (jnp.sum(raw > c[:, None], -1) + 1).astype(jnp.int32)

    R = raw.shape[0]
    if n == 0:
        return counted(raw, chosen_logit), jnp.zeros((R, 0), jnp.int32), jnp.zeros((R, 0), raw.dtype)
    vals, ids = jax.lax.top_k(raw, n)
    in_top = chosen_logit >= vals.min(-1)  # not vals[:, -1]: XLA makes that a sort
    from_top = (jnp.sum(vals > chosen_logit[:, None], -1) + 1).astype(jnp.int32)
    return _on_rows(counted, ~in_top, from_top, raw, chosen_logit), ids.astype(jnp.int32), vals - lse[:, None]


def _apply_bitmask(x: jax.Array, words: jax.Array) -> jax.Array:
    """``x`` with -inf where the packed bitmask ``words`` ([R, ceil(V / 32)] int32, 0 bits past V) has a 0
    bit. A row that allows no token (a grammar's dead end) is left whole: it samples a token of the
    vocabulary, which its grammar then refuses."""
    R, V = x.shape
    allowed = ((words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1).reshape(R, -1)[:, :V] != 0
    dead = ~(words != 0).any(-1, keepdims=True)  # from the words: a pass over [R, V] fewer
    return jnp.where(allowed | dead, x, -jnp.inf)


def process_logits(logits: jax.Array, st: SamplingTensors, flags: SamplerFlags) -> jax.Array:
    """The grammar bitmask, logit bias and the min_tokens mask, then penalties: the logits greedy rows
    take the argmax of."""
    x = logits
    if flags.bitmask:
        x = _apply_bitmask(x, st.allowed)
    if flags.bias:
        x = x.at[st.bias_rows, st.bias_tokens].add(st.bias_values, mode="drop")
    if flags.penalties:
        x = _apply_penalties(x, st)
    return x


def no_logprobs(rows: int, xp=jnp) -> tuple:
    """The logprob fields (logprobs, ranks, top ids, top logprobs) of a ``SamplerOutput`` of ``rows``
    rows that computed none, as ``xp`` arrays (``jnp``, or ``numpy`` for an output built on the host)."""
    return (
        xp.zeros(0, xp.float32),
        xp.zeros(0, xp.int32),
        xp.zeros((rows, 0), xp.int32),
        xp.zeros((rows, 0), xp.float32),
    )


def sample(logits: jax.Array, st: SamplingTensors, flags: SamplerFlags) -> SamplerOutput:
    """One token per row of ``logits[R, V]`` (float32)."""
    raw = logits
    x = process_logits(raw, st, flags)
    tokens = argmax(x)
    if not flags.all_greedy:
        tokens = jnp.where(st.temperature > 0, _draw(x, st, flags.top_k_top_p), tokens)
    empty = no_logprobs(raw.shape[0])
    if not flags.chosen_logprobs and flags.num_logprobs < 0:
        return SamplerOutput(tokens, *empty)
    lse = _logsumexp(raw)
    logprobs = jnp.take_along_axis(raw, tokens[:, None], -1)[:, 0] - lse
    if flags.num_logprobs < 0:
        return SamplerOutput(tokens, logprobs, *empty[1:])
    ranks, top_ids, top_lps = _top_logprobs(raw, lse, tokens, flags.num_logprobs)
    return SamplerOutput(tokens, logprobs, ranks, top_ids, top_lps)


def prompt_logprobs(logits: jax.Array, targets: jax.Array, num_logprobs: int) -> SamplerOutput:
    """Logprob, rank and top ``num_logprobs`` at prompt positions: row i scores ``targets[i]``."""
    lse = _logsumexp(logits)
    lp = jnp.take_along_axis(logits, targets[:, None], -1)[:, 0] - lse
    ranks, top_ids, top_lps = _top_logprobs(logits, lse, targets, num_logprobs)
    return SamplerOutput(targets, lp, ranks, top_ids, top_lps)
