"""GPT-2 (``GPT2LMHeadModel``) on the generic decoder: learned positions (``wpe``), LayerNorm,
fused ``c_attn`` (q | k | v), GELU (tanh approximation, "gelu_new"), tied LM head. Its ``Conv1D``
weights are stored ``[in, out]``, like our kernels, so none is transposed."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from jaxpaged.models.decoder import DecoderConfig
from jaxpaged.models.hf_conversion import convert_hf, hf_layout, hf_prefix

_UNSUPPORTED = ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention")


def config_from_hf(hf: Any) -> DecoderConfig:
    set_options = [o for o in _UNSUPPORTED if getattr(hf, o, False)]
    if set_options:
        raise ValueError(f"GPT-2 options {set_options} are not supported (set them to False).")
    hidden, heads = hf.n_embd, hf.n_head
    return DecoderConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hidden,
        intermediate_size=getattr(hf, "n_inner", None) or 4 * hidden,
        num_layers=hf.n_layer,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=hf.n_positions,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        norm="layernorm",
        norm_eps=hf.layer_norm_epsilon,
        gated_mlp=False,
        activation=hf.activation_function,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        position="learned",
        attn_scale=None if getattr(hf, "scale_attn_weights", True) else 1.0,
    )


def params_from_hf(
    cfg: DecoderConfig,
    tensors: Mapping[str, np.ndarray],
    dtype: Any,
    quantized: Mapping[str, tuple] | None = None,
) -> dict:
    t = hf_prefix(tensors, "wte.weight", ("transformer.", ""))
    layout = hf_layout(
        cfg,
        embed=t + "wte",
        positions=t + "wpe",
        layer=t + "h.{}.",
        attn_norm="ln_1",
        mlp_norm="ln_2",
        qkv="attn.c_attn",
        o="attn.c_proj",
        up="mlp.c_fc",
        down="mlp.c_proj",
        final_norm=t + "ln_f",
        transpose=False,
    )
    return convert_hf(cfg, tensors, dtype, layout, quantized)
