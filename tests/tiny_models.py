"""Tiny random Hugging Face models and the HF reference decoding the engine is checked against."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer as RawTokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paged attention splits the KV cache into fixed-size blocks, like pages of virtual memory.",
    "naïve café — 東京 😀 emoji, Ünïcödé and ∑ maths",
    "def f(x):\n    return x * 2\n",
] * 20
VOCAB = 384


def save_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a fixed corpus (deterministic, no download)."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=350,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return tok


def save_tiny_model(
    path: Path, tokenizer_dir: Path, config: PretrainedConfig, seed: int = 0
) -> PreTrainedModel:
    """Save a random tiny model of any causal-LM ``config`` (its ``architectures`` set), with its
    tokenizer, to ``path``. Biases get non-zero values, embeddings and the LM head a wide spread
    (sharper logits: fewer near-ties in greedy decoding), LayerNorm weights non-unit values."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    embeddings = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    layer_norms = {name for name, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            module = name.rpartition(".")[0]
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif module in embeddings or module == "lm_head":
                p.normal_(0.0, 1.0)
            elif module in layer_norms:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    for f in os.listdir(tokenizer_dir):
        (path / f).write_bytes((tokenizer_dir / f).read_bytes())
    return model


def save_tiny_llama(path: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> PreTrainedModel:
    """Save a random tiny Llama (with its tokenizer) to ``path`` (see ``save_tiny_model``)."""
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kw.update(overrides)
    cfg = LlamaConfig(**kw)
    cfg.architectures = ["LlamaForCausalLM"]
    return save_tiny_model(path, tokenizer_dir, cfg, seed)


@torch.no_grad()
def hf_greedy(
    model, prompt_ids: list[int], max_new_tokens: int
) -> tuple[list[int], list[float], list[float]]:
    """Greedy decoding with HF's model: (tokens, chosen logprobs, top1 - top2 margins)."""
    ids = torch.tensor([prompt_ids])
    out = model(ids, use_cache=True)
    past = out.past_key_values
    tokens, logprobs, margins = [], [], []
    logits = out.logits[0, -1]
    for _ in range(max_new_tokens):
        lp = torch.log_softmax(logits.double(), -1)
        top2 = torch.topk(lp, 2).values
        t = int(torch.argmax(lp))
        tokens.append(t)
        logprobs.append(float(lp[t]))
        margins.append(float(top2[0] - top2[1]))
        out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
    return tokens, logprobs, margins


def random_prompts(rng: np.random.Generator, lengths: list[int], vocab: int = 350) -> list[list[int]]:
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]
