"""Shared fixtures. SmolLM2 loads (ours and transformers') are session-scoped: each takes seconds."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
import torch
import transformers
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, processors

from jaxpaged.tokenizer import Tokenizer
from jaxpaged.weights import DEFAULT_MODEL_ALIAS, Checkpoint, load_checkpoint, resolve_model_path

sys.path.insert(0, str(pathlib.Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny_models import save_tiny_llama, save_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> pathlib.Path:
    """A byte-level BPE tokenizer with a chat template, for the tiny models."""
    path = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, tiny_tokenizer_dir):
    """``factory(name, **LlamaConfig overrides) -> (dir, HF model)``, each saved once per session."""
    cache = {}

    def make(name: str, **overrides):
        if name not in cache:
            path = tmp_path_factory.mktemp(f"model-{name}")
            cache[name] = path, save_tiny_llama(path, tiny_tokenizer_dir, **overrides)
        return cache[name]

    return make


@pytest.fixture(scope="session")
def smollm2_gguf() -> pathlib.Path:
    return resolve_model_path(DEFAULT_MODEL_ALIAS)


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Checkpoint:
    return load_checkpoint(DEFAULT_MODEL_ALIAS)


@pytest.fixture(scope="session")
def hf_smollm2_model(smollm2_gguf: pathlib.Path) -> transformers.PreTrainedModel:
    """transformers' own GGUF load of SmolLM2 (float32), the reference for weights and logits."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Tokenizer:
    return Tokenizer.load(DEFAULT_MODEL_ALIAS)


@pytest.fixture(scope="session")
def sentencepiece_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A Llama-2-style tokenizer (unigram over "▁"-joined text, byte fallback, BOS added) with a
    tiny vocabulary, so that most non-ASCII text goes through <0xNN> byte tokens."""
    specials = ["<unk>", "<s>", "</s>"]
    pieces = [(t, 0.0) for t in specials] + [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    pieces += [(c, -5.0) for c in "▁abcdefghijklmnopqrstuvwxyz,.!?éàH"]
    pieces += [(w, -3.0) for w in ["▁the", "▁cat", "▁Hello", "▁thé", "▁café", "ello", "at", "he", "▁a"]]
    tokenizer = RustTokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    tokenizer.add_special_tokens(specials)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp_path_factory.mktemp("sentencepiece_tokenizer")
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny(tiny_model_factory):
    """The default tiny model (GQA, untied embeddings): ``(dir, HF model)``."""
    return tiny_model_factory("gqa_untied")
