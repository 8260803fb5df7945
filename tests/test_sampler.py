"""The on-device sampler against exact target distributions, Hugging Face's logits processors,
hand-computed penalties, and itself in other batches (batch invariance)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from scipy import stats
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from jaxpaged.sampler import CANDIDATES, SamplerFlags, SamplingTensors, process_logits, sample

_sample = jax.jit(sample, static_argnames="flags")
_process = jax.jit(process_logits, static_argnames="flags")
DRAWS = 8192


def tensors(
    R: int,
    *,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    presence=0.0,
    frequency=0.0,
    repetition=1.0,
    seeds=None,
    position=0,
    penalties=(),
    bias=(),
) -> SamplingTensors:
    """Per-row arrays (scalars broadcast); ``penalties``: unique (row, token, output count); ``bias``: (row, token, value)."""

    def row(v, dtype):
        return np.broadcast_to(np.asarray(v, dtype), (R,)).copy()

    seeds = np.arange(R, dtype=np.uint64) if seeds is None else np.asarray(seeds, np.uint64)
    pen = np.asarray(penalties, np.int64).reshape(-1, 3)
    b = np.asarray(bias, np.float64).reshape(-1, 3)
    return SamplingTensors(
        temperature=row(temperature, np.float32),
        top_k=row(top_k, np.int32),
        top_p=row(top_p, np.float32),
        min_p=row(min_p, np.float32),
        presence_penalty=row(presence, np.float32),
        frequency_penalty=row(frequency, np.float32),
        repetition_penalty=row(repetition, np.float32),
        seed_lo=(seeds & 0xFFFFFFFF).astype(np.uint32),
        seed_hi=(seeds >> 32).astype(np.uint32),
        position=row(position, np.int32),
        penalty_rows=pen[:, 0].astype(np.int32),
        penalty_tokens=pen[:, 1].astype(np.int32),
        penalty_counts=pen[:, 2].astype(np.float32),
        bias_rows=b[:, 0].astype(np.int32),
        bias_tokens=b[:, 1].astype(np.int32),
        bias_values=b[:, 2].astype(np.float32),
    )


def flags_for(st: SamplingTensors, num_logprobs: int = -1) -> SamplerFlags:
    sampled = st.temperature > 0
    return SamplerFlags(
        all_greedy=not sampled.any(),
        penalties=len(st.penalty_rows) > 0,
        bias=len(st.bias_rows) > 0,
        top_k_top_p=bool(((st.top_k > 0) | (st.top_p < 1))[sampled].any()),
        num_logprobs=num_logprobs,
    )


def exact_target(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """vLLM's definition, by sorting, in float64: temperature, min_p, top_k, then top_p on the rest."""
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    if top_k > 0:
        keep &= x >= np.sort(x)[::-1][top_k - 1]
    if top_p < 1.0:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        order = np.argsort(-x, kind="stable")
        above = np.cumsum(q[order]) - q[order]  # mass of strictly more likely tokens
        nucleus = np.zeros_like(keep)
        nucleus[order] = above < top_p
        keep &= nucleus
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def draw(logits: np.ndarray, n: int = DRAWS, **params) -> np.ndarray:
    """``n`` seeded draws from one logit row (one row per draw, seeds 0..n-1)."""
    st = tensors(n, **params)
    out = _sample(np.broadcast_to(logits, (n, logits.size)).astype(np.float32), st, flags_for(st))
    return np.asarray(out.tokens)


def assert_follows(tokens: np.ndarray, target: np.ndarray) -> None:
    """Never outside the support; frequencies pass a chi-square test against ``target``."""
    support = target > 0
    assert support[tokens].all(), f"drew tokens outside the support: {sorted(set(tokens[~support[tokens]]))}"
    counts = np.bincount(tokens, minlength=target.size)[support]
    expected = target[support] * len(tokens)
    p_value = stats.chisquare(counts, expected).pvalue
    assert p_value > 1e-3, f"chi-square p-value {p_value:.2e}"


def logits_row(V: int, scale: float, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=V) * scale).astype(np.float32)


CASES = {
    "temperature": (40, 2.0, dict(temperature=0.6)),
    "top_k": (40, 2.0, dict(top_k=5)),
    "top_p": (40, 2.0, dict(top_p=0.7)),
    "min_p": (40, 2.0, dict(min_p=0.2)),
    "all": (60, 2.0, dict(temperature=1.5, top_k=12, top_p=0.85, min_p=0.02)),
    # Beyond the candidate set: exact thresholds by bisection.
    "top_k_bisected": (300, 0.5, dict(top_k=CANDIDATES + 36)),
    "top_p_bisected": (300, 0.3, dict(top_p=0.9)),
    "top_k_top_p_bisected": (300, 0.3, dict(top_k=200, top_p=0.8, temperature=0.9)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_draws_follow_exact_target(case):
    V, scale, params = CASES[case]
    logits = logits_row(V, scale)
    target = exact_target(logits, **params)
    if "bisected" in case:
        assert (target > 0).sum() > CANDIDATES, "the case must need the bisection path"
    assert_follows(draw(logits, **params), target)


def hf_target(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """Transformers' warpers in generate()'s order: temperature, top-k, top-p, min-p."""
    scores = torch.tensor(logits, dtype=torch.float64)[None]
    ids = torch.zeros((1, 1), dtype=torch.long)
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p > 0.0:
        warpers.append(MinPLogitsWarper(min_p))
    for w in warpers:
        scores = w(ids, scores)
    return torch.softmax(scores, -1)[0].numpy()


# min_p and top_p are left out together: vLLM (and so jaxpaged) applies min_p first, transformers last.
@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7),
        dict(top_k=7),
        dict(top_p=0.6),
        dict(temperature=1.3, top_k=15, top_p=0.9),
        dict(min_p=0.15),
        dict(temperature=0.8, top_k=10, min_p=0.1),
        dict(top_p=0.95),
    ],
    ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()),
)
def test_draws_follow_transformers_warpers(params):
    logits = logits_row(50, 2.5, seed=1)
    target = hf_target(logits, **params)
    np.testing.assert_allclose(exact_target(logits, **params), target, atol=1e-9)
    assert_follows(draw(logits, **params), target)


def test_greedy_is_first_argmax_including_ties():
    rng = np.random.default_rng(2)
    for V in (384, 300, 49152):  # block sizes 128, padded 256, 256
        logits = rng.integers(-3, 4, size=(8, V)).astype(np.float32)  # many ties
        st = tensors(8, temperature=0.0)
        assert (np.asarray(_sample(logits, st, flags_for(st)).tokens) == logits.argmax(-1)).all()


def test_penalties_exact_on_hand_made_case():
    logits = np.array([[2.0, -1.0, 0.5, 0.0, 3.0], [2.0, -1.0, 0.5, 0.0, 3.0]], np.float32)
    # Row 0: prompt [0, 1], output [1, 2, 2]; row 1 has no penalties and must not change.
    pen = [(0, 0, 0), (0, 1, 1), (0, 2, 2)]
    st = tensors(
        2, temperature=0.0, repetition=[2.0, 1.0], frequency=[0.5, 0.0], presence=[0.25, 0.0], penalties=pen
    )
    got = np.asarray(_process(logits, st, flags_for(st)))
    # repetition on {0, 1, 2}: 2/2, -1*2, 0.5/2; then frequency 0.5 x count, presence 0.25 if count > 0.
    np.testing.assert_array_equal(got[0], [1.0, -2.0 - 0.5 - 0.25, 0.25 - 1.0 - 0.25, 0.0, 3.0])
    np.testing.assert_array_equal(got[1], logits[1])


def test_repetition_penalty_matches_transformers():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, 64)).astype(np.float32) * 3
    seqs = [rng.integers(0, 64, size=n) for n in (5, 20, 40)]
    pen = [(i, int(t), 0) for i, s in enumerate(seqs) for t in set(s.tolist())]
    penalties = [1.3, 0.7, 2.0]
    st = tensors(3, temperature=0.0, repetition=penalties, penalties=pen)
    got = np.asarray(_process(logits, st, flags_for(st)))
    for i, s in enumerate(seqs):
        ref = RepetitionPenaltyLogitsProcessor(penalties[i])(
            torch.tensor(s)[None], torch.tensor(logits[i : i + 1])
        )
        np.testing.assert_allclose(got[i], ref[0].numpy(), rtol=1e-6)


def test_logit_bias_and_masks():
    logits = np.zeros((2, 10), np.float32)
    st = tensors(2, temperature=0.0, bias=[(0, 3, 5.0), (0, 7, -2.5), (1, 0, -np.inf), (1, 9, 100.0)])
    got = np.asarray(_process(logits, st, flags_for(st)))
    expected = np.zeros((2, 10), np.float32)
    expected[0, 3], expected[0, 7], expected[1, 0], expected[1, 9] = 5.0, -2.5, -np.inf, 100.0
    np.testing.assert_array_equal(got, expected)
    assert np.asarray(_sample(logits, st, flags_for(st)).tokens).tolist() == [3, 9]
    # A masked token is never drawn, even when it would dominate.
    n = 512
    logits = np.tile(np.array([10.0, 0.0, 0.0, 0.0], np.float32), (n, 1))
    st = tensors(n, bias=[(i, 0, -np.inf) for i in range(n)])
    assert 0 not in np.asarray(_sample(logits, st, flags_for(st)).tokens)


def test_logprobs_ranks_and_top_n():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(16, 384)).astype(np.float32) * 3
    st = tensors(16, temperature=[0.0, 1.0, 5.0, 5.0] * 4)
    out = _sample(logits, st, flags_for(st, num_logprobs=8))
    assert (np.asarray(out.ranks) > 8).any(), "some chosen tokens must lie outside the top 8"
    ref = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), -1).numpy()
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(np.asarray(out.logprobs), ref[np.arange(16), tokens], atol=1e-5)
    np.testing.assert_array_equal(
        np.asarray(out.ranks), (ref > ref[np.arange(16), tokens][:, None]).sum(-1) + 1
    )
    order = np.argsort(-ref, -1)[:, :8]
    np.testing.assert_array_equal(np.asarray(out.top_ids), order)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(ref, order, -1), atol=1e-5)


def test_seeded_draws_are_batch_invariant():
    """One seeded row gives the same tokens whatever the other rows, the batch size and the stages
    their parameters switch on; it changes with the seed and the position."""
    V, n = 384, 64
    rng = np.random.default_rng(5)
    row = logits_row(V, 2.0, seed=6)
    target = dict(temperature=0.9, top_k=40, top_p=0.92, min_p=0.01)
    alone = []
    for pos in range(n):
        defaults = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
        st = tensors(
            8,
            **{k: [v] + [defaults[k]] * 7 for k, v in target.items()},
            seeds=[1234] + list(range(7)),
            position=pos,
        )
        batch = np.concatenate([row[None], rng.normal(size=(7, V)).astype(np.float32)])
        alone.append(int(_sample(batch, st, flags_for(st)).tokens[0]))
    R = 32
    for pos in range(n):
        others = dict(
            temperature=rng.uniform(0, 2, R),
            top_k=rng.choice([0, 5, 100], R),
            top_p=rng.choice([1.0, 0.5], R),
            min_p=rng.choice([0.0, 0.3], R),
        )
        for k, v in target.items():
            others[k][R // 2] = v
        seeds = rng.integers(0, 2**63, R).astype(np.uint64)
        seeds[R // 2] = 1234
        pen = [(i, int(t), 1) for i in range(R) if i != R // 2 for t in set(rng.integers(0, V, 3).tolist())]
        st = tensors(R, repetition=1.1, seeds=seeds, position=pos, penalties=pen, **others)
        st.repetition_penalty[R // 2] = 1.0
        batch = rng.normal(size=(R, V)).astype(np.float32)
        batch[R // 2] = row
        assert int(_sample(batch, st, flags_for(st, num_logprobs=4)).tokens[R // 2]) == alone[pos], pos
    assert len(set(alone)) > 5, "positions must give different draws"
