"""Tokenizer loading (GGUF and HF dir), chat templates, and incremental detokenization that
agrees with a full decode for multi-byte text under byte-level BPE and sentencepiece-style BPE."""

from __future__ import annotations

import copy
import random

import gguf
import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, normalizers, pre_tokenizers

from jaxpaged.gguf_tokenizer import build_tokenizer, wrap
from jaxpaged.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxpaged.weights.gguf_file import GGUFFile

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
stream_settings = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def stream(
    tokenizer: Tokenizer,
    prompt: list[int],
    output: list[int],
    chunks: list[int],
    skip_special_tokens: bool = True,
) -> IncrementalDetokenizer:
    """Feed `output` in chunks of the given sizes (cycled), checking after every step that the
    deltas add up to `text` and that `text` is the full decode wherever that is complete."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    done, deltas, i = 0, [], 0
    while done < len(output):
        n = chunks[i % len(chunks)]
        deltas.append(detok.step(output[done : done + n]))
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
    return full[len(prompt_text) :]


# ---------------------------------------------------------------- SmolLM2's GGUF tokenizer


def test_gguf_tokenizer_fields(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 49152)
    assert {0, 1, 2} <= tok.all_special_ids
    assert tok.hf.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


def test_gguf_tokenizer_vocab_is_the_files(smollm2_tokenizer, smollm2_gguf):
    """The tokenizer is the file's tokenizer.ggml.tokens (read here by gguf-py): same strings, same ids."""
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
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert ids.count(1) == 3 and ids.count(2) == 2  # role markers are single special tokens
    without = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert ids[: len(without)] == without and len(without) < len(ids)


# The reference: transformers' own GGUF conversion (it needs torch). It splits text with GPT-2's regex
# for a pre-tokenizer it does not know, such as SmolLM2's "smollm"; llama.cpp and SmolLM2's own
# tokenizer.json first isolate each digit, so the reference gets that tokenizer.json's pre-tokenizer.
SMOLLM2_PRE_TOKENIZER = pre_tokenizers.Sequence(
    [
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]
)

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n\tif x  >  1:\n        return [x, 1234567]\n\t\treturn None  \n",
    "I'm sure you're right, they'd've said we'll go; it's John's. I'M SHOUTING, DON'T",
    "1234567 and 3.14159, 2e10, -42, 1,000,000; 12:30 on 2026-11-27",
    "  1",
    "a  22\t\t333",
    "emoji 😀🙂👍🏽👨‍👩‍👧 and CJK 你好世界 東京 한국어 ありがとう",
    "accents: café naïve résumé Ünïcödé ĳ ß Æ",
    "line one\nline two\r\nline three\n\n\nend",
    "  leading spaces",
    "trailing spaces   ",
    "\t tab \t",
    " ",
    "",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <|im_end|>x",
    "<|im_start",
    "CamelCaseHTTPServer snake_case kebab-case path/to/file.py",
    "∑∂≠ €£ ¡¿ «»",
    "क्षत्रिय مرحبا",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And  10 * 10?"},
    ],
    [{"role": "user", "content": "Écris un haïku 🙂\n\ten code:"}, {"role": "assistant", "content": "Sure!"}],
]


@pytest.fixture(scope="module")
def hf_converted(smollm2_gguf) -> transformers.PreTrainedTokenizerBase:
    """transformers' GGUF conversion of SmolLM2's tokenizer, as it is."""
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(hf_converted) -> transformers.PreTrainedTokenizerBase:
    """transformers' GGUF conversion of SmolLM2's tokenizer, with SmolLM2's pre-tokenizer."""
    tokenizer = copy.deepcopy(hf_converted)
    tokenizer.backend_tokenizer.pre_tokenizer = SMOLLM2_PRE_TOKENIZER
    return tokenizer


def test_gguf_tokenizer_is_built_without_transformers_conversion(smollm2_gguf, monkeypatch):
    """The GGUF's tokenizer is built from its metadata by jaxpaged (no AutoTokenizer, no torch)."""
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda *a, **kw: pytest.fail("AutoTokenizer")
    )
    tok = Tokenizer.load(smollm2_gguf)
    assert tok.encode("Hello world!") == [19556, 905, 17]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_gguf_encode_matches_transformers(smollm2_tokenizer, hf_gguf_tokenizer, add_special_tokens):
    for text in TEXTS:
        ids = smollm2_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert ids == hf_gguf_tokenizer.encode(text, add_special_tokens=add_special_tokens), text


def test_gguf_splits_digits_as_smollm2_does(smollm2_tokenizer, hf_converted):
    """ "smollm" isolates each digit before GPT-2's regex (llama.cpp's rule, and SmolLM2's own
    tokenizer.json): "  1" is "ĠĠ" "1", where GPT-2's regex alone (transformers' GGUF conversion)
    gives "Ġ" "Ġ" "1". Runs of digits are single digits either way: the vocabulary has no longer ones."""
    tok = smollm2_tokenizer
    assert tok.encode("  1") == [256, 33] and tok.hf.convert_ids_to_tokens([256, 33]) == ["ĠĠ", "1"]
    assert tok.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]
    assert tok.encode("  multiple   spaces") == [216, 2701, 256, 5600]
    assert hf_converted.encode("  1") == [216, 216, 33]
    assert hf_converted.encode("Hello world! 1234567") == tok.encode("Hello world! 1234567")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_gguf_decode_matches_transformers(smollm2_tokenizer, hf_gguf_tokenizer, skip_special_tokens):
    """The encoded texts (which round-trip), and every token id alone."""
    tok, ref = smollm2_tokenizer, hf_gguf_tokenizer

    def reference(ids: list[int]) -> str:
        return ref.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    for text in TEXTS:
        ids = ref.encode(text)
        assert tok.decode(ids, skip_special_tokens) == reference(ids)
        assert skip_special_tokens or tok.decode(ids, skip_special_tokens) == text
    singles = [[i] for i in range(len(ref))]
    assert [tok.decode(ids, skip_special_tokens) for ids in singles] == [reference(ids) for ids in singles]
    assert tok.hf.batch_decode(singles, skip_special_tokens=skip_special_tokens) == ref.batch_decode(
        singles, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def test_gguf_special_tokens_match_transformers(smollm2_tokenizer, hf_gguf_tokenizer):
    tok, ref = smollm2_tokenizer.hf, hf_gguf_tokenizer
    for name in ("bos", "eos", "pad", "unk"):
        assert getattr(tok, f"{name}_token_id") == getattr(ref, f"{name}_token_id"), name
        assert getattr(tok, f"{name}_token") == getattr(ref, f"{name}_token"), name
    assert sorted(tok.all_special_ids) == sorted(ref.all_special_ids) == [0, 1, 2]
    assert len(tok) == len(ref) == smollm2_tokenizer.vocab_size == 49152
    assert tok.get_vocab() == ref.get_vocab()
    assert {i: (t.content, t.special) for i, t in tok.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in ref.added_tokens_decoder.items()
    }


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gguf_chat_template_matches_transformers(smollm2_tokenizer, hf_gguf_tokenizer, add_generation_prompt):
    assert smollm2_tokenizer.hf.chat_template == hf_gguf_tokenizer.chat_template
    for messages in CONVERSATIONS:
        ids = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert ids == list(
            hf_gguf_tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
            )
        )


# Random text: runs of mixed characters (digits, whitespace, contractions' letters), special tokens and
# other fragments in any order, or any Unicode text.
FRAGMENTS = st.one_of(
    st.text(alphabet=ALPHABET + "0123456789 \t\n\r'sdtmlrevIM", max_size=8),
    st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "  1", "'s", "\r\n"]),
)
ANY_TEXT = st.one_of(st.lists(FRAGMENTS, max_size=8).map("".join), st.text(max_size=30))


@settings(max_examples=300, deadline=None)
@given(text=ANY_TEXT)
def test_gguf_tokenizer_matches_transformers_on_any_text(smollm2_tokenizer, hf_gguf_tokenizer, text):
    ids = smollm2_tokenizer.encode(text)
    assert ids == hf_gguf_tokenizer.encode(text)
    single_bytes = {b[0] for b in smollm2_tokenizer.byte_table(False) if len(b) == 1}
    if set(text.encode()) <= single_bytes:  # 21 bytes (0xF1, 0xFF, ...) have no token and are dropped
        assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.fixture(scope="module")
def smollm2_fields(smollm2_gguf) -> dict:
    return GGUFFile(smollm2_gguf, string_arrays=("tokenizer.ggml.tokens", "tokenizer.ggml.merges")).fields


def test_gguf_pre_tokenizers_match_transformers(smollm2_fields, hf_gguf_tokenizer):
    """Every pre-tokenizer type transformers' GGUF conversion knows splits as its regex does (here
    over SmolLM2's vocabulary)."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    if not hasattr(mapping, "GGUF_PRE_TOKENIZER_SPLITS"):
        pytest.skip("this transformers release keeps no table of GGUF pre-tokenizers")
    splits = mapping.GGUF_PRE_TOKENIZER_SPLITS
    reference = copy.deepcopy(hf_gguf_tokenizer)
    for pre, split in splits.items():
        ours = wrap(build_tokenizer({**smollm2_fields, "tokenizer.ggml.pre": pre}), smollm2_fields)
        reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        assert [ours.encode(t) for t in TEXTS] == [reference.encode(t) for t in TEXTS], pre


def test_gguf_whole_tokens_keep_their_text(smollm2_fields):
    """Control and user-defined tokens are matched whole as their literal text, even outside the
    byte alphabet; only control ones are special (dropped by skip_special_tokens). A normal token
    outside the alphabet is its UTF-8, respelled."""
    tokens = smollm2_fields["tokenizer.ggml.tokens"] + ["<think>", "<｜end▁of▁sentence｜>", "→你"]
    fields = {
        **smollm2_fields,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": smollm2_fields["tokenizer.ggml.token_type"] + [4, 3, 1],
    }
    tok = Tokenizer(wrap(build_tokenizer(fields), fields))
    think, end, uni = 49152, 49153, 49154
    ids = tok.encode("a<think>b<｜end▁of▁sentence｜>")
    assert ids == [tok.encode("a")[0], think, tok.encode("b")[0], end]
    assert tok.decode(ids, skip_special_tokens=False) == "a<think>b<｜end▁of▁sentence｜>"
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>b"
    (spelled,) = tok.hf.convert_ids_to_tokens([uni])
    assert set(spelled) <= set(pre_tokenizers.ByteLevel.alphabet()) and tok.decode([uni]) == "→你"
    assert tok.hf.added_tokens_decoder[end].special and not tok.hf.added_tokens_decoder[think].special


@pytest.mark.parametrize(
    "fields, match",
    [
        ({}, "has no tokenizer"),
        (
            {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["[CLS]"]},
            "tokenizer.ggml.model 'bert'.*--tokenizer",
        ),
        (
            {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.tokens": ["a"],
                "tokenizer.ggml.pre": "new-model",
            },
            "tokenizer.ggml.pre = 'new-model'.*--tokenizer",
        ),
        ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]}, "tokenizer.ggml.scores"),
    ],
)
def test_gguf_tokenizer_rejects_what_it_cannot_build(fields, match):
    with pytest.raises(ValueError, match=match):
        build_tokenizer(fields)


# ---------------------------------------------------------------- a sentencepiece GGUF ("llama")

SP_PIECES = [
    "▁t",
    "he",
    "▁the",
    "▁H",
    "el",
    "lo",
    "ello",
    "▁Hello",
    "at",
    "▁c",
    "▁cat",
    "▁s",
    "▁sat",
    "▁▁",
    "▁▁▁▁",
    "ll",
    "▁thé",
    "▁a",
    "▁",
    "e",
    "t",
    "h",
    "a",
    "l",
    "o",
    "H",
    "c",
    "s",
    ",",
    "é",
]
SP_ALPHABET = "Hello the cat sat thé,, é ▁ 😀 ü \n\t" + "<s></s>"


def write_sentencepiece_gguf(path, **extra) -> None:
    """A tiny Llama-2-style GGUF: <unk> <s> </s>, 256 byte tokens, pieces scored in order, no merges."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [
        ("context_length", 64),
        ("embedding_length", 8),
        ("block_count", 1),
        ("feed_forward_length", 16),
        ("head_count", 2),
        ("head_count_kv", 2),
        ("layer_norm_rms_eps", 1e-5),
        ("rope_dimension_count", 4),
    ]:  # transformers wants a config
        getattr(writer, f"add_{add}")(value)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SP_PIECES]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SP_PIECES))
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(SP_PIECES))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{% for m in messages %}{{ bos_token + m['content'] + eos_token }}{% endfor %}")
    for add, value in extra.items():
        getattr(writer, f"add_{add}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def sp_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("sp_gguf") / "sp.gguf"
    write_sentencepiece_gguf(path)
    return path


@pytest.fixture(scope="module")
def sp_gguf_reference(sp_gguf) -> transformers.PreTrainedTokenizerBase:
    """transformers' conversion, with the normalizer of Llama 2's own tokenizer.json ("▁" prepended
    to each run of text and spaces as "▁"; its conversion prepends only at the start of the text
    and not to text that starts with a space: Metaspace's rule)."""
    reference = transformers.AutoTokenizer.from_pretrained(sp_gguf.parent, gguf_file=sp_gguf.name)
    reference.backend_tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    reference.backend_tokenizer.pre_tokenizer = None
    return reference


@pytest.fixture(scope="module")
def sp_gguf_tokenizer(sp_gguf) -> Tokenizer:
    return Tokenizer.load(sp_gguf)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=SP_ALPHABET, max_size=40))
def test_sentencepiece_gguf_matches_transformers(sp_gguf_tokenizer, sp_gguf_reference, text):
    tok = sp_gguf_tokenizer
    for add_special_tokens in (True, False):
        ids = tok.encode(text, add_special_tokens=add_special_tokens)
        assert ids == sp_gguf_reference.encode(text, add_special_tokens=add_special_tokens)
        for skip in (True, False):
            assert tok.decode(ids, skip) == sp_gguf_reference.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
            )
    if not any(s in text for s in ("<s>", "</s>", "▁")):
        assert tok.decode(tok.encode(text)) == text  # byte fallback: text round-trips ("▁" reads as " ")


def test_sentencepiece_gguf_rules(sp_gguf_tokenizer, sp_gguf_reference):
    """BOS by default, "▁" prepended to each run of text (also after a special token and before a
    leading space: "  Hello" is "▁▁▁Hello", as llama.cpp and sentencepiece have it, where
    transformers' conversion gives "▁▁Hello"), bytes for what no piece covers, the special tokens
    and chat template of the file."""
    tok = sp_gguf_tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.hf.unk_token_id, tok.vocab_size) == (
        1,
        2,
        0,
        259 + len(SP_PIECES),
    )
    assert tok.all_special_ids == {0, 1, 2}
    pieces = tok.hf.convert_ids_to_tokens(tok.encode("  Hello the cat"))
    assert pieces == ["<s>", "▁▁", "▁Hello", "▁the", "▁cat"]
    assert tok.hf.convert_ids_to_tokens(tok.encode("the</s>the", add_special_tokens=False)) == [
        "▁the",
        "</s>",
        "▁the",
    ]
    assert tok.hf.convert_ids_to_tokens(tok.encode("😀", add_special_tokens=False)) == [
        "▁",
        "<0xF0>",
        "<0x9F>",
        "<0x98>",
        "<0x80>",
    ]
    assert tok.decode(tok.encode("  Hello 😀")) == "  Hello 😀"
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "the cat"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == list(
        sp_gguf_reference.apply_chat_template(messages, tokenize=True, return_dict=False)
    )


def test_sentencepiece_gguf_flags(tmp_path):
    """add_space_prefix false: no "▁" prepended, none stripped when decoding; add_bos_token false,
    add_eos_token true."""
    path = tmp_path / "flags.gguf"
    write_sentencepiece_gguf(path, add_space_prefix=False, add_bos_token=False, add_eos_token=True)
    tok = Tokenizer.load(path)
    ids = tok.encode("Hello the cat")
    assert tok.hf.convert_ids_to_tokens(ids) == ["H", "ello", "▁the", "▁cat", "</s>"]
    assert tok.decode(ids) == "Hello the cat"


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
            output, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )


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
    assert len(lone_bytes) > 60  # continuation bytes and starts of 2-4 byte characters
    partial_chars = tok.encode("你好世界 ありがとう 😀🚀 한국어")
    rng = random.Random(99)
    for _ in range(150):
        pool = (
            [rng.randrange(tok.vocab_size) for _ in range(10)]
            + partial_chars
            + rng.sample(lone_bytes, 10)
            + [0, 1, 2, 3, tok.vocab_size + 5]
        )
        prompt = [rng.choice(pool[:-1]) for _ in range(rng.randrange(0, 8))]
        output = [rng.choice(pool) for _ in range(rng.randrange(0, 40))]
        chunk = rng.randrange(1, 4)
        runs = []
        for path in ("bytes", "rust"):
            if path == "rust":
                no_byte_table(monkeypatch)
            detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens)
            assert detok._bytes is not None if path == "bytes" else detok._stream is not None
            runs.append(
                [detok.step(output[i : i + chunk]) for i in range(0, len(output), chunk)] + [detok.flush()]
            )
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
