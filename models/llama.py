"""The Llama family on the generic decoder: Llama 1-3 / SmolLM2, Mistral (sliding-window
attention) and Qwen2 (q/k/v bias): HF config readers and the HF weight mapping."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from jaxpaged.models.decoder import SUPPORTED_ROPE_TYPES, DecoderConfig, DecoderForCausalLM
from jaxpaged.models.hf_conversion import convert_hf, hf_layout
from jaxpaged.models.params import init_params

LlamaForCausalLM = DecoderForCausalLM
__all__ = [
    "LlamaArchConfig",
    "LlamaForCausalLM",
    "config_from_hf",
    "init_params",
    "mistral_config_from_hf",
    "params_from_hf",
    "qwen2_config_from_hf",
]


def LlamaArchConfig(*, rms_norm_eps: float, **fields: Any) -> DecoderConfig:  # noqa: N802 (kept for callers)
    """A Llama ``DecoderConfig`` from the old ``LlamaArchConfig`` field names (``rms_norm_eps``)."""
    return DecoderConfig(norm_eps=rms_norm_eps, **fields)


def _sliding_window(hf: Any) -> int | None:
    """The one window every layer uses, from ``sliding_window``, ``use_sliding_window`` and the
    per-layer ``layer_types`` (Qwen2 derives them from ``max_window_layers``)."""
    window = getattr(hf, "sliding_window", None)
    if window is None or not getattr(hf, "use_sliding_window", True):
        return None
    kinds = set(getattr(hf, "layer_types", None) or ["sliding_attention"])
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return int(window)
    raise ValueError(
        f"per-layer attention types {list(hf.layer_types)} (e.g. Qwen2's max_window_layers="
        f"{getattr(hf, 'max_window_layers', None)} with {hf.num_hidden_layers} layers) mix sliding-"
        "window and full attention, which is not supported: every layer must use the same window."
    )


def config_from_hf(hf: Any) -> DecoderConfig:
    """Llama-style HF config (``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``) -> ``DecoderConfig``."""
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = float(rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}.")
    if hf.hidden_act != "silu":
        raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported by the Llama model (needs 'silu').")
    num_heads = hf.num_attention_heads
    return DecoderConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        norm="rmsnorm",
        norm_eps=hf.rms_norm_eps,
        qkv_bias=bool(getattr(hf, "attention_bias", False)),
        o_bias=bool(getattr(hf, "attention_bias", False)),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        rope_theta=theta,
        rope_scaling=None if rope_type == "default" else tuple(sorted(rope.items())),
        sliding_window=_sliding_window(hf),
    )


mistral_config_from_hf = config_from_hf
"""Mistral is Llama with a sliding window (``MistralConfig.sliding_window``, None for none)."""


def qwen2_config_from_hf(hf: Any) -> DecoderConfig:
    """Qwen2 is Llama with biases on q, k and v (always; not on o) and an optional window."""
    return dataclasses.replace(config_from_hf(hf), qkv_bias=True, o_bias=False)


def params_from_hf(
    cfg: DecoderConfig,
    tensors: Mapping[str, np.ndarray],
    dtype: Any,
    quantized: Mapping[str, tuple] | None = None,
) -> dict:
    """Map HF parameter names to the (per-layer, fused) param tree, checking every shape."""
    layout = hf_layout(
        cfg,
        embed="model.embed_tokens",
        layer="model.layers.{}.",
        attn_norm="input_layernorm",
        mlp_norm="post_attention_layernorm",
        qkv=[f"self_attn.{n}_proj" for n in "qkv"],
        o="self_attn.o_proj",
        up=["mlp.gate_proj", "mlp.up_proj"],
        down="mlp.down_proj",
        final_norm="model.norm",
    )
    return convert_hf(cfg, tensors, dtype, layout, quantized)
