"""Loading a llama.cpp GGUF file into HF names and layout, dequantized to float32.

The model code then needs only HF names. Three things differ from an HF checkpoint and are
undone here: llama.cpp's tensor names, its reversed dimension order (handled by ``GGUFFile``,
whose shapes are already [out, in]) and the per-head row permutation convert_hf_to_gguf.py
applies to q/k so that llama.cpp can rotate adjacent pairs instead of HF's halves. Tensors are
dequantized (gguf-py's routines) on a thread per core: numpy releases the GIL. Tensors of the
affine block types (Q4_0, Q4_1, Q8_0) also come as their codes, scales and offsets
(``Checkpoint.quantized``), which rebuild the dequantized values exactly.
"""

from __future__ import annotations

import os
import pathlib
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import gguf
import numpy as np
import transformers

from jaxpaged.weights.gguf_file import GGUFFile, GGUFTensor
from jaxpaged.weights.resolve import AffineBlocks, Checkpoint

Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = (
    Q.F32,
    Q.F16,
    Q.BF16,
    Q.Q8_0,
    Q.Q4_0,
    Q.Q4_1,
    Q.Q5_0,
    Q.Q5_1,
    Q.Q4_K,
    Q.Q5_K,
    Q.Q6_K,
)
SUPPORTED_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_MISSING = object()


def hf_name(gguf_name: str) -> str:
    """llama.cpp tensor name -> HF LlamaForCausalLM parameter name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _BLOCK_NAMES:
        raise ValueError(
            f"unexpected tensor {gguf_name!r} in a llama GGUF; expected {sorted(_GLOBAL_NAMES)} "
            f"and blk.N.{{{','.join(_BLOCK_NAMES)}}}.weight."
        )
    return f"model.layers.{match[1]}.{_BLOCK_NAMES[match[2]]}.weight"


def affine_blocks(tensor: GGUFTensor) -> AffineBlocks | None:
    """A Q4_0 / Q4_1 / Q8_0 tensor's blocks as ``AffineBlocks`` (shape [out, in]); None for other
    types. Q4_0's ``d * (q - 8)`` and Q8_0's ``d * q`` (q signed) become offsets ``-8d`` / ``-128d``
    on unsigned codes; as code * d is exact in float32, so is the offset's addition."""
    block_bytes = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}.get(tensor.tensor_type)
    if block_bytes is None:
        return None
    out_dim, in_dim = tensor.shape
    blocks = np.asarray(tensor.data, np.uint8).reshape(out_dim, in_dim // 32, block_bytes)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if tensor.tensor_type == Q.Q8_0:
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        offset = scale * np.float32(-128)
    else:
        packed = blocks[..., 4:] if tensor.tensor_type == Q.Q4_1 else blocks[..., 2:]
        codes = np.concatenate([packed & 0xF, packed >> 4], axis=-1)  # low nibbles are the first 16
        offset = (
            blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            if tensor.tensor_type == Q.Q4_1
            else scale * np.float32(-8)
        )
    return AffineBlocks(codes.reshape(out_dim, in_dim), scale, offset)


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert convert_hf_to_gguf's q/k permutation: within each head, llama.cpp stores the
    rows as interleaved pairs (0, d/2, 1, d/2+1, ...); HF keeps the two halves contiguous."""
    head_dim = weight.shape[0] // num_heads
    halves = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2)
    return halves.reshape(weight.shape)


class _Metadata:
    """Typed access to GGUF key/values, with `{arch}` in gguf.Keys templates filled in."""

    def __init__(self, file: GGUFFile) -> None:
        self._fields, self._path, self.arch = file.fields, file.path, ""
        self.arch = self.get(gguf.Keys.General.ARCHITECTURE)

    def get(self, key: str, default: Any = _MISSING) -> Any:
        key = key.format(arch=self.arch)
        if key not in self._fields:
            if default is _MISSING:
                raise ValueError(f"{self._path}: GGUF metadata {key!r} is missing.")
            return default
        return self._fields[key]

    def get_int(self, key: str, default: Any = _MISSING) -> int | None:
        value = self.get(key, default)
        if value is not None and not isinstance(value, int):
            raise ValueError(
                f"{self._path}: GGUF metadata {key.format(arch=self.arch)!r} is {value!r}; "
                "expected one integer (per-layer values are not supported)."
            )
        return value


def _rope_parameters(meta: _Metadata) -> dict[str, Any]:
    params: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta.get(gguf.Keys.Rope.FREQ_BASE, 10000.0)),
    }
    scaling = meta.get(gguf.Keys.Rope.SCALING_TYPE, "none")
    if scaling == "linear":
        params.update(rope_type="linear", factor=float(meta.get(gguf.Keys.Rope.SCALING_FACTOR)))
    elif scaling != "none":
        raise ValueError(f"rope scaling {scaling!r} is not supported; supported: none, linear.")
    return params


def _llama_config(meta: _Metadata, vocab_rows: int, tied: bool) -> transformers.LlamaConfig:
    """Hyper-parameters from the `llama.*` keys, in HF's LlamaConfig."""
    hidden = meta.get_int(gguf.Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.get_int(gguf.Keys.Attention.HEAD_COUNT)
    tok = gguf.Keys.Tokenizer
    return transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=meta.get_int(gguf.Keys.LLM.VOCAB_SIZE, vocab_rows),
        hidden_size=hidden,
        intermediate_size=meta.get_int(gguf.Keys.LLM.FEED_FORWARD_LENGTH),
        num_hidden_layers=meta.get_int(gguf.Keys.LLM.BLOCK_COUNT),
        num_attention_heads=heads,
        num_key_value_heads=meta.get_int(gguf.Keys.Attention.HEAD_COUNT_KV, heads),
        head_dim=meta.get_int(gguf.Keys.Attention.KEY_LENGTH, hidden // heads),
        max_position_embeddings=meta.get_int(gguf.Keys.LLM.CONTEXT_LENGTH),
        rms_norm_eps=float(meta.get(gguf.Keys.Attention.LAYERNORM_RMS_EPS)),
        rope_parameters=_rope_parameters(meta),
        tie_word_embeddings=tied,
        bos_token_id=meta.get_int(tok.BOS_ID, None),
        eos_token_id=meta.get_int(tok.EOS_ID, None),
        pad_token_id=meta.get_int(tok.PAD_ID, None),
    )


def _expected_shapes(config: transformers.LlamaConfig) -> dict[str, tuple[int, ...]]:
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_rows, kv_rows = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    per_layer = {
        "input_layernorm": (hidden,),
        "self_attn.q_proj": (q_rows, hidden),
        "self_attn.k_proj": (kv_rows, hidden),
        "self_attn.v_proj": (kv_rows, hidden),
        "self_attn.o_proj": (hidden, q_rows),
        "post_attention_layernorm": (hidden,),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    for layer in range(config.num_hidden_layers):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{layer}.{name}.weight"] = shape
    return shapes


def _check_tensors(path: pathlib.Path, tensors: list[GGUFTensor], config: transformers.LlamaConfig) -> None:
    """Fail before dequantizing anything: unknown names, unsupported types, wrong or missing shapes."""
    expected = _expected_shapes(config)
    found = set()
    for tensor in tensors:
        name = hf_name(tensor.name)
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise ValueError(
                f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}; supported types "
                f"are {', '.join(t.name for t in SUPPORTED_TYPES)}."
            )
        shape = tensor.shape
        if expected.get(name) != shape:
            raise ValueError(
                f"{path}: tensor {tensor.name!r} has shape {shape}, but the metadata implies "
                f"{expected.get(name, 'no such tensor')} for {name}."
            )
        found.add(name)
    missing = sorted(set(expected) - found)
    if missing:
        raise ValueError(f"{path}: tensors missing from the GGUF: {missing[:5]} ({len(missing)} in all).")


def load_gguf(path: pathlib.Path) -> Checkpoint:
    """Read config and every tensor (dequantized to float32, HF names and layout) from a GGUF."""
    file = GGUFFile(path)
    meta = _Metadata(file)
    if meta.arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {meta.arch!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    by_name = {t.name: t for t in file.tensors}
    if "token_embd.weight" not in by_name:
        raise ValueError(f"{path}: the GGUF has no token_embd.weight tensor.")
    config = _llama_config(
        meta,
        vocab_rows=int(by_name["token_embd.weight"].shape[0]),
        tied="output.weight" not in by_name,
    )
    _check_tensors(path, file.tensors, config)

    def in_hf_order(tensor: GGUFTensor, array: np.ndarray) -> np.ndarray:
        if tensor.name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = config.num_attention_heads if ".attn_q." in tensor.name else config.num_key_value_heads
            return unpermute_rope_rows(array, heads)
        return array

    def dequantize(tensor: GGUFTensor) -> tuple[np.ndarray, AffineBlocks | None]:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if np.may_share_memory(array, tensor.data):  # F32 comes back as a view of the memory map
            array = array.copy()
        blocks = affine_blocks(tensor)
        if blocks is not None:
            blocks = AffineBlocks(*(in_hf_order(tensor, a) for a in blocks))
        return in_hf_order(tensor, array).astype(np.float32, copy=False), blocks

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        loaded = list(pool.map(dequantize, file.tensors))
    tensors = {hf_name(t.name): a for t, (a, _) in zip(file.tensors, loaded)}
    quantized = {hf_name(t.name): b for t, (_, b) in zip(file.tensors, loaded) if b is not None}
    return Checkpoint(config=config, tensors=tensors, path=path, format="gguf", quantized=quantized)
