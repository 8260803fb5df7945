"""The tokenizer a GGUF file describes, built with ``tokenizers`` from its metadata (llama.cpp's keys).

``tokenizer.ggml.model`` names the kind, and the rest follows llama.cpp's reading of the file:

- "gpt2": byte-level BPE. ``tokens`` are spelled in GPT-2's byte alphabet (a token with another
  character is taken as its UTF-8 and respelled), ``merges`` are "left right" pairs by rank, and
  text is first split by the regexes ``tokenizer.ggml.pre`` names (the splits of each model's own
  tokenizer.json), then byte-encoded. No BOS unless ``add_bos_token`` says so.
- "llama": sentencepiece's BPE: "▁" for a space (and one prepended to each run of text unless
  ``add_space_prefix`` is false), merges from the file or else by the merged token's ``scores``,
  text no token covers as its ``<0xNN>`` byte tokens. BOS unless ``add_bos_token`` is false.

``token_type`` (llama.cpp's): control tokens (3) and the unknown token (2) are special, user-defined
ones (4) are not; both kinds are matched whole in the text, as their literal text. The add-BOS/EOS
flags make the post-processor; the bos/eos/unknown/padding ids and ``tokenizer.chat_template`` go to
the transformers wrapper.
"""

from __future__ import annotations

import logging
import pathlib

import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from jaxpaged.weights.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # llama.cpp's token types (1 normal, 5 unused, 6 byte)
_STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"


def _cased_words(suffix: str) -> str:
    """Words split at case changes: a run of upper-case letters then one of lower-case ones (either
    may be empty, not both), after at most one other non-newline character, then ``suffix``."""
    upper, lower = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
    lead = r"[^\r\n\p{L}\p{N}]?"
    return f"{lead}{upper}*{lower}+{suffix}|{lead}{upper}+{lower}*{suffix}"


# The regexes of the models' own tokenizer.json files.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_TEKKEN = _cased_words("") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = (
    _cased_words(_CONTRACTIONS + "?") + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ``tokenizer.ggml.pre`` -> the regexes that split text, applied in turn (each splits the pieces the
# one before left), by llama.cpp's groups of names (llama-vocab.cpp). "default", which llama.cpp also
# takes for a file naming none, is GPT-2's here, as transformers reads such files (llama.cpp has a
# fallback of its own and warns that it degrades generation).
_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        [
            "default",
            "gpt-2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
            "gigachat",
            "a.x-4.0",
            "mellum",
            "jina-es",
            "jina-de",
            "jina-v2-es",
            "jina-v2-de",
        ],
        (_GPT2,),
    ),
    **dict.fromkeys(
        ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"], (r"\p{N}", _GPT2)
    ),
    **dict.fromkeys(
        [
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ],
        (_LLAMA3,),
    ),
    **dict.fromkeys(
        ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan"], (_QWEN2,)
    ),
    "qwen35": (_QWEN35,),
    "tekken": (_TEKKEN,),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], (_GPT4O,)),
}
# Pre-tokenizers after which a piece that is itself a token is that token, whatever its merges give.
_IGNORE_MERGES = {
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
    "tekken",
}

_SUPPORTED_MODELS = ("gpt2", "llama")


def load_gguf_tokenizer(path: str | pathlib.Path) -> transformers.PreTrainedTokenizerFast:
    """The tokenizer embedded in the GGUF at ``path``, as a transformers fast tokenizer."""
    fields = GGUFFile(path, string_arrays=_STRING_ARRAYS).fields
    return wrap(build_tokenizer(fields, str(path)), fields)


def build_tokenizer(fields: dict, source: str = "GGUF metadata") -> Tokenizer:
    """The ``tokenizers`` tokenizer the metadata ``fields`` describe (see the module's rules);
    ``source`` names the file in errors."""
    kind = fields.get("tokenizer.ggml.model")
    if kind not in _SUPPORTED_MODELS or not fields.get("tokenizer.ggml.tokens"):
        what = (
            "no tokenizer"
            if kind is None
            else f"tokenizer.ggml.model {kind!r}, which jaxpaged does not support"
        )
        raise ValueError(
            f"{source}: the GGUF has {what} (supported: {', '.join(_SUPPORTED_MODELS)}); give an HF "
            "tokenizer directory with `tokenizer` (--tokenizer) instead."
        )
    tokens = fields["tokenizer.ggml.tokens"]
    types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    whole = {i for i, t in enumerate(types) if t in (_UNKNOWN, _CONTROL, _USER_DEFINED)}
    tokenizer = (
        _byte_level(fields, tokens, whole, source) if kind == "gpt2" else _sentencepiece(fields, tokens)
    )
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i in sorted(whole)
            if types[i] != _USER_DEFINED
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i in sorted(whole)
            if types[i] == _USER_DEFINED
        ]
    )
    tokenizer.post_processor = _post_processor(fields, tokens, add_bos_default=kind == "llama")
    return tokenizer


def _byte_level(fields: dict, tokens: list[str], whole: set[int], source: str) -> Tokenizer:
    """Byte-level BPE: the vocabulary in the byte alphabet (tokens matched whole keep their text),
    split by the regexes of ``tokenizer.ggml.pre`` (GPT-2's when the file names none)."""
    pre = fields.get("tokenizer.ggml.pre")
    if pre is None:
        logger.warning(
            "%s: the GGUF names no pre-tokenizer (tokenizer.ggml.pre); splitting text as GPT-2 does.", source
        )
    splits = _SPLITS.get(pre or "default")
    if splits is None:
        raise ValueError(
            f"{source}: the GGUF's pre-tokenizer tokenizer.ggml.pre = {pre!r} is not one jaxpaged knows "
            f"(known: {', '.join(sorted(_SPLITS))}); give an HF tokenizer directory with `tokenizer` "
            "(--tokenizer) instead."
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {}
    for i, token in enumerate(tokens):
        if i not in whole and not alphabet.issuperset(token):
            token = byte_level.pre_tokenize_str(token)[0][0]
        vocab.setdefault(token, i)
    tokenizer = Tokenizer(
        models.BPE(vocab, _merges(fields), fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES)
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits] + [byte_level]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(fields: dict, tokens: list[str]) -> Tokenizer:
    """Sentencepiece's BPE over "▁"-for-space text, with ``<0xNN>`` byte tokens for the rest. Each run
    of text (the whole text, and what follows a token matched whole) gets a "▁" prepended, as in
    llama.cpp and Llama 2's own tokenizer.json, even one that starts with a space."""
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    merges = _merges(fields) or _merges_by_score(tokens, fields.get("tokenizer.ggml.scores"), vocab)
    unk = _special(fields, tokens, "unknown")
    tokenizer = Tokenizer(
        models.BPE(vocab, merges, unk_token=unk and unk[0], fuse_unk=True, byte_fallback=True)
    )
    space_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁")] * space_prefix + [normalizers.Replace(" ", "▁")]
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] * space_prefix)
    return tokenizer


def _merges(fields: dict) -> list[tuple[str, str]]:
    """The file's merges, each "left right" split at its first space after the first character."""
    return [
        (m[:i], m[i + 1 :]) for m in fields.get("tokenizer.ggml.merges") or () if (i := m.find(" ", 1)) > 0
    ]


def _merges_by_score(
    tokens: list[str], scores: list[float] | None, vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Sentencepiece's rule as BPE merges: every split of a token into two tokens is a merge, ranked by
    the whole token's score (highest first; ties by token id, then by where it splits)."""
    if scores is None:
        raise ValueError("a sentencepiece GGUF tokenizer with no merges needs tokenizer.ggml.scores.")
    ranked = sorted(
        (-scores[i], i, k, token[:k], token[k:])
        for i, token in enumerate(tokens)
        for k in range(1, len(token))
        if token[:k] in vocab and token[k:] in vocab
    )
    return [(left, right) for *_, left, right in ranked]


def _post_processor(fields: dict, tokens: list[str], add_bos_default: bool) -> processors.TemplateProcessing:
    """BOS before and EOS after each sequence, as ``add_bos_token`` / ``add_eos_token`` say (llama.cpp's
    default when the file does not: BOS for sentencepiece, else nothing)."""
    ends = {}
    for end, default in (("bos", add_bos_default), ("eos", False)):
        token = _special(fields, tokens, end)
        if token is not None and fields.get(f"tokenizer.ggml.add_{end}_token", default):
            ends[end] = token

    def template(sequence: str, type_id: int) -> list[str]:
        bos, eos = ([f"{ends[end][0]}:{type_id}"] if end in ends else [] for end in ("bos", "eos"))
        return bos + [f"${sequence}:{type_id}"] + eos

    return processors.TemplateProcessing(
        single=template("A", 0), pair=template("A", 0) + template("B", 1), special_tokens=list(ends.values())
    )


def _special(fields: dict, tokens: list[str], name: str) -> tuple[str, int] | None:
    """The special token ``tokenizer.ggml.{name}_token_id`` names (bos, eos, unknown, padding), if any."""
    token_id = fields.get(f"tokenizer.ggml.{name}_token_id")
    return None if token_id is None or not 0 <= token_id < len(tokens) else (tokens[token_id], token_id)


def wrap(tokenizer: Tokenizer, fields: dict) -> transformers.PreTrainedTokenizerFast:
    """``tokenizer`` as a transformers fast tokenizer with the file's special tokens and chat template."""
    tokens = fields["tokenizer.ggml.tokens"]
    named = {
        name: _special(fields, tokens, key)
        for name, key in (
            ("bos_token", "bos"),
            ("eos_token", "eos"),
            ("unk_token", "unknown"),
            ("pad_token", "padding"),
        )
    }
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        chat_template=fields.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        **{name: token[0] for name, token in named.items() if token},
    )
