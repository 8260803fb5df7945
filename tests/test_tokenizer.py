"""Tokenizer loading (GGUF and HF dir), chat templates, and incremental detokenization that
agrees with a full decode for multi-byte text under byte-level BPE and sentencepiece-style BPE."""

from __future__ import annotations

import random

import gguf
import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpaged.tokenizer import IncrementalDetokenizer, Tokenizer

# Hello, accents, CJK, emoji (some outside the BMP, some with ZWJ), and whitespace.
ALPHABET = "abcdefgh Hello thé cat,.!?\n\t éàöñçß ÆØ ĳ 你好世界東京 한국어 ありがとう ∑∂≠ 😀🙂🚀👍🏽👨‍👩‍👧 €£"
texts = st.text(alphabet=ALPHABET, min_size=0, max_size=40)
chunkings = st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=8)


def no_byte_table(monkeypatch):
    monkeypatch.setattr(Tokenizer, "byte_table", lambda self, skip_special_tokens: None)


def no_stream(monkeypatch):
    monkeypatch.setattr(Tokenizer, "decode_stream", lambda self, context, skip_special_tokens: None)


@pytest.fixture(params=["bytes", "rust", "python"])
def detok_path(request, monkeypatch):
    """Runs a test on the three implementations of the window rule: a byte-level tokenizer's byte
    table, tokenizers' DecodeStream (other fast tokenizers) and the Python one (slow tokenizers,
    or after the stream rejected a step). A tokenizer that is not byte-level has no "bytes" path."""
    if request.param != "bytes":
        no_byte_table(monkeypatch)
    if request.param == "python":
        no_stream(monkeypatch)
    return request.param


# The path fixture is function scoped but changes nothing between a test's examples.
stream_settings = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def stream(tokenizer: Tokenizer, prompt: list[int], output: list[int], chunks: list[int],
           skip_special_tokens: bool = True) -> IncrementalDetokenizer:
    """Feed `output` in chunks of the given sizes (cycled), checking after every step that the
    deltas add up to `text` and that `text` is the full decode wherever that is complete."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    done, deltas, i = 0, [], 0
    while done < len(output):
        n = chunks[i % len(chunks)]
        deltas.append(detok.step(output[done:done + n]))
        done, i = min(done + n, len(output)), i + 1
        assert "".join(deltas) == detok.text
        full = continuation(tokenizer, prompt, output[:done], skip_special_tokens)
        if full is not None:
            assert detok.text == full
    return detok


def continuation(tokenizer: Tokenizer, prompt: list[int], output: list[int], skip: bool) -> str | None:
    """The output as it reads after the prompt, from full decodes; None while it ends in a
    broken character. A prompt that ends in one gives no context (as in the detokenizer)."""
    prompt_text = tokenizer.decode(prompt, skip_special_tokens=skip)
    if prompt_text.endswith("\ufffd"):
        prompt, prompt_text = [], ""
    full = tokenizer.decode(prompt + output, skip_special_tokens=skip)
    if full.endswith("\ufffd"):
        return None
    assert full.startswith(prompt_text)
    return full[len(prompt_text):]


# ---------------------------------------------------------------- SmolLM2's GGUF tokenizer

def test_gguf_tokenizer_fields(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 49152)
    assert {0, 1, 2} <= tok.all_special_ids
    assert tok.hf.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


def test_gguf_tokenizer_vocab_is_the_files(smollm2_tokenizer, smollm2_gguf):
    """transformers rebuilt the tokenizer from tokenizer.ggml.tokens: same strings, same ids."""
    field = gguf.GGUFReader(smollm2_gguf).get_field("tokenizer.ggml.tokens")
    tokens = field.contents()
    assert len(tokens) == 49152
    assert smollm2_tokenizer.hf.convert_ids_to_tokens(list(range(len(tokens)))) == tokens


def test_gguf_tokenizer_encodes_without_bos(smollm2_tokenizer):
    """The GGUF says add_bos_token = false; pinned ids guard the pre-tokenizer and merges."""
    tok = smollm2_tokenizer
    ids = tok.encode("Hello world! héllo 你好 🙂")
    assert ids == [19556, 905, 17, 294, 2756, 31394, 216, 18645, 250, 48392, 138, 47526]
    assert tok.encode("Hello", add_special_tokens=False) == tok.encode("Hello") == [19556]
    assert tok.decode(ids) == "Hello world! héllo 你好 🙂"


def test_gguf_chat_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = tok.apply_chat_template(messages)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert ids.count(1) == 3 and ids.count(2) == 2  # role markers are single special tokens
    without = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert ids[:len(without)] == without and len(without) < len(ids)


def test_gguf_tokenizer_cached_copy_is_the_same_tokenizer(smollm2_gguf, smollm2_tokenizer, tmp_path, monkeypatch):
    """With a cache directory the GGUF's tokenizer is saved once as an HF tokenizer and later loaded
    from there (not rebuilt from the GGUF); it encodes, decodes and templates exactly as the GGUF's.
    A damaged copy is rebuilt."""
    built = Tokenizer.load(smollm2_gguf, cache_dir=str(tmp_path))
    (entry,) = tmp_path.iterdir()
    loads = []
    original = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **kw: loads.append(kw) or original(*a, **kw))
    cached = Tokenizer.load(smollm2_gguf, cache_dir=str(tmp_path))
    assert loads and all("gguf_file" not in kw for kw in loads)
    texts = ["Hello world! héllo 你好 🙂", "  two  spaces\n\ttab", "<|im_start|>user\nhi<|im_end|>", ""]
    messages = [{"role": "user", "content": "Write a haiku."}]
    ids = random.Random(0).choices(range(49152), k=300) + [0, 1, 2]
    for tok in (built, cached):
        assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 49152)
        assert tok.all_special_ids == smollm2_tokenizer.all_special_ids
        assert [tok.encode(t) for t in texts] == [smollm2_tokenizer.encode(t) for t in texts]
        assert tok.apply_chat_template(messages) == smollm2_tokenizer.apply_chat_template(messages)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
    (entry / "tokenizer.json").write_text("{")
    loads.clear()
    rebuilt = Tokenizer.load(smollm2_gguf, cache_dir=str(tmp_path))
    assert any("gguf_file" in kw for kw in loads)
    assert rebuilt.encode(texts[0]) == smollm2_tokenizer.encode(texts[0])
    assert [p.name for p in tmp_path.iterdir()] == [entry.name]      # no partial copies left behind


def test_load_rejects_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        Tokenizer.load(tmp_path / "missing")


def test_split_character_is_held_back(smollm2_tokenizer, detok_path):
    """你 and 好 are two byte-level tokens each: a first half alone must not be emitted."""
    tok = smollm2_tokenizer
    ids = tok.encode("你好")
    assert len(ids) == 4
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"))
    assert [detok.step([i]) for i in ids] == ["", "你", "", "好"]
    assert detok.text == "你好"


@stream_settings
@given(prompt=texts, output=texts, chunks=chunkings)
def test_incremental_equals_full_decode_byte_level(smollm2_tokenizer, detok_path, prompt, output, chunks):
    tok = smollm2_tokenizer
    prompt_ids, output_ids = tok.encode(prompt), tok.encode(output)
    detok = stream(tok, prompt_ids, output_ids, chunks)
    assert detok.text == tok.decode(output_ids) == output  # byte-level BPE round-trips exactly


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_random_ids_byte_level(smollm2_tokenizer, detok_path, skip_special_tokens):
    """Arbitrary ids: special tokens, stray UTF-8 continuation bytes, invalid sequences, prompts
    that end mid-character."""
    tok = smollm2_tokenizer
    rng = random.Random(1234)
    partial_chars = tok.encode("你好世界 ありがとう 😀🚀 한국어")  # many ids are parts of a character
    for _ in range(80):
        pool = [rng.randrange(tok.vocab_size) for _ in range(20)] + partial_chars + [0, 1, 2]
        prompt = [rng.choice(pool) for _ in range(rng.randrange(0, 8))]
        output = [rng.choice(pool) for _ in range(rng.randrange(0, 40))] + tok.encode(".")  # ends complete
        detok = stream(tok, prompt, output, [rng.randrange(1, 4)], skip_special_tokens)
        assert detok.text == tok.decode(output, skip_special_tokens=skip_special_tokens)
        # ``decode`` goes straight to the Rust decoder; transformers' own decode is the reference.
        assert tok.decode(output, skip_special_tokens) == tok.hf.decode(
            output, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def test_incremental_work_per_step_is_bounded(smollm2_tokenizer, monkeypatch):
    """Each step of the Python rule decodes a short window, never the whole output."""
    tok = smollm2_tokenizer
    no_byte_table(monkeypatch)
    no_stream(monkeypatch)
    output = tok.encode("The quick brown fox jumps over the lazy dog, 你好 😀. " * 60)
    window_lengths: list[int] = []
    decode = tok.decode

    def spy(token_ids: list[int], skip_special_tokens: bool = True) -> str:
        window_lengths.append(len(token_ids))
        return decode(token_ids, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", spy)
    detok = IncrementalDetokenizer(tok, tok.encode("Start"))
    for token in output:
        detok.step([token])
    monkeypatch.undo()
    assert detok.text == tok.decode(output)
    assert len(output) > 800 and max(window_lengths) <= 12


@pytest.mark.parametrize("path", ["bytes", "rust"])
def test_fast_tokenizer_steps_without_python_decodes(smollm2_tokenizer, monkeypatch, path):
    """With a fast tokenizer no step decodes in Python: the byte table (byte-level BPE), else
    DecodeStream, does the work; the byte table calls no decoder at all."""
    tok = smollm2_tokenizer
    if path == "rust":
        no_byte_table(monkeypatch)
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"))
    assert (detok._bytes is not None) == (path == "bytes")
    calls = []
    monkeypatch.setattr(tok, "decode", lambda *args, **kwargs: calls.append(args))
    if path == "bytes":
        monkeypatch.setattr(tok, "backend", None)
    output = tok.encode("Hello, 你好 😀 world.")
    text = "".join(detok.step([t]) for t in output)
    monkeypatch.undo()
    assert calls == [] and text == detok.text == tok.decode(output)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_table_emits_what_decode_stream_does(smollm2_tokenizer, monkeypatch, skip_special_tokens):
    """Step for step the byte table emits the deltas tokenizers' DecodeStream emits, on arbitrary
    ids: lone and stray UTF-8 bytes, characters split over tokens, special tokens, ids past the
    vocabulary (which decode to nothing)."""
    tok = smollm2_tokenizer
    table = tok.byte_table(skip_special_tokens)
    assert table is not None and len(table) == tok.vocab_size
    lone_bytes = [i for i, b in enumerate(tok.byte_table(False)) if len(b) == 1 and b[0] >= 0x80]
    assert len(lone_bytes) > 60                     # continuation bytes and starts of 2-4 byte characters
    partial_chars = tok.encode("你好世界 ありがとう 😀🚀 한국어")
    rng = random.Random(99)
    for _ in range(150):
        pool = ([rng.randrange(tok.vocab_size) for _ in range(10)] + partial_chars + rng.sample(lone_bytes, 10)
                + [0, 1, 2, 3, tok.vocab_size + 5])
        prompt = [rng.choice(pool[:-1]) for _ in range(rng.randrange(0, 8))]
        output = [rng.choice(pool) for _ in range(rng.randrange(0, 40))]
        chunk = rng.randrange(1, 4)
        runs = []
        for path in ("bytes", "rust"):
            if path == "rust":
                no_byte_table(monkeypatch)
            detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens)
            assert detok._bytes is not None if path == "bytes" else detok._stream is not None
            runs.append([detok.step(output[i:i + chunk]) for i in range(0, len(output), chunk)] + [detok.flush()])
            monkeypatch.undo()
        assert runs[0] == runs[1], (prompt, output)
        assert "".join(runs[0]) == tok.decode(output, skip_special_tokens=skip_special_tokens)


def test_byte_table_covers_ids_past_the_vocabulary_size():
    """A vocabulary with holes: its largest id (7) is past len(tokenizer) (4) and still decodes;
    a lone UTF-8 lead byte's token (0xC3, spelled "Ã") is held, then flushed as U+FFFD."""
    from tokenizers import Tokenizer as RawTokenizer, decoders, models

    raw = RawTokenizer(models.BPE(vocab={"a": 0, "b": 1, "Ã": 3, "Ġc": 7}, merges=[]))
    raw.decoder = decoders.ByteLevel()
    tok = Tokenizer(transformers.PreTrainedTokenizerFast(tokenizer_object=raw))
    assert tok.vocab_size == 4 and tok.byte_table(False)[7] == b" c" and tok.byte_table(False)[3] == b"\xc3"
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.step([t]) for t in (0, 7, 3)] == ["a", " c", ""] and detok.flush() == "\ufffd"
    assert detok.text == raw.decode([0, 7, 3]) == "a c\ufffd"


def test_byte_table_only_for_byte_level_tokenizers(sp_tokenizer):
    """A sentencepiece-style decoder (metaspace, byte fallback) is not a concatenation of bytes."""
    assert sp_tokenizer.byte_table(True) is None and sp_tokenizer.byte_table(False) is None
    assert IncrementalDetokenizer(sp_tokenizer, [])._stream is not None


def test_stream_that_fails_mid_output_hands_over_to_python(smollm2_tokenizer, monkeypatch):
    """A stream that rejects a step (tokenizers raises when a decode rewrites the window's text)
    is dropped and the Python rule goes on from the same window: the text is unchanged."""
    tok = smollm2_tokenizer
    no_byte_table(monkeypatch)
    output = tok.encode("Hello, 你好世界 😀🚀 and more text.")
    for fail_at in range(len(output)):
        detok = IncrementalDetokenizer(tok, tok.encode("Say:"))
        steps = 0
        real = detok._stream

        class Failing:
            def step(self, backend, ids):
                nonlocal steps
                steps += 1
                if steps > fail_at:
                    raise Exception("invalid prefix")  # noqa: TRY002 -- what tokenizers raises
                return real.step(backend, ids)

        detok._stream = Failing()
        for t in output:
            detok.step([t])
        detok.flush()
        assert detok.text == tok.decode(output), fail_at
        assert detok._stream is None


# ---------------------------------------------------------------- sentencepiece-style tokenizer

@pytest.fixture(scope="module")
def sp_tokenizer(sentencepiece_tokenizer_dir) -> Tokenizer:
    return Tokenizer.load(sentencepiece_tokenizer_dir)


def test_sentencepiece_tokenizer_uses_byte_fallback(sp_tokenizer):
    ids = sp_tokenizer.encode("the 😀")
    assert ids[0] == sp_tokenizer.bos_token_id == 1
    assert sum(t.startswith("<0x") for t in sp_tokenizer.hf.convert_ids_to_tokens(ids)) == 4
    assert sp_tokenizer.decode(ids) == "the 😀"


def test_no_chat_template_is_a_clear_error(sp_tokenizer):
    with pytest.raises(ValueError, match="no chat template"):
        sp_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


@stream_settings
@given(prompt=texts, output=texts, chunks=chunkings)
def test_incremental_equals_full_decode_sentencepiece(sp_tokenizer, detok_path, prompt, output, chunks):
    tok = sp_tokenizer
    output_ids = tok.encode(output, add_special_tokens=False)
    # With a prompt, the first output token keeps its leading space as in decode(prompt + output).
    stream(tok, tok.encode(prompt), output_ids, chunks)
    # Without one, the text is exactly decode(output_ids).
    detok = stream(tok, [], output_ids, chunks)
    assert detok.text == tok.decode(output_ids)


def test_flush_emits_an_unfinished_character_like_a_full_decode(smollm2_tokenizer, detok_path):
    """An output that ends mid-character: the held-back text (including the complete character
    before the split one) comes out at the end, as the full decode has it."""
    tok = smollm2_tokenizer
    rng = random.Random(7)
    partial = tok.encode("你好世界 😀")
    for _ in range(40):
        output = tok.encode("ab") + [rng.choice(partial) for _ in range(rng.randrange(1, 6))]
        detok = IncrementalDetokenizer(tok, tok.encode("Say:"))
        for t in output:
            detok.step([t])
        detok.flush()
        assert detok.text == tok.decode(output)
