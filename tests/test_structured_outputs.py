"""Structured outputs: the sampler's bitmask, constrained greedy tokens against an argmax over the
allowed tokens computed here from the regex, constraints on every sample, batch invariance of free
rows, seeds, preemption, prefix caching, multi-step and async scheduling, dead ends, invalid grammars,
and JSON schemas on SmolLM2."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest
import torch

from jaxpaged import LLM, SamplingParams, StructuredOutputsParams
from jaxpaged.sampler import SamplerFlags, SamplingTensors, sample
from jaxpaged.structured_outputs import GrammarCompiler, fill_bitmask
from test_sampling_engine import llm, run  # noqa: F401  (llm: the fixture; run checks no block leaked)
from tiny_models import random_prompts

_sample = jax.jit(sample, static_argnames="flags")
EOS = 2
HEX = "0123456789abcdef"
PROMPTS = random_prompts(np.random.default_rng(20), [5, 17, 9, 30])


def so(**kind) -> SamplingParams:
    """Greedy sampling under one constraint (``StructuredOutputsParams`` fields), 24 tokens at most."""
    return SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(**kind))


def samples(outs) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]


# ---- the sampler ---------------------------------------------------------------------------


def _tensors(R: int, temperature: float, allowed: np.ndarray) -> SamplingTensors:
    z, f = np.zeros(R, np.float32), np.ones(R, np.float32)
    return SamplingTensors(
        temperature=np.full(R, temperature, np.float32),
        top_k=np.zeros(R, np.int32),
        top_p=f,
        min_p=z,
        presence_penalty=z,
        frequency_penalty=z,
        repetition_penalty=f,
        seed_lo=np.arange(R, dtype=np.uint32),
        seed_hi=np.zeros(R, np.uint32),
        position=np.zeros(R, np.int32),
        penalty_rows=np.zeros(0, np.int32),
        penalty_tokens=np.zeros(0, np.int32),
        penalty_counts=np.zeros(0, np.float32),
        bias_rows=np.zeros(0, np.int32),
        bias_tokens=np.zeros(0, np.int32),
        bias_values=np.zeros(0, np.float32),
        allowed=allowed,
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_bitmask_is_the_logits_masked_to_minus_infinity(temperature):
    """Packed bits (token t: bit t % 32 of word t // 32) on a vocabulary that is not a multiple of 32:
    each row samples what its logits with -inf at the disallowed tokens sample; an all-ones row, and an
    all-zeros one (no token allowed: a dead end, whose token the grammar refuses), are left whole; the
    logprobs are the raw distribution's."""
    R, V = 6, 1000
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (R, V)).astype(np.float32)
    keep = rng.random((R, V)) < 0.05
    keep[0] = True
    keep[1] = False
    bits = np.zeros((R, 32 * -(-V // 32)), bool)
    bits[:, :V] = keep
    packed = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    flags = SamplerFlags(all_greedy=temperature == 0, chosen_logprobs=True)
    got = _sample(logits, _tensors(R, temperature, packed), SamplerFlags(**{**vars(flags), "bitmask": True}))
    whole = keep | ~keep.any(-1, keepdims=True)
    want = _sample(
        np.where(whole, logits, -np.inf).astype(np.float32),
        _tensors(R, temperature, np.zeros((0, 0), np.int32)),
        flags,
    )
    tokens = np.asarray(got.tokens)
    assert tokens.tolist() == np.asarray(want.tokens).tolist()
    assert all(keep[r, tokens[r]] for r in [0, *range(2, R)])
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(np.asarray(got.logprobs), logits[np.arange(R), tokens] - lse, atol=1e-4)


def test_fill_bitmask_packs_each_grammar_row_and_leaves_the_others_whole(llm):
    """A constrained row holds the tokens its matcher allows, the others every token, and no row a bit
    past the vocabulary (here cut to 300 of the tokenizer's 350 tokens, 12 bits into word 9)."""
    table = llm.engine.tokenizer.byte_table(False)
    m = llm.engine.grammars.matcher(StructuredOutputsParams(regex="[0-9]+"))
    mask = fill_bitmask([(m, 1)], 3, 300)
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little").astype(bool)
    assert mask.shape == (3, 10) and not bits[:, 300:].any()
    assert bits[[0, 2], :300].all()
    assert np.flatnonzero(bits[1]).tolist() == [t for t in range(300) if table[t] and table[t].isdigit()]


# ---- the engine on a tiny model ------------------------------------------------------------


def hex_allowed(tokens: list[bytes], text: bytes, most: int) -> np.ndarray:
    """The tokens regex ``[0-9a-f]{1,most}`` allows after ``text``, from the regex alone: a token
    of hex digits that keeps the text within ``most`` characters, or EOS once there is one."""
    ok = np.array(
        [bool(b) and all(c in HEX.encode() for c in b) and len(text) + len(b) <= most for b in tokens]
    )
    ok[EOS] = len(text) >= 1
    return ok


@torch.no_grad()
def test_constrained_greedy_is_the_argmax_over_allowed_tokens(llm, tiny):
    """Each token is the argmax of transformers' logits over the tokens the regex allows there
    (computed from the regex and each token's bytes); logprobs are the raw distribution's."""
    model = tiny[1]
    table = llm.engine.tokenizer.byte_table(False)
    vocab = model.config.vocab_size
    tokens = table + [b""] * (vocab - len(table))  # ids past the tokenizer's: no bytes, never allowed
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=14,
        logprobs=0,
        structured_outputs=StructuredOutputsParams(regex="[0-9a-f]{1,12}"),
    )
    outs = run(llm, PROMPTS, sp)
    checked = 0
    for prompt, out in zip(PROMPTS, outs):
        c = out.outputs[0]
        assert re.fullmatch("[0-9a-f]{1,12}", c.text) and c.finish_reason == "stop"
        for i, t in enumerate(c.token_ids):
            lp = torch.log_softmax(
                model(torch.tensor([prompt + c.token_ids[:i]])).logits[0, -1].double(), -1
            ).numpy()
            ok = hex_allowed(tokens, b"".join(tokens[u] for u in c.token_ids[:i]), 12)
            assert ok[t], (i, t)
            masked = np.where(ok, lp, -np.inf)
            best, second = np.sort(masked)[::-1][:2]
            if best - second > 1e-3:  # not a near-tie between float32 and float64
                assert t == int(np.argmax(masked)), (i, t)
                checked += 1
            assert c.logprobs[i][t].logprob == pytest.approx(lp[t], abs=1e-3)
    assert checked >= 10


def test_every_sample_holds_its_regex_or_choice(llm):
    """n = 8 random samples at temperature 1: each one matches, and the grammar (complete) ends it."""
    regex = "(cat|dog)s? [0-9]{2}"
    choices = ["red", "green", "blue fox", "a green fox"]
    kinds = [
        dict(regex=regex),
        dict(choice=choices),
        dict(grammar='start: "yes" | "no" | "it is " NUM\nNUM: /[0-9]+/'),
    ]
    params = [
        SamplingParams(
            n=8, temperature=1.0, seed=seed, max_tokens=20, structured_outputs=StructuredOutputsParams(**k)
        )
        for seed, k in enumerate(kinds, start=1)
    ]
    outs = run(llm, PROMPTS[:3], params)
    texts = [[c.text for c in o.outputs] for o in outs]
    assert all(re.fullmatch(regex, t) for t in texts[0])
    assert set(texts[1]) <= set(choices)
    assert all(t in ("yes", "no") or re.fullmatch("it is [0-9]+", t) for t in texts[2])
    assert all(c.finish_reason == "stop" for o in outs[:2] for c in o.outputs)
    assert any(len(set(t)) > 1 for t in texts)  # the samples draw their own tokens


def test_free_rows_are_batch_invariant_and_seeds_reproducible(llm):
    """Free rows (greedy, seeded, with logprobs) give the tokens they give alone when constrained rows
    share their steps; a seeded constrained request gives the same tokens alone and in the batch."""
    free = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True),
    ]
    constrained = SamplingParams(
        temperature=1.0,
        seed=11,
        max_tokens=16,
        structured_outputs=StructuredOutputsParams(regex="[a-z]{3,8}( [a-z]{2,8}){2}"),
    )
    alone = run(llm, PROMPTS[:2], free) + run(llm, PROMPTS[2:3], constrained)
    mixed = run(llm, PROMPTS[:3] + PROMPTS[3:], free + [constrained, so(choice=["up", "down"])])
    assert samples(mixed[:3]) == samples(alone)
    for a, b in zip(alone[0].outputs[0].logprobs, mixed[0].outputs[0].logprobs):
        assert {t: lp.logprob for t, lp in a.items()} == pytest.approx(
            {t: lp.logprob for t, lp in b.items()}, abs=1e-5
        )
    assert re.fullmatch("[a-z]{3,8}( [a-z]{2,8}){2}", mixed[2].outputs[0].text)


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(block_size=4, num_gpu_blocks_override=14, max_num_batched_tokens=16),  # preempts, recomputing
        dict(
            block_size=4,
            num_gpu_blocks_override=14,
            max_num_batched_tokens=16,
            preemption_mode="swap",
            swap_space=2**-10,
        ),
        dict(block_size=4, max_num_batched_tokens=16, num_scheduler_steps=4),  # multi-step, async
    ],
    ids=["recompute", "swap", "multi_step"],
)
def test_constrained_outputs_survive_preemption_and_multi_step(tiny, llm, engine_args):
    """Under preemption (the matcher follows the outputs, never the recomputation) and beside multi-step
    groups of free rows, every output equals the plain engine's."""
    prompts = random_prompts(np.random.default_rng(21), [13, 22, 9, 17, 26])
    params = [
        so(regex="[0-9a-f]{6,12}"),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        so(choice=["alpha beta gamma", "delta epsilon"]),
        so(regex="([a-z]+ ){3}[a-z]+"),
        SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True),
    ]
    want = run(llm, prompts, params)
    engine = LLM(str(tiny[0]), **engine_args)
    got = run(engine, prompts, params)
    assert samples(got) == samples(want)
    if "num_gpu_blocks_override" in engine_args:
        assert engine.engine.scheduler.num_preemptions > 0


def test_constrained_steps_run_one_at_a_time_and_synchronously(tiny):
    """With async scheduling and multi-step groups on, a step holding a constrained row is launched after
    the previous one is taken in, and holds one decode step."""
    from test_async_scheduling import _launch_order
    from jaxpaged import EngineArgs, LLMEngine

    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(tiny[0]), num_scheduler_steps=4, block_size=4, precompile=False)
    )
    events = _launch_order(engine)
    steps = []
    launch = engine.runner.launch
    engine.runner.launch = lambda out: (steps.append(out.num_steps), launch(out))[1]
    engine.add_request("c", [5, 6, 7], so(regex="[0-9a-f]{10}"))
    while engine.has_unfinished_requests():
        engine.step()
    assert set(steps) == {1} and events == ["launch", "collect"] * (len(events) // 2)


def test_prefix_cache_hit_and_stop_strings(tiny):
    """A constrained prompt found in the prefix cache gives the same output; a stop string inside the
    constrained text ends it as it would a free one."""
    llm = LLM(str(tiny[0]), block_size=4, enable_prefix_caching=True)
    prompt = random_prompts(np.random.default_rng(22), [23])
    sp = so(regex="([a-z]+ ){4}[a-z]+")
    first = run(llm, prompt, sp)
    second = run(llm, prompt, sp)
    assert llm.engine.kv_cache_manager.stats.hits > 0
    assert samples(second) == samples(first)
    text = first[0].outputs[0].text
    stop = text.split(" ")[2]
    cut = run(
        llm,
        prompt,
        SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], structured_outputs=sp.structured_outputs),
    )[0].outputs[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (text[: text.index(stop)], "stop", stop)


def test_a_dead_end_finishes_with_error(llm):
    """A grammar complete before min_tokens (it allows only EOS, which min_tokens holds back) ends its
    sample with finish reason "error", and the others go on; a refused token is a dead end."""
    dead = SamplingParams(
        temperature=0.0, max_tokens=10, min_tokens=5, structured_outputs=StructuredOutputsParams(regex="ab")
    )
    outs = run(llm, PROMPTS[:2], [dead, so(regex="[0-9]{4}")])
    assert (outs[0].outputs[0].text, outs[0].outputs[0].finish_reason) == ("ab", "error")
    assert re.fullmatch("[0-9]{4}", outs[1].outputs[0].text) and outs[1].outputs[0].finish_reason == "stop"
    m = llm.engine.grammars.matcher(StructuredOutputsParams(regex="ab"))
    m.accept(llm.engine.tokenizer.encode("x")[0])
    assert m.error and not m.complete


@pytest.mark.parametrize(
    "kind, message",
    [
        (dict(regex="[0-9"), "unclosed character class"),
        (dict(json={"type": "object", "properties": {"a": {"type": "foo"}}}), "foo"),
        (dict(json='{"type": "object", "properties": {'), "not valid JSON"),
        (dict(grammar="start: foo"), "unknown name"),
        (dict(choice=[]), "at least one"),
        (dict(choice="yes"), "list of strings"),
        (dict(regex="a", choice=["a"]), "exactly one"),
        (dict(), "exactly one"),
        (dict(json_object=False), "True"),
        (
            dict(
                structural_tag='{"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<g"]}'
            ),
            "trigger",
        ),
    ],
)
def test_invalid_grammars_raise_value_errors_naming_the_problem(llm, kind, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPTS[:1], so(**kind), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_params_validation_and_the_grammar_cache(llm):
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
    params = StructuredOutputsParams(json='{"type": "object",  "properties": {"b": {}, "a": {}}}')
    assert params.json == {"type": "object", "properties": {"b": {}, "a": {}}}
    same = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    reordered = StructuredOutputsParams(json={"type": "object", "properties": {"a": {}, "b": {}}})
    assert params.key == same.key != reordered.key  # the properties' order is the output's
    grammars: GrammarCompiler = llm.engine.grammars
    before = grammars._compiled.cache_info()
    for p in (params, same, reordered):
        grammars.matcher(p)
    after = grammars._compiled.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (2, 1)
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f"]}
    assert grammars.matcher(StructuredOutputsParams(structural_tag=json.dumps(tag))).error is None


# ---- JSON schemas on SmolLM2 ---------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "landmarks": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "minItems": 1,
            "maxItems": 3,
        },
        "capital": {"type": "boolean"},
    },
    "required": ["city", "country", "landmarks", "capital"],
    "additionalProperties": False,
}


def conforms(value, schema: dict) -> bool:
    """``value`` against the JSON schema keywords these tests use (``jsonschema`` is no dependency)."""
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int}
    if kind is not None and (
        not isinstance(value, types[kind]) or (kind == "integer" and isinstance(value, bool))
    ):
        return False
    if kind == "object":
        props = schema.get("properties", {})
        return (
            all(k in value for k in schema.get("required", []))
            and (schema.get("additionalProperties", True) or set(value) <= set(props))
            and all(conforms(v, props[k]) for k, v in value.items() if k in props)
        )
    if kind == "array":
        return schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)) and all(
            conforms(v, schema["items"]) for v in value
        )
    if kind == "string":
        return len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        return schema.get("minimum", value) <= value <= schema.get("maximum", value)
    return True


@pytest.mark.slow
def test_json_schemas_on_smollm2(smollm2_tokenizer):
    """Greedy SmolLM2 under two schemas (one with no whitespace between JSON tokens) and ``json_object``:
    each output is JSON that the schema validates, ended by its grammar."""
    llm = LLM("smollm2-135m-instruct", kv_cache_memory=64 << 20, precompile=False)
    questions = [
        ("Describe a famous scientist as JSON with name and age.", dict(json=PERSON)),
        ("Describe Paris as JSON.", dict(json=json.dumps(CITY), disable_any_whitespace=True)),
        ("Give a JSON object describing your favourite book.", dict(json_object=True)),
    ]
    prompts = [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q, _ in questions]
    params = [
        SamplingParams(temperature=0.0, max_tokens=160, structured_outputs=StructuredOutputsParams(**k))
        for _, k in questions
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    values = []
    for out, schema in zip(outs, [PERSON, CITY, {"type": "object"}]):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c
        values.append(json.loads(c.text))
        assert conforms(values[-1], schema), c.text
    assert outs[1].outputs[0].text == json.dumps(values[1], separators=(",", ":"), ensure_ascii=False)
