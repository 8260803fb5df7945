"""Hugging Face checkpoint -> the decoder's param tree: a family's layout of HF tensor names
(``hf_layout``, built of ``Source``) and the conversion that follows it (``convert_hf``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.models.decoder import DecoderConfig, layer_name
from jaxpaged.models.params import param_shapes


@dataclass(frozen=True)
class Source:
    """Where one of our params comes from: HF tensors concatenated along their output (last) axis
    after an optional transpose (torch ``nn.Linear`` is ``[out, in]``; our kernels and GPT-2's
    ``Conv1D`` are ``[in, out]``). Under ``layers`` the names hold ``{}`` for the layer index."""

    names: tuple[str, ...]
    transpose: bool = False


def linear(hf_names: str | list[str], *, bias: bool, transpose: bool = True) -> dict[str, Source]:
    """A dense layer's ``kernel`` (and ``bias``) from HF modules ``name.weight`` / ``name.bias``,
    several names fused along the output axis in the given order."""
    names = [hf_names] if isinstance(hf_names, str) else list(hf_names)
    out = {"kernel": Source(tuple(f"{n}.weight" for n in names), transpose)}
    if bias:
        out["bias"] = Source(tuple(f"{n}.bias" for n in names))
    return out


def norm(hf_name: str, cfg: DecoderConfig) -> dict[str, Source]:
    """A norm's ``weight`` (and LayerNorm's ``bias``) from HF module ``hf_name``."""
    out = {"weight": Source((f"{hf_name}.weight",))}
    if cfg.norm == "layernorm":
        out["bias"] = Source((f"{hf_name}.bias",))
    return out


def hf_layout(
    cfg: DecoderConfig,
    *,
    embed: str,
    layer: str,
    attn_norm: str,
    mlp_norm: str,
    qkv: str | list[str],
    o: str,
    up: str | list[str],
    down: str,
    final_norm: str | None = None,
    positions: str | None = None,
    project: tuple[str, str] | None = None,
    transpose: bool = True,
) -> dict:
    """The ``convert_hf`` layout of a family from its HF module names: ``layer`` is the prefix of
    layer ``{}``, to which the per-layer names are relative; ``qkv`` (and ``up`` for a gated MLP:
    [gate, up]) list the modules fused into one kernel. ``transpose`` False for ``Conv1D`` weights.
    The LM head (when not tied) is always the ``nn.Linear`` named ``lm_head``."""

    def dense(names: str | list[str], bias: bool) -> dict[str, Source]:
        names = [names] if isinstance(names, str) else names
        return linear([layer + n for n in names], bias=bias, transpose=transpose)

    layout = {
        "embed_tokens": {"embedding": Source((f"{embed}.weight",))},
        "layers": {
            "input_layernorm": norm(layer + attn_norm, cfg),
            "post_attention_layernorm": norm(layer + mlp_norm, cfg),
            "qkv_proj": dense(qkv, cfg.qkv_bias),
            "o_proj": dense(o, cfg.o_bias),
            "gate_up_proj" if cfg.gated_mlp else "up_proj": dense(up, cfg.mlp_bias),
            "down_proj": dense(down, cfg.mlp_bias),
        },
    }
    if positions is not None:
        layout["embed_positions"] = {"embedding": Source((f"{positions}.weight",))}
    if cfg.final_norm:
        layout["norm"] = norm(final_norm, cfg)
    if cfg.embed_dim != cfg.hidden_size:
        layout["project_in"] = linear(project[0], bias=False)
        layout["project_out"] = linear(project[1], bias=False)
    if not cfg.tie_word_embeddings:
        layout["lm_head"] = linear("lm_head", bias=False)
    return layout


def convert_hf(
    cfg: DecoderConfig,
    tensors: Mapping[str, np.ndarray],
    dtype: Any,
    layout: dict,
    quantized: Mapping[str, tuple] | None = None,
) -> dict:
    """Build the param tree from HF tensors following ``layout`` (our nested param names ->
    ``Source``; the ``layers`` entry describes every layer: it becomes ``layers_0`` ...), checking
    that every tensor is there and every shape matches the config.

    ``quantized``: HF name -> the tensor as affine blocks ``(codes, scale, offset)``, ``[out, in]``
    with blocks along ``in`` (a GGUF's). A kernel whose every source is there also gets them, fused
    and transposed like the kernel, as ``kernel_blocks`` beside it (a tied model: under ``lm_head``),
    for ``pack_for_matmul_backend``."""
    missing: list[str] = []

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            missing.append(name)
            return np.zeros(0, np.float32)
        return np.asarray(tensors[name], np.float32)

    def load(src: Source, layer: int | None) -> np.ndarray:
        arrs = [get(n if layer is None else n.format(layer)) for n in src.names]
        if missing:
            return np.zeros(0, np.float32)
        return np.concatenate([a.T if src.transpose else a for a in arrs], axis=-1)

    def build(node, layer: int | None):
        if isinstance(node, Source):
            return load(node, layer)
        return {k: build(v, layer) for k, v in node.items()}

    params = {k: build(v, None) for k, v in layout.items() if k != "layers"}
    params.update({layer_name(i): build(layout["layers"], i) for i in range(cfg.num_layers)})
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")
    expected = param_shapes(cfg, dtype)
    if jax.tree_util.tree_structure(params) != jax.tree_util.tree_structure(expected):
        raise ValueError(
            f"internal error: the weight mapping builds params {jax.tree_util.tree_structure(params)}"
            f", the model has {jax.tree_util.tree_structure(expected)}"
        )
    bad = [
        f"{jax.tree_util.keystr(k)}: checkpoint {a.shape}, model {e.shape}"
        for (k, a), e in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(expected))
        if a.shape != e.shape
    ]
    if bad:
        raise ValueError(f"checkpoint shapes do not match the config: {bad[:3]}")
    # Host arrays: the runner places them (into their shards under tensor parallelism).
    params = jax.tree_util.tree_map(lambda a: np.asarray(a, jnp.dtype(dtype)), params)
    if quantized:
        _attach_blocks(params, layout, quantized, cfg)
    return params


def _attach_blocks(params: dict, layout: dict, quantized: Mapping[str, tuple], cfg: DecoderConfig) -> None:
    """``convert_hf``'s ``kernel_blocks``: for each ``[out, in]`` kernel all of whose HF tensors are
    quantized, their blocks transposed to ``[in, out]`` and fused along ``out`` in the kernel's order."""

    def blocks(names: list[str]) -> tuple | None:
        if not all(n in quantized for n in names):
            return None
        return tuple(
            np.concatenate([np.asarray(quantized[n][f]).T for n in names], axis=-1) for f in range(3)
        )

    def walk(node: dict, into: dict, layer: int | None) -> None:
        for key, src in node.items():
            if isinstance(src, dict):
                walk(src, into[key], layer)
            elif key == "kernel" and src.transpose:
                found = blocks([n if layer is None else n.format(layer) for n in src.names])
                if found is not None:
                    into["kernel_blocks"] = found

    walk({k: v for k, v in layout.items() if k != "layers"}, params, None)
    for i in range(cfg.num_layers):
        walk(layout["layers"], params[layer_name(i)], i)
    if cfg.tie_word_embeddings:
        found = blocks(list(layout["embed_tokens"]["embedding"].names))
        if found is not None:
            params["lm_head"] = {"kernel_blocks": found}


def hf_prefix(tensors: Mapping[str, np.ndarray], probe: str, prefixes: tuple[str, ...]) -> str:
    """The first of ``prefixes`` under which the checkpoint holds ``probe`` (checkpoints saved from a
    base model lack the causal-LM wrapper's prefix); the first prefix if none does."""
    return next((p for p in prefixes if p + probe in tensors), prefixes[0])
