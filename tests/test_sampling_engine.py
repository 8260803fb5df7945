"""Sampling and output controls through the whole engine on a tiny random Llama: logprobs and
prompt logprobs against transformers, batch invariance of seeded sampling, n / best_of, penalties,
min_tokens, stops with streaming hold-back, and parameter validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from jaxpaged import LLM, SamplingParams
from tiny_models import hf_greedy, random_prompts

EOS = 2
PROMPTS = random_prompts(np.random.default_rng(10), [3, 19, 41])


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny[0]), max_num_batched_tokens=32, block_size=8)


def run(llm, prompts, params) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    eng = llm.engine
    assert eng.kv_cache_manager.num_free_blocks == eng.cache_info.num_usable_blocks
    return outs


@torch.no_grad()
def hf_logprobs(model, ids: list[int]) -> np.ndarray:
    """log_softmax of the HF model's logits at every position of ``ids`` (float64)."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()


def assert_position_matches(entry, token: int, ref: np.ndarray, n: int) -> None:
    """One vLLM-style logprobs dict: the token itself plus the top ``n``, against reference logprobs."""
    assert token in entry
    top = np.argsort(-ref)[:n]
    assert set(entry) == {token, *top.tolist()}
    assert entry[token].logprob == pytest.approx(ref[token], abs=1e-3)
    assert entry[token].rank == int((ref > ref[token]).sum()) + 1
    for rank, t in enumerate(top, start=1):
        assert entry[int(t)].logprob == pytest.approx(ref[t], abs=1e-3)
        if t != token:
            assert entry[int(t)].rank == rank
        assert isinstance(entry[int(t)].decoded_token, str)


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(max_num_batched_tokens=16, block_size=8),
        dict(block_size=4, num_gpu_blocks_override=17, max_num_batched_tokens=64),  # preempts
    ],
    ids=["chunked", "preempting"],
)
def test_logprobs_and_prompt_logprobs_match_transformers(tiny, engine_args):
    llm = LLM(str(tiny[0]), **engine_args)
    prompts = PROMPTS + random_prompts(np.random.default_rng(11), [30, 25, 35])
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    reqs = [llm.engine.add_request(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    outs = {}
    while llm.engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.engine.step() if o.finished})
    if "num_gpu_blocks_override" in engine_args:
        assert sum(r.num_preemptions for r in reqs) > 0
    for i, prompt in enumerate(prompts):
        out = outs[f"r{i}"]
        c = out.outputs[0]
        ref = hf_logprobs(tiny[1], prompt + c.token_ids)
        assert len(c.logprobs) == len(c.token_ids) == 10
        for k, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert_position_matches(entry, token, ref[len(prompt) - 1 + k], 5)
        assert c.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids))
        )
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for j in range(1, len(prompt)):
            assert_position_matches(out.prompt_logprobs[j], prompt[j], ref[j - 1], 3)


def test_prompt_logprobs_are_whole_when_the_prompt_is_cached(tiny, llm):
    """A prompt scored twice (lm-eval's multiple choice sends one context again and again): the second
    time its blocks are in the prefix cache, and every position is scored all the same, as transformers
    scores it. Requests without prompt logprobs still take the hits."""
    prompt = random_prompts(np.random.default_rng(12), [29])[0]
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    ref = hf_logprobs(tiny[1], prompt)
    for _ in range(2):
        out = run(llm, [prompt], sp)[0]
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for j in range(1, len(prompt)):
            assert_position_matches(out.prompt_logprobs[j], prompt[j], ref[j - 1], 2)
    hits = llm.engine.kv_cache_manager.stats.hits
    run(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=1))
    assert llm.engine.kv_cache_manager.stats.hits - hits == (len(prompt) - 1) // 8 * 8


def test_seeded_request_is_batch_invariant(tiny, llm):
    target = SamplingParams(
        temperature=0.8, top_p=0.9, top_k=50, min_p=0.02, seed=7, max_tokens=12, ignore_eos=True
    )
    alone = run(llm, [PROMPTS[1]], target)[0].outputs[0].token_ids
    rng = np.random.default_rng(12)
    others = [
        SamplingParams(
            temperature=float(rng.uniform(0.0, 1.5)),
            top_k=int(rng.choice([-1, 1, 5, 100])),
            top_p=float(rng.choice([1.0, 0.5, 0.95])),
            min_p=float(rng.choice([0.0, 0.2])),
            presence_penalty=float(rng.choice([0.0, 1.0])),
            repetition_penalty=float(rng.choice([1.0, 1.3])),
            logit_bias={int(rng.integers(3, 300)): 5.0} if i % 3 == 0 else None,
            logprobs=int(rng.choice([0, 3])) if i % 2 else None,
            stop=["e"] if i % 5 == 0 else None,
            seed=None if i % 4 else i,
            max_tokens=int(rng.integers(2, 16)),
            ignore_eos=True,
        )
        for i in range(15)
    ]
    prompts = random_prompts(rng, rng.integers(1, 40, size=15).tolist())
    batch = run(llm, prompts[:7] + [PROMPTS[1]] + prompts[7:], others[:7] + [target] + others[7:])
    assert batch[7].outputs[0].token_ids == alone
    # Also when it lands on other steps: arriving mid-decode, prompt split into 8-token chunks.
    eng = LLM(str(tiny[0]), max_num_batched_tokens=8, block_size=4).engine
    for i in range(4):
        eng.add_request(f"o{i}", prompts[i], others[i])
    eng.step()
    eng.step()
    eng.add_request("target", PROMPTS[1], target)
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert outs["target"].outputs[0].token_ids == alone


def test_n_and_best_of(tiny, llm):
    base = dict(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    one = run(llm, [PROMPTS[0]], SamplingParams(**base))[0]
    many = run(llm, [PROMPTS[0]], SamplingParams(n=4, prompt_logprobs=1, logprobs=0, **base))[0]
    assert [c.index for c in many.outputs] == [0, 1, 2, 3]
    assert many.outputs[0].token_ids == one.outputs[0].token_ids  # sample 0 keeps the request's seed
    assert len({tuple(c.token_ids) for c in many.outputs}) > 1
    assert len(many.prompt_logprobs) == len(PROMPTS[0])
    again = run(llm, [PROMPTS[0]], SamplingParams(n=4, **base))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in many.outputs]
    best = run(llm, [PROMPTS[0]], SamplingParams(n=2, best_of=4, **base))[0]
    ranked = sorted(many.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [(c.index, c.token_ids) for c in best.outputs] == [(c.index, c.token_ids) for c in ranked]


@torch.no_grad()
def penalized_greedy(
    model, prompt: list[int], n: int, repetition: float, frequency: float, presence: float
) -> list[int]:
    """Greedy decoding with transformers' repetition penalty and OpenAI's frequency/presence formula."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[:, -1].double()
        logits = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([ids]), logits)[0]
        counts = torch.bincount(torch.tensor(ids[len(prompt) :], dtype=torch.long), minlength=logits.numel())
        logits = logits - frequency * counts - presence * (counts > 0).double()
        ids.append(int(torch.argmax(logits)))
    return ids[len(prompt) :]


@pytest.mark.parametrize(
    "repetition, frequency, presence", [(1.8, 0.0, 0.0), (1.0, 1.5, 0.0), (1.0, 0.0, 2.0), (0.5, 0.7, -0.5)]
)
def test_penalties_match_reference_decoding(tiny, llm, repetition, frequency, presence):
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        ignore_eos=True,
        repetition_penalty=repetition,
        frequency_penalty=frequency,
        presence_penalty=presence,
    )
    outs = run(llm, PROMPTS, sp)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == penalized_greedy(
            tiny[1], prompt, 10, repetition, frequency, presence
        )


def test_min_tokens_masks_eos_until_reached(llm):
    force_eos = dict(temperature=0.0, max_tokens=10, logit_bias={EOS: 100.0})
    out = run(llm, [PROMPTS[0]], SamplingParams(min_tokens=4, **force_eos))[0].outputs[0]
    assert out.token_ids[-1] == EOS and EOS not in out.token_ids[:-1] and len(out.token_ids) == 5
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    out = run(llm, [PROMPTS[0]], SamplingParams(**force_eos))[0].outputs[0]
    assert out.token_ids == [EOS] and out.text == "" and out.finish_reason == "stop"
    # Stop ids are masked too; ignore_eos leaves EOS unmasked but not stopping.
    out = run(
        llm,
        [PROMPTS[0]],
        SamplingParams(
            temperature=0.0, max_tokens=10, min_tokens=3, logit_bias={77: 100.0}, stop_token_ids=[77]
        ),
    )[0].outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == 77 and out.stop_reason == 77
    out = run(llm, [PROMPTS[0]], SamplingParams(ignore_eos=True, **force_eos))[0].outputs[0]
    assert out.token_ids == [EOS] * 10 and out.finish_reason == "length"


def token_boundaries(llm, tokens: list[int]) -> list[int]:
    tok = llm.get_tokenizer()
    return [len(tok.decode(tokens[:i])) for i in range(len(tokens) + 1)]


def stream(llm, prompt, sp) -> tuple[list[str], object]:
    """Step the engine for one request, collecting the text deltas it reports."""
    eng = llm.engine
    eng.add_request("s", prompt, sp)
    deltas, last = [], None
    while eng.has_unfinished_requests():
        for o in eng.step():
            deltas.append(o.outputs[0].delta_text)
            assert "".join(deltas) == o.outputs[0].text
            last = o
    return deltas, last


def test_stop_strings_across_tokens_with_holdback(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    full = run(llm, [PROMPTS[2]], greedy)[0].outputs[0]
    text, ends = full.text, token_boundaries(llm, full.token_ids)
    assert ends[-1] == len(text)
    # A stop string starting inside one token and ending inside a later one, first found there.
    a, b = next(
        (a, b)
        for i in range(1, len(ends) - 2)
        for a in range(ends[i] + 1, ends[i + 1])
        for b in range(ends[i + 1] + 1, ends[i + 2])
        if text.find(text[a:b]) == a
    )
    stop = text[a:b]
    deltas, out = stream(llm, PROMPTS[2], SamplingParams(stop=["zzz-never", stop], **vars_of(greedy)))
    c = out.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (text[:a], "stop", stop)
    assert "".join(deltas) == text[:a]
    deltas, out = stream(
        llm, PROMPTS[2], SamplingParams(stop=[stop], include_stop_str_in_output=True, **vars_of(greedy))
    )
    assert out.outputs[0].text == text[:b] and "".join(deltas) == text[:b]
    # Held back: while the tail could start the stop string, it was not sent.
    deltas, out = stream(llm, PROMPTS[2], SamplingParams(stop=[text[a:] + "\x00"], **vars_of(greedy)))
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].text == text
    sent = np.cumsum([len(d) for d in deltas])
    assert all(s <= a for s in sent[:-1]) and sent[-1] == len(text)


def vars_of(sp: SamplingParams) -> dict:
    return dict(temperature=sp.temperature, max_tokens=sp.max_tokens, ignore_eos=sp.ignore_eos)


def test_stop_token_ids(llm):
    full = run(llm, [PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[
        0
    ]
    k = next(k for k in range(2, 12) if full.token_ids[k] not in full.token_ids[:k])
    stop_id = full.token_ids[k]
    ends = token_boundaries(llm, full.token_ids)
    for include, text in ((False, full.text[: ends[k]]), (True, full.text[: ends[k + 1]])):
        c = run(
            llm,
            [PROMPTS[1]],
            SamplingParams(
                temperature=0.0, max_tokens=12, stop_token_ids=[stop_id], include_stop_str_in_output=include
            ),
        )[0].outputs[0]
        assert c.token_ids == full.token_ids[: k + 1]
        assert (c.text, c.finish_reason, c.stop_reason) == (text, "stop", stop_id)


def test_output_ending_mid_character_ends_as_the_full_decode(llm):
    tok = llm.get_tokenizer()
    first_byte = tok.hf.convert_tokens_to_ids("ð")  # byte 0xF0 alone: an incomplete character
    out = run(
        llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=1, logit_bias={first_byte: 100.0})
    )
    c = out[0].outputs[0]
    assert c.token_ids == [first_byte] and c.text == tok.decode([first_byte]) == "\ufffd"


def test_special_tokens_in_text(llm):
    sp = dict(temperature=0.0, max_tokens=3, logit_bias={1: 100.0})  # 1 = <|im_start|>
    assert run(llm, [PROMPTS[0]], SamplingParams(**sp))[0].outputs[0].text == ""
    for spaces in (True, False):
        out = run(
            llm,
            [PROMPTS[0]],
            SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces, **sp),
        )[0]
        assert out.outputs[0].text == "<|im_start|>" * 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "n must be at least 1"),
        (dict(n=1.5), "n must be at least 1"),
        (dict(n=3, best_of=2), "best_of must be an integer >= n"),
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty=-3.0), r"frequency_penalty must be in \[-2, 2\]"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be in \(0, inf\)"),
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(temperature=float("nan")), "temperature must be >= 0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), "top_k must be 0 or -1"),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
        (dict(seed=2**64), r"seed must be None or an integer in \[-2\*\*63, 2\*\*63\)"),
        (dict(stop=[3]), "stop must be a list of non-empty strings"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must be non-negative integers"),
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(min_tokens=-1), "min_tokens must be at least 0"),
        (dict(min_tokens=20, max_tokens=10), r"min_tokens must be in \[0, max_tokens=10\]"),
        (dict(logprobs=21), r"logprobs must be None or an integer in \[0, 20\]"),
        (dict(prompt_logprobs=-1), r"prompt_logprobs must be None or an integer in \[0, 20\]"),
        (dict(logit_bias={5: 101}), r"logit_bias values must be in \[-100, 100\]"),
        (dict(logit_bias={"x": 1.0}), "logit_bias keys must be non-negative token ids"),
        (dict(ignore_eos="yes"), "ignore_eos must be a bool"),
    ],
)
def test_invalid_parameter_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_engine_rejects_out_of_vocab_ids_and_keeps_serving(tiny, llm):
    for sp in (SamplingParams(stop_token_ids=[384]), SamplingParams(logit_bias={"1000": 1.0})):
        with pytest.raises(
            ValueError, match=r"stop_token_ids and logit_bias keys must be token ids in \[0, 384\)"
        ):
            llm.generate([PROMPTS[0], PROMPTS[1]], sp, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = run(llm, [PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(tiny[1], PROMPTS[1], 6)[0]


def test_cumulative_logprob_only_when_logprobs_are_tracked(llm):
    """As in vLLM: a request that asks for no logprobs gets no cumulative logprob (its sampler step
    skips the full-vocabulary logsumexp); asking for them (or best_of > n) reports it, the same in
    any batch."""
    base = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain, with_lp, ranked = run(
        llm,
        [PROMPTS[0]] * 3,
        [SamplingParams(**base), SamplingParams(logprobs=0, **base), SamplingParams(n=1, best_of=2, **base)],
    )
    assert plain.outputs[0].cumulative_logprob is None
    lp = with_lp.outputs[0]
    assert lp.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for e, t in zip(lp.logprobs, lp.token_ids))
    )
    assert ranked.outputs[0].cumulative_logprob is not None
    assert plain.outputs[0].token_ids == lp.token_ids
