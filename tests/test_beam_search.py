"""Beam search through the engine against transformers' ``generate(num_beams=k, do_sample=False)``:
the same beams, in the same order, with the same scores, for k = 1, 2, 4 and HF's length_penalty /
early_stopping semantics; beams share blocks and free them all at the end or on abort."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxpaged import LLM, BeamSearchParams
from jaxpaged.beam_search import BeamSearchState
from tiny_models import random_prompts, save_tiny_llama

EOS = 2
PROMPTS = random_prompts(np.random.default_rng(5), [3, 12, 30])
MAX_NEW = 10


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory, tiny_tokenizer_dir):
    """The tiny random Llama with its EOS logits scaled up, so beams end at EOS now and then
    (with the plain model EOS never reaches a beam, and early stopping would go untested)."""
    path = tmp_path_factory.mktemp("model-eos-heavy")
    hf = save_tiny_llama(path, tiny_tokenizer_dir)
    with torch.no_grad():
        hf.lm_head.weight[EOS] *= 2.5
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def llm(eos_model):
    return LLM(str(eos_model[0]), block_size=4, max_num_batched_tokens=64)


@torch.no_grad()
def hf_beams(
    hf, prompt: list[int], k: int, length_penalty: float, early_stopping
) -> list[tuple[list[int], float]]:
    """(generated tokens up to and including EOS, score) of HF's returned beams, best first."""
    out = hf.generate(
        torch.tensor([prompt]),
        num_beams=k,
        do_sample=False,
        max_new_tokens=MAX_NEW,
        num_return_sequences=k,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        return_dict_in_generate=True,
        output_scores=True,
        pad_token_id=0,
        eos_token_id=EOS,
    )
    beams = []
    for i, seq in enumerate(out.sequences[:, len(prompt) :].tolist()):
        toks = seq[: seq.index(EOS) + 1] if EOS in seq else seq
        if k == 1:  # greedy search: HF gives no sequence score; score the tokens as beam search does
            lp = torch.log_softmax(hf(torch.tensor([prompt + toks])).logits[0].double(), -1)
            cum = sum(float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(toks))
            beams.append((toks, cum / len(toks) ** length_penalty))
        else:
            beams.append((toks, float(out.sequences_scores[i])))
    return beams


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize(
    "length_penalty, early_stopping", [(1.0, False), (0.5, True), (2.0, "never"), (-1.0, False)]
)
def test_beams_and_scores_match_transformers(eos_model, llm, k, length_penalty, early_stopping):
    params = BeamSearchParams(
        beam_width=k, max_tokens=MAX_NEW, length_penalty=length_penalty, early_stopping=early_stopping
    )
    outs = llm.beam_search(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_beams(eos_model[1], prompt, k, length_penalty, early_stopping)
        got = [(s.output_token_ids, s.score) for s in out.sequences]
        assert [t for t, _ in got] == [t for t, _ in ref], f"prompt of {len(prompt)} tokens"
        np.testing.assert_allclose([s for _, s in got], [s for _, s in ref], rtol=1e-4, atol=1e-4)
        for s in out.sequences:
            assert s.tokens[: len(prompt)] == prompt
            assert s.finish_reason == ("stop" if s.output_token_ids[-1] == EOS else "length")
            assert s.cum_logprob == pytest.approx(sum(next(iter(d.values())).logprob for d in s.logprobs))
    eng = llm.engine
    assert eng.kv_cache_manager.num_free_blocks == eng.cache_info.num_usable_blocks
    assert eng.kv_cache_manager.pool.num_block_refs == 0


def test_some_reference_beams_end_at_eos(eos_model):
    """Guards the test above: the EOS-heavy model must make EOS and early stopping matter."""
    ends = [toks[-1] == EOS for p in PROMPTS for toks, _ in hf_beams(eos_model[1], p, 4, 1.0, False)]
    assert any(ends) and not all(ends)


def test_ignore_eos_runs_every_beam_to_max_tokens(eos_model, llm):
    out = llm.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True))[0]
    ref = hf_beams_no_eos(eos_model[1], PROMPTS[1], 2, 6)
    assert [s.output_token_ids for s in out.sequences] == ref
    assert all(s.finish_reason == "length" for s in out.sequences)


@torch.no_grad()
def hf_beams_no_eos(hf, prompt, k, n):
    out = hf.generate(
        torch.tensor([prompt]),
        num_beams=k,
        do_sample=False,
        max_new_tokens=n,
        num_return_sequences=k,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[:, len(prompt) :].tolist()


def test_beams_share_blocks_and_free_them(llm):
    """Mid-search, the beams share the prompt's blocks (measured as blocks saved); an abort with
    live beams frees everything."""
    eng = llm.engine
    prompt = random_prompts(np.random.default_rng(9), [37])[0]
    eng.add_beam_search_request("bs", prompt, BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True))
    saved = []
    for _ in range(5):
        eng.step()
        stats = eng.sharing_stats()
        saved.append(stats.saved_fraction)
        assert stats.blocks_used == eng.kv_cache_manager.pool.num_used_blocks
    # 4 beams over a 37-token prompt (10 blocks of 4): nearly all of each beam's table is shared.
    assert max(saved) > 0.6
    assert len(eng._beam_searches.by_id["bs"].beams) == 4
    eng.abort_request("bs")
    assert not eng.has_unfinished_requests()
    assert eng.kv_cache_manager.num_free_blocks == eng.cache_info.num_usable_blocks
    assert eng.kv_cache_manager.pool.num_block_refs == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_groups_under_memory_pressure(eos_model, llm, mode):
    """Two beam searches in a pool that holds about one of them: beams that wait for their group
    are preempted to let the others run (never readmitted before their group moves on), and the
    results equal those found without pressure."""
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    prompts = [PROMPTS[1], PROMPTS[2]]
    ref = [[s.tokens for s in o.sequences] for o in llm.beam_search(prompts, params)]
    tight = LLM(
        str(eos_model[0]),
        block_size=4,
        num_gpu_blocks_override=12,
        max_num_batched_tokens=64,
        preemption_mode=mode,
        swap_space=2**-10,
    )
    outs = tight.beam_search(prompts, params)
    assert [[s.tokens for s in o.sequences] for o in outs] == ref
    assert tight.engine.scheduler.num_preemptions > 0
    assert (tight.engine.scheduler.num_swapped_out > 0) == (mode == "swap")
    kv = tight.engine.kv_cache_manager
    assert kv.num_free_blocks == tight.engine.cache_info.num_usable_blocks and kv.pool.num_block_refs == 0
    assert kv.host_pool.num_free_blocks == kv.host_pool.num_blocks


def test_invalid_beam_params():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5)


def test_state_stops_per_hf_rules():
    """Pure bookkeeping: with early_stopping=True the search ends once k hypotheses are finished."""
    st = BeamSearchState(BeamSearchParams(beam_width=2, max_tokens=50, early_stopping=True), eos_token_id=EOS)
    # One beam; candidates: EOS best, then 5, 6, 7.
    nxt = st.step([(0.0, [], [])], [([EOS, 5, 6, 7], [-0.1, -0.2, -0.3, -0.4])])
    assert [(c.beam, c.token) for c in nxt] == [(0, 5), (0, 6)] and len(st.finished) == 1
    nxt = st.step(
        [(-0.2, [5], [-0.2]), (-0.3, [6], [-0.3])],
        [([EOS, 8, 9, 10], [-0.05, -1.0, -1.1, -1.2]), ([11, 12, 13, 14], [-2.0, -2.1, -2.2, -2.3])],
    )
    assert st.done and nxt == []
    assert [h.token_ids for h in st.finished] == [[EOS], [5, EOS]]
    assert st.finished[1].score == pytest.approx(-0.25 / 2)


def test_a_beam_search_failing_in_a_step_returns_error_beams_and_frees_its_blocks(llm, monkeypatch):
    """A beam search whose step raises ends like a failed request: its beams finish with reason "error"
    (scored -inf, below any real beam), its blocks are freed, and the engine serves the next search."""

    def broken(self, *args, **kwargs):
        raise RuntimeError("injected failure")

    prompt = random_prompts(np.random.default_rng(5), [7])[0]
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    with monkeypatch.context() as mp:
        mp.setattr(BeamSearchState, "step", broken)
        [out] = llm.beam_search([prompt], params)
    assert [(s.finish_reason, s.score) for s in out.sequences] == [("error", float("-inf"))] * 2
    eng = llm.engine
    assert eng.kv_cache_manager.num_free_blocks == eng.cache_info.num_usable_blocks
    [again] = llm.beam_search([prompt], params)
    assert [s.finish_reason for s in again.sequences] != ["error", "error"]
