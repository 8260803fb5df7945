"""The decoder's param tree as the model runs it: stacked over the layers (``stack_layers`` for
``scan_layers``, ``pack_for_matmul_backend`` for the native CPU matmul), its shapes and random init."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels import AttentionMetadata, cpu_matmul
from jaxpaged.models.decoder import DecoderConfig, DecoderForCausalLM, layer_name


def stack_layers(params: dict, cfg: DecoderConfig) -> dict:
    """The param tree of ``scan_layers``: the per-layer params (``layers_{i}``) stacked into ``layers``,
    each leaf ``[L, ...]`` (host numpy, once at load)."""
    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    out["layers"] = jax.tree_util.tree_map(
        lambda *leaves: np.stack([np.asarray(a) for a in leaves]),
        *[params[layer_name(i)] for i in range(cfg.num_layers)],
    )
    return out


def runs_quantized(backend: str) -> bool:
    """Whether kernels with ``kernel_blocks`` run as quantized weights: on the native CPU matmul
    (in float32 and bfloat16), not on XLA's dot."""
    return backend == "cpu"


def pack_for_matmul_backend(params: dict, cfg: DecoderConfig, dtype: Any, backend: str) -> dict:
    """The param tree the model runs with on ``backend``: as stored for ``xla``; for ``cpu`` every
    dense kernel packed for the native matmul (host numpy, once), plus a tied model's ``lm_head``
    (its embedding, transposed, packed), and the layers' params stacked (``layers``, each leaf
    ``[L, ...]``, see the module doc). Where ``runs_quantized``, a kernel that came with
    ``kernel_blocks`` (``convert_hf``) is the native matmul's quantized weight instead (bit-identical
    results, a fifth of the bytes), if every layer's kernel of its kind is (in one code width);
    otherwise that kind is dense in every layer. ``kernel_blocks`` never stay in the tree."""
    blocks, plain = {}, {}

    def split(node: dict, out: dict, path: tuple) -> None:
        for key, value in node.items():
            if key == "kernel_blocks":
                blocks[path] = value
            elif isinstance(value, dict):
                split(value, out.setdefault(key, {}), path + (key,))
            else:
                out[key] = value

    split(params, plain, ())
    if backend == "xla":
        return plain
    if cfg.tie_word_embeddings:
        plain["lm_head"] = {"kernel": np.asarray(plain["embed_tokens"]["embedding"]).T}
    quantize = runs_quantized(backend)

    def pack(path, a, quantized=True):
        if path[-1].key != "kernel":
            return a
        module = tuple(p.key for p in path[:-1])
        if quantize and quantized and module in blocks:
            return cpu_matmul.pack_quantized(*blocks[module])
        return cpu_matmul.pack_weight(np.asarray(a), dtype)

    packed = jax.tree_util.tree_map_with_path(pack, plain)
    names = [layer_name(i) for i in range(cfg.num_layers)]
    layers = [packed.pop(name) for name in names]

    def stack(path, *leaves):
        if any(a.shape != leaves[0].shape or a.dtype != leaves[0].dtype for a in leaves):
            leaves = [
                pack(
                    (jax.tree_util.DictKey(name), *path),
                    functools.reduce(lambda node, key: node[key.key], path, plain[name]),
                    quantized=False,
                )
                for name in names
            ]
        return np.stack(leaves)

    packed["layers"] = jax.tree_util.tree_map_with_path(stack, *layers)
    return packed


def param_shapes(cfg: DecoderConfig, dtype: Any) -> dict:
    """The param tree's shapes and dtypes (``jax.ShapeDtypeStruct`` leaves), traced on a one-layer
    model: every layer is alike, and tracing all of them took a second for SmolLM2."""
    one = jax.eval_shape(lambda: init_params(dataclasses.replace(cfg, num_layers=1), dtype))
    layer = one.pop(layer_name(0))
    return {**one, **{layer_name(i): layer for i in range(cfg.num_layers)}}


def init_params(cfg: DecoderConfig, dtype: Any) -> dict:
    """Random parameters of the right shapes (used for shape checks and benchmarks)."""
    model = DecoderForCausalLM(cfg, dtype)
    T, R, W = 1, 1, 1
    md = AttentionMetadata(
        slot_mapping=jnp.zeros(T, jnp.int32),
        block_tables=jnp.zeros((R, W), jnp.int32),
        seq_lens=jnp.ones(R, jnp.int32),
        query_start_loc=jnp.array([0, 1], jnp.int32),
        tile_row=jnp.zeros(0, jnp.int32),
        tile_start=jnp.zeros(0, jnp.int32),
        tile_len=jnp.zeros(0, jnp.int32),
    )
    kv = jnp.zeros((cfg.num_layers, 2, 2, 1, cfg.num_kv_heads, cfg.head_dim), dtype)
    return model.init(
        jax.random.key(0), jnp.zeros(T, jnp.int32), jnp.zeros(T, jnp.int32), kv, md, jnp.zeros(R, jnp.int32)
    )["params"]
