"""Speculative decoding's parts on their own: the n-gram lookup against a brute-force search, the
configuration's checks, and the verification rule's output distribution against the standard rejection
sampler computed in numpy (accept min(1, p/q), resample norm(max(0, p - q)), bonus token)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from jaxpaged.request import Request, RequestStatus
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.spec_decode.metrics import SpecDecodingStats
from jaxpaged.spec_decode.ngram_proposer import NgramProposer, find_ngram_draft
from jaxpaged.spec_decode.rejection import num_accepted
from jaxpaged.spec_decode.speculator import ACCEPTANCE_WINDOW, PROBE_WINDOW, Speculator
from jaxpaged.speculative_config import SpeculativeConfig
from test_sampler import _sample, exact_target, flags_for, logits_row, tensors


def brute_force_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule, by loops: the longest n in [min_n, max_n] whose suffix occurs ending before the last
    position; among its occurrences the latest followed by k tokens, else the earliest."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        ends = [e for e in range(n - 1, L - 1) if tokens[e - n + 1 : e + 1] == suffix]
        if ends:
            full = [e for e in ends if e + k <= L - 1]
            e = full[-1] if full else ends[0]
            return tokens[e + 1 : e + 1 + k]
    return []


@pytest.mark.parametrize("vocab", [2, 3, 5, 50])
def test_ngram_lookup_matches_brute_force(vocab):
    rng = np.random.default_rng(vocab)
    for trial in range(300):
        L = int(rng.integers(1, 40))
        tokens = rng.integers(0, vocab, L).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k = int(rng.integers(1, 6))
        got = find_ngram_draft(np.asarray(tokens, np.int32), min_n, max_n, k).tolist()
        assert got == brute_force_draft(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_ngram_proposer_follows_growing_requests():
    """The per-request buffer grows with the output (and starts over if it shrinks) and gives what a
    lookup over the whole list gives."""
    rng = np.random.default_rng(0)
    proposer = NgramProposer(4, 1, 3)
    prompt = rng.integers(0, 6, 30).tolist()
    output: list[int] = []
    for step in range(120):
        want = find_ngram_draft(np.asarray(prompt + output, np.int32), 1, 3, 4).tolist()
        assert proposer.propose("a", prompt, output, 4) == want
        output.append(int(rng.integers(0, 6)))
        if step == 60:
            output = output[:5]
    assert proposer.propose("b", [7, 8, 7], [], 9) == [8, 7]  # k is capped by num_speculative_tokens
    proposer.forget("a")
    assert "a" not in proposer._buffers


def test_copying_a_passage_is_proposed():
    passage = list(range(100, 140))
    tokens = [1, 2, *passage, 3, 4, *passage[:10]]
    assert find_ngram_draft(np.asarray(tokens, np.int32), 2, 5, 5).tolist() == passage[10:15]


@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, "method must be one of"),
        ({"num_speculative_tokens": 3}, "needs 'method'"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "num_speculative_tokens must be an integer from 1",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_max must be an integer from 4",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "model": "x"},
            "'model' is for method 'draft_model'",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown keys ['typo']"),
        ({"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_rate": 2}, "in [0, 1]"),
        ("{not json", "must be a JSON object"),
        ([1], "must be a dict"),
    ],
)
def test_speculative_config_errors(value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        SpeculativeConfig.parse(value)


def test_speculative_config_parses_dict_and_json():
    a = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    b = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert a == b and a.prompt_lookup_min == 2 and a.num_speculative_tokens == 4
    assert SpeculativeConfig.parse({}) is None and SpeculativeConfig.parse(None) is None


def test_num_accepted_counts_the_matching_prefix():
    sampled = np.array([[5, 6, 7, 8], [5, 9, 7, 8], [1, 6, 7, 8], [5, 6, 7, 2]])
    drafts = np.array([[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, -1]])
    assert num_accepted(sampled, drafts).tolist() == [3, 1, 0, 2]


def standard_rejection_outcomes(p_rows: np.ndarray, q_rows: np.ndarray, drafts: list[int]) -> dict:
    """Exact probability of each emitted sequence under the standard rejection sampler, in numpy:
    draft j is kept with probability min(1, p_j(d_j) / q_j(d_j)); the first rejection emits a token of
    norm(max(0, p_j - q_j)) and stops; with every draft kept, a bonus token of p_k."""
    outcomes: dict[tuple[int, ...], float] = {}
    kept = 1.0
    for j, d in enumerate(drafts):
        p, q = p_rows[j], q_rows[j]
        alpha = min(1.0, p[d] / q[d])
        residual = np.maximum(0.0, p - q)
        if residual.sum() > 0:
            residual = residual / residual.sum()
            for y in np.flatnonzero(residual):
                outcomes[(*drafts[:j], int(y))] = kept * (1 - alpha) * residual[y]
        kept *= alpha
    for y in np.flatnonzero(p_rows[len(drafts)]):
        outcomes[(*drafts, int(y))] = kept * p_rows[len(drafts)][y]
    return outcomes


@pytest.mark.parametrize(
    "params", [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8)]
)
def test_verification_follows_the_standard_rejection_sampler(params):
    """Each trial (a seed) samples the k + 1 positions of a verifying row with the engine's sampler and
    keeps the matching prefix; the emitted sequences' frequencies pass a chi-square test against the
    standard rule's exact probabilities with the proposers' point-mass drafts (q = one-hot)."""
    V, k, N = 12, 3, 8192
    logits = np.stack([logits_row(V, 1.5, seed=s) for s in range(k + 1)])
    p_rows = np.stack([exact_target(row, **params) for row in logits])
    # Drafts a likely, a middling and a likely token, so every acceptance length is seen.
    drafts = [int(np.argsort(-p_rows[0])[0]), int(np.argsort(-p_rows[1])[2]), int(np.argmax(p_rows[2]))]
    q_rows = np.eye(V)[drafts]
    expected = standard_rejection_outcomes(p_rows, q_rows, drafts)
    assert abs(sum(expected.values()) - 1) < 1e-9

    # Trial t is seed t; position j of the row samples at sequence position 100 + j.
    st = tensors(N * (k + 1), **params, seeds=np.repeat(np.arange(N), k + 1), position=0)
    st.position = np.tile(100 + np.arange(k + 1, dtype=np.int32), N)
    tokens = np.asarray(_sample(np.tile(logits, (N, 1)).astype(np.float32), st, flags_for(st)).tokens)
    sampled = tokens.reshape(N, k + 1)
    a = num_accepted(sampled, np.tile(drafts, (N, 1)))
    emitted = [tuple(sampled[t, : a[t] + 1].tolist()) for t in range(N)]
    assert set(emitted) <= set(expected), "emitted a sequence the rule never emits"
    counts = {o: 0 for o in expected}
    for o in emitted:
        counts[o] += 1
    big = [o for o in expected if expected[o] * N >= 5]
    observed = [counts[o] for o in big] + [N - sum(counts[o] for o in big)]
    want = [expected[o] * N for o in big] + [N - sum(expected[o] * N for o in big)]
    if want[-1] < 1e-9:
        observed, want = observed[:-1], want[:-1]
    assert stats.chisquare(observed, want).pvalue > 1e-3
    # Acceptance of the first draft is p(d0), as the rule says.
    assert abs((a >= 1).mean() - p_rows[0][drafts[0]]) < 4 * np.sqrt(p_rows[0][drafts[0]] / N) + 0.01


def test_greedy_verification_keeps_drafts_equal_to_the_argmax():
    V, k = 10, 3
    logits = np.stack([logits_row(V, 1.0, seed=s) for s in range(k + 1)])
    best = logits.argmax(1)
    st = tensors(k + 1, temperature=0.0)
    sampled = np.asarray(_sample(logits.astype(np.float32), st, flags_for(st)).tokens)[None]
    for drafts, want in [
        (best[:3], 3),
        ([best[0], (best[1] + 1) % V, best[2]], 1),
        ([(best[0] + 1) % V, best[1], best[2]], 0),
    ]:
        assert num_accepted(sampled, np.asarray([drafts])).tolist() == [want]


def test_spec_decoding_stats_arithmetic():
    s = SpecDecodingStats()
    for drafted, kept in [(3, 3), (3, 0), (2, 1)]:
        s.observe(drafted, kept)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 8, 4)
    assert s.num_accepted_tokens_per_pos == [2, 1, 1]
    assert s.acceptance_rate == 0.5 and s.mean_acceptance_length == 1 + 4 / 3
    total = s + SpecDecodingStats(1, 4, 4, [1, 1, 1, 1])
    assert total.num_accepted_tokens_per_pos == [3, 2, 2, 1] and total.num_drafts == 4
    assert total - s == SpecDecodingStats(1, 4, 4, [1, 1, 1, 1])


def test_probe_looks_at_a_rotating_window_of_the_running_requests():
    """In a large batch each probe asks the proposer about PROBE_WINDOW requests, and successive probes
    cover every running request."""
    asked: list[list[str]] = []

    class Recording:
        def has_drafts(self, requests):
            asked.append([r.request_id for r in requests])
            return False

    running = []
    for i in range(PROBE_WINDOW + 8):
        r = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=10), max_tokens=10, seed=0, multi_step=True)
        r.status = RequestStatus.RUNNING
        running.append(r)
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    speculator = Speculator(config, Recording(), max_model_len=100)
    speculator.probe(running)
    speculator.probe(running)
    assert all(len(ids) == PROBE_WINDOW for ids in asked)
    assert {i for ids in asked for i in ids} == {r.request_id for r in running}
    assert not speculator.wants_sync


class FixedProposer:
    """Proposes ``drafts`` for every request it is asked about."""

    def __init__(self, drafts: list[int]):
        self.drafts = drafts

    def propose_many(self, requests, ks):
        return [self.drafts[:k] for k in ks]

    def has_drafts(self, requests):
        return bool(requests)

    def forget(self, request_id):
        pass


def decoding(n: int, prompt_len: int = 5, max_tokens: int = 20) -> list[Request]:
    """``n`` running requests with every token but the last computed (where a decode proposes)."""
    out = []
    for i in range(n):
        r = Request(
            f"r{i}",
            list(range(prompt_len)),
            SamplingParams(max_tokens=max_tokens),
            max_tokens,
            0,
            multi_step=True,
        )
        r.status, r.num_computed_tokens = RequestStatus.RUNNING, prompt_len - 1
        out.append(r)
    return out


def test_no_proposals_from_disable_by_batch_size_on():
    config = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 4}
    )
    speculator = Speculator(config, FixedProposer([7, 8, 9]), max_model_len=100)
    speculator.propose(decoding(3))
    assert speculator.wants_sync
    many = decoding(4)
    speculator.propose(many)
    speculator.probe(many)
    assert not speculator.wants_sync and all(not r.spec_token_ids for r in many)


def test_low_acceptance_backs_off_for_a_window_then_proposes_again():
    """A request whose last ACCEPTANCE_WINDOW drafted tokens were accepted less often than min_acceptance_rate
    proposes nothing for ACCEPTANCE_WINDOW steps; one accepting enough keeps proposing; drafts stop short of
    max_tokens and max_model_len."""
    config = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 4, "min_acceptance_rate": 0.25}
    )
    speculator = Speculator(config, FixedProposer([7, 8, 9, 10]), max_model_len=100)
    low, high = decoding(2)
    for _ in range(ACCEPTANCE_WINDOW // 4):
        speculator.record(low, 4, 0)  # 0 of 16: below 0.25
        speculator.record(high, 4, 1)  # 4 of 16: not below
    for step in range(ACCEPTANCE_WINDOW):
        speculator.propose([low, high])
        assert (list(low.spec_token_ids), list(high.spec_token_ids)) == ([], [7, 8, 9, 10]), step
        speculator.clear_drafts()
    speculator.propose([low, high])
    assert list(low.spec_token_ids) == [7, 8, 9, 10]
    assert (low.num_spec_draft_tokens, low.num_spec_accepted_tokens, low.num_spec_verifications) == (16, 0, 4)
    near_end = decoding(1, max_tokens=3)[0]
    near_end.output_token_ids = [1]
    near_end.num_computed_tokens = near_end.num_tokens - 1
    short_context = Speculator(config, FixedProposer([7, 8, 9, 10]), max_model_len=7)
    short_context.propose(decoding(1))
    speculator.propose([near_end])
    assert list(near_end.spec_token_ids) == [7]  # 2 outputs left: one draft, then the sampled token
    assert list(short_context._drafted[0].spec_token_ids) == [7, 8]  # 5 tokens + 2 drafts = max_model_len
