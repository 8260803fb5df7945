"""A step's sampler inputs on the host: each sampled row's parameters gathered from the persistent batch
(``SequenceSlots``), the compact penalty and bias lists of the sequences that need them, the grammar bitmask,
and the batch's ``SamplerFlags``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxpaged.array_utils import padded
from jaxpaged.math_utils import pow2_bucket
from jaxpaged.request import Request
from jaxpaged.sampler import SamplerFlags, SamplingTensors
from jaxpaged.sampling_params import MAX_LOGPROBS
from jaxpaged.sequence_slots import SequenceSlots
from jaxpaged.structured_outputs import fill_bitmask

# Floors of the compact sampling lists: (row, token) pairs for penalties and for bias/masks.
MIN_PENALTY_PAIRS, MIN_BIAS_ENTRIES = 256, 16


def _penalty_counts(r: Request) -> dict[int, int]:
    """The request's penalty pairs, token -> output count, brought up to date with its new output
    tokens: kept on the request, so a step costs O(new tokens), not O(prompt + output)."""
    if r.penalty_counts is None:
        with_prompt = r.sampling_params.repetition_penalty != 1.0
        r.penalty_counts = dict.fromkeys(r.prompt_token_ids, 0) if with_prompt else {}
    counts = r.penalty_counts
    for t in r.output_token_ids[r.num_penalty_counted :]:
        counts[t] = counts.get(t, 0) + 1
    r.num_penalty_counted = r.num_output_tokens
    return counts


def _host_lists(
    r: Request, drafts: Sequence[int] = ()
) -> tuple[tuple[np.ndarray, np.ndarray] | None, dict[int, float]]:
    """A sequence's per-step sampler lists: its penalty (tokens, counts), if it has penalties, and its
    logit bias with the ``min_tokens`` mask; for a speculative row, as if ``drafts`` (the drafts before the
    position it samples) were already output tokens."""
    sp = r.sampling_params
    penalties = None
    if sp.needs_penalties:
        counts = _penalty_counts(r)
        if drafts:
            counts = dict(counts)
            for t in drafts:
                counts[t] = counts.get(t, 0) + 1
        penalties = (
            np.fromiter(counts.keys(), np.int32, len(counts)),
            np.fromiter(counts.values(), np.float32, len(counts)),
        )
    bias = dict(sp.logit_bias)
    # Tokens before the one this row samples: its own and earlier in-flight ones are placeholders.
    if r.num_output_tokens + r.num_output_placeholders - 1 + len(drafts) < sp.min_tokens:
        # vLLM's min_tokens: EOS (unless ignored) and the stop ids cannot be sampled yet.
        masked = set(sp.stop_token_ids)
        if r.eos_token_id is not None and not sp.ignore_eos:
            masked.add(r.eos_token_id)
        bias.update(dict.fromkeys(masked, -np.inf))
    return penalties, bias


def _logprobs_width(n: int) -> int:
    """Top logprobs computed for the batch: none beyond the chosen token's, or the most allowed
    (two variants only: a top-20 costs little more than a top-1)."""
    return 0 if n == 0 else MAX_LOGPROBS


def build_sampling_tensors(
    st: SequenceSlots,
    seqs: list[Request],
    slots: np.ndarray,
    positions: np.ndarray,
    S_b: int,
    prompt_widths: list[int],
    vocab_size: int,
    drafts_before: Sequence[Sequence[int] | None] = (),
) -> tuple[SamplingTensors, SamplerFlags]:
    """Per-row parameters gathered from the sequences' slots (``seqs[i]`` at slot ``slots[i]``, sampling the
    token at ``positions[i]``), padded to ``S_b`` rows, the compact penalty and bias lists and the grammar
    bitmask (built only for the sequences that have them), and the flags of the batch. A sequence whose lists
    fail to build goes to ``SequenceSlots.failed`` (one request's failure, not the step's). ``drafts_before``
    (speculative decoding, else empty): for each row of a verifying request, the drafts before the position it
    samples (None for the others); a constrained one's rows get its grammar's masks after those drafts."""
    f32 = np.float32
    pen_rows, pen_tokens, pen_counts = [], [], []
    bias_rows, bias_tokens, bias_values = [], [], []
    constrained = []
    drafted: dict[str, tuple[Request, dict[int, int]]] = {}
    """A verifying constrained request's rows, by the number of drafts before each."""
    for i in np.flatnonzero(st.needs_host_lists[slots]).tolist():
        r = seqs[i]
        before = drafts_before[i] if drafts_before else None
        try:
            penalties, bias = _host_lists(r, before or ())
        except Exception as e:  # this request's failure: its row runs without its lists
            st.failed[r.request_id] = e
            continue
        if r.grammar is not None and before is not None:
            drafted.setdefault(r.request_id, (r, {}))[1][len(before)] = i
        elif r.grammar is not None:
            constrained.append((r.grammar, i))
        if penalties is not None:
            tokens, counts = penalties
            pen_rows.append(np.full(len(tokens), i, np.int32))
            pen_tokens.append(tokens)
            pen_counts.append(counts)
        if bias:
            bias_rows += [i] * len(bias)
            bias_tokens += bias.keys()
            bias_values += bias.values()
    width = max([int(st.logprobs[slots].max(initial=-1)), *prompt_widths])
    n_pen = sum(len(a) for a in pen_rows)
    Np = 0 if not pen_rows else pow2_bucket(n_pen, floor=MIN_PENALTY_PAIRS)
    Nb = 0 if not bias_rows else pow2_bucket(len(bias_rows), floor=MIN_BIAS_ENTRIES)
    cat = lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
    seeds = padded(st.seed[slots], S_b, 0)
    temperature, top_k, top_p = (
        padded(st.temperature[slots], S_b, 0.0),
        padded(st.top_k[slots], S_b, 0),
        padded(st.top_p[slots], S_b, 1.0),
    )
    sampling = SamplingTensors(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=padded(st.min_p[slots], S_b, 0.0),
        presence_penalty=padded(st.presence[slots], S_b, 0.0),
        frequency_penalty=padded(st.frequency[slots], S_b, 0.0),
        repetition_penalty=padded(st.repetition[slots], S_b, 1.0),
        seed_lo=(seeds & 0xFFFFFFFF).astype(np.uint32),
        seed_hi=(seeds >> 32).astype(np.uint32),
        position=padded(positions, S_b, 0),
        penalty_rows=padded(cat(pen_rows, np.int32), Np, S_b),
        penalty_tokens=padded(cat(pen_tokens, np.int32), Np, 0),
        penalty_counts=padded(cat(pen_counts, f32), Np, 0.0),
        bias_rows=padded(np.asarray(bias_rows, np.int32), Nb, S_b),
        bias_tokens=padded(np.asarray(bias_tokens, np.int32), Nb, 0),
        bias_values=padded(np.asarray(bias_values, f32), Nb, 0.0),
    )
    if constrained or drafted:
        groups = [
            (r.grammar, [rows[j] for j in range(len(rows))], drafts_before[rows[len(rows) - 1]])
            for r, rows in drafted.values()
        ]
        sampling.allowed = fill_bitmask(constrained, S_b, vocab_size, groups)
    sampled = temperature > 0
    flags = SamplerFlags(
        all_greedy=not sampled.any(),
        penalties=bool(pen_rows),
        bias=bool(bias_rows),
        top_k_top_p=bool(((top_k > 0) | (top_p < 1.0))[sampled].any()),
        chosen_logprobs=bool(st.chosen_logprobs[slots].any()),
        num_logprobs=-1 if width < 0 else _logprobs_width(width),
        bitmask=bool(constrained or drafted),
    )
    return sampling, flags
