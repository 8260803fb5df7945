"""OPT (``OPTForCausalLM``) on the generic decoder: learned positions offset by 2, pre-LN or
post-LN (``do_layer_norm_before``), ReLU MLP, biases everywhere, optional ``project_in`` /
``project_out`` when ``word_embed_proj_dim != hidden_size``, tied LM head."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from jaxpaged.models.decoder import DecoderConfig
from jaxpaged.models.hf_conversion import convert_hf, hf_layout, hf_prefix

POSITION_OFFSET = 2  # HF's OPTLearnedPositionalEmbedding looks up position + 2


def config_from_hf(hf: Any) -> DecoderConfig:
    if not getattr(hf, "layer_norm_elementwise_affine", True):
        raise ValueError("OPT with layer_norm_elementwise_affine=False is not supported.")
    pre_norm = bool(hf.do_layer_norm_before)
    bias = bool(getattr(hf, "enable_bias", True))
    return DecoderConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.ffn_dim,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_attention_heads,
        head_dim=hf.hidden_size // hf.num_attention_heads,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        norm="layernorm",
        norm_eps=1e-5,  # torch.nn.LayerNorm's default; OPT does not set it
        pre_norm=pre_norm,
        final_norm=pre_norm and not getattr(hf, "_remove_final_layer_norm", False),
        gated_mlp=False,
        activation=hf.activation_function,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        position="learned",
        position_offset=POSITION_OFFSET,
        word_embed_dim=hf.word_embed_proj_dim or hf.hidden_size,
    )


def params_from_hf(
    cfg: DecoderConfig,
    tensors: Mapping[str, np.ndarray],
    dtype: Any,
    quantized: Mapping[str, tuple] | None = None,
) -> dict:
    d = hf_prefix(tensors, "embed_tokens.weight", ("model.decoder.", "decoder."))
    layout = hf_layout(
        cfg,
        embed=d + "embed_tokens",
        positions=d + "embed_positions",
        layer=d + "layers.{}.",
        attn_norm="self_attn_layer_norm",
        mlp_norm="final_layer_norm",
        qkv=[f"self_attn.{n}_proj" for n in "qkv"],
        o="self_attn.out_proj",
        up="fc1",
        down="fc2",
        final_norm=d + "final_layer_norm",
        project=(d + "project_in", d + "project_out"),
    )
    return convert_hf(cfg, tensors, dtype, layout, quantized)
