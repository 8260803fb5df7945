"""Llama-family decoder (Llama 1-3, SmolLM2, and relatives with q/k/v bias) in Flax linen.

The model sees a flat ragged batch of tokens and the global KV page array, never requests.
Layers are stacked and scanned (``nn.scan``) so a step compiles once per shape, not once
per layer; the page array rides in the scan carry and each layer scatters its new K/V
into it in place, addressed by the layer index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import AttentionMetadata, paged_attention, write_kv

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class LlamaArchConfig:
    """The hyper-parameters the forward pass needs, read once from an HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None = None   # hashable: the config is a static jit argument
    sliding_window: int | None = None

    @classmethod
    def from_hf(cls, hf: Any) -> "LlamaArchConfig":
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = float(rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}.")
        num_heads = hf.num_attention_heads
        if hf.hidden_act != "silu":
            raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported by the Llama model (needs 'silu').")
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            qkv_bias=bool(getattr(hf, "attention_bias", False)),
            o_bias=bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            rope_theta=theta,
            rope_scaling=None if rope_type == "default" else tuple(sorted(rope.items())),
            sliding_window=getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None,
        )


def rope_inv_freq(cfg: LlamaArchConfig) -> np.ndarray:
    """Inverse frequencies of rotary embeddings, with linear or Llama-3 scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    scaling = dict(cfg.rope_scaling or ())
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv / factor + smooth * inv
        inv = np.where(wavelen > old_len / low, inv / factor,
                       np.where(wavelen < old_len / high, inv, smoothed))
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF's rotate-half convention: ``x[T, H, D]`` rotated by per-token angles ``[T, D/2]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


class RMSNorm(nn.Module):
    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return w * x32.astype(self.dtype)


class DecoderLayer(nn.Module):
    """One pre-norm block; a scan step whose carry is ``(hidden, kv_pages, layer_index)``."""

    cfg: LlamaArchConfig
    dtype: Any
    attention_backend: str

    @nn.compact
    def __call__(self, carry, cos: jax.Array, sin: jax.Array, md: AttentionMetadata):
        h, kv_pages, layer = carry
        c = self.cfg
        T = h.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        x = RMSNorm(c.rms_norm_eps, self.dtype, name="input_layernorm")(h)
        qkv = nn.Dense(q_size + 2 * kv_size, use_bias=c.qkv_bias, dtype=self.dtype,
                       param_dtype=self.dtype, name="qkv_proj")(x)
        q = qkv[:, :q_size].reshape(T, c.num_heads, c.head_dim)
        k = qkv[:, q_size:q_size + kv_size].reshape(T, c.num_kv_heads, c.head_dim)
        v = qkv[:, q_size + kv_size:].reshape(T, c.num_kv_heads, c.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv_pages = write_kv(kv_pages, layer, k, v, md.slot_mapping)
        attn = paged_attention(q, kv_pages, layer, md, backend=self.attention_backend,
                               scale=c.head_dim ** -0.5, sliding_window=c.sliding_window)
        h = h + nn.Dense(c.hidden_size, use_bias=c.o_bias, dtype=self.dtype, param_dtype=self.dtype,
                         name="o_proj")(attn.reshape(T, q_size))
        x = RMSNorm(c.rms_norm_eps, self.dtype, name="post_attention_layernorm")(h)
        gate_up = nn.Dense(2 * c.intermediate_size, use_bias=c.mlp_bias, dtype=self.dtype,
                           param_dtype=self.dtype, name="gate_up_proj")(x)
        gate, up = gate_up[:, :c.intermediate_size], gate_up[:, c.intermediate_size:]
        h = h + nn.Dense(c.hidden_size, use_bias=c.mlp_bias, dtype=self.dtype, param_dtype=self.dtype,
                         name="down_proj")(nn.silu(gate) * up)
        return (h, kv_pages, layer + 1), None


class LlamaForCausalLM(nn.Module):
    """``(input_ids[T], positions[T], kv_pages, md, logits_indices[R]) -> (logits[R, V] f32, kv_pages)``."""

    cfg: LlamaArchConfig
    dtype: Any = jnp.float32
    attention_backend: str = "xla"

    @nn.compact
    def __call__(self, input_ids, positions, kv_pages, md: AttentionMetadata, logits_indices):
        c = self.cfg
        embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=self.dtype,
                         name="embed_tokens")
        h = embed(input_ids)
        angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(c))[None, :]
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        layers = nn.scan(DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                         in_axes=(nn.broadcast, nn.broadcast, nn.broadcast), length=c.num_layers)
        (h, kv_pages, _), _ = layers(c, self.dtype, self.attention_backend, name="layers")(
            (h, kv_pages, jnp.int32(0)), cos, sin, md)
        h = RMSNorm(c.rms_norm_eps, self.dtype, name="norm")(h[logits_indices])
        if c.tie_word_embeddings:
            logits = embed.attend(h)
        else:
            logits = nn.Dense(c.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                              name="lm_head")(h)
        return logits.astype(jnp.float32), kv_pages


def params_from_hf(cfg: LlamaArchConfig, tensors: Mapping[str, np.ndarray], dtype: Any) -> dict:
    """Map HF parameter names to this module's (stacked, fused) param tree, checking every shape."""
    missing = []

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            missing.append(name)
            return np.zeros(0, np.float32)
        return np.asarray(tensors[name], np.float32)

    def stack(fmt: str, transpose: bool) -> np.ndarray:
        arrs = [get(fmt.format(i)) for i in range(cfg.num_layers)]
        if missing:
            return np.zeros(0, np.float32)
        return np.stack([a.T if transpose else a for a in arrs])

    def cat_stack(fmts: list[str], transpose: bool) -> np.ndarray:
        parts = [stack(f, transpose) for f in fmts]
        return np.zeros(0, np.float32) if missing else np.concatenate(parts, axis=-1)

    p = "model.layers.{}."
    qkv = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
    layers = {
        "input_layernorm": {"weight": stack(p + "input_layernorm.weight", False)},
        "post_attention_layernorm": {"weight": stack(p + "post_attention_layernorm.weight", False)},
        "qkv_proj": {"kernel": cat_stack(qkv, True)},
        "o_proj": {"kernel": stack(p + "self_attn.o_proj.weight", True)},
        "gate_up_proj": {"kernel": cat_stack([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], True)},
        "down_proj": {"kernel": stack(p + "mlp.down_proj.weight", True)},
    }
    if cfg.qkv_bias:
        layers["qkv_proj"]["bias"] = cat_stack([p + f"self_attn.{n}_proj.bias" for n in "qkv"], False)
    if cfg.o_bias:
        layers["o_proj"]["bias"] = stack(p + "self_attn.o_proj.bias", False)
    if cfg.mlp_bias:
        layers["gate_up_proj"]["bias"] = cat_stack([p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"], False)
        layers["down_proj"]["bias"] = stack(p + "mlp.down_proj.bias", False)
    params = {
        "embed_tokens": {"embedding": get("model.embed_tokens.weight")},
        "norm": {"weight": get("model.norm.weight")},
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"kernel": get("lm_head.weight").T}
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")
    expected = jax.eval_shape(lambda: init_params(cfg, dtype))
    bad = [f"{jax.tree_util.keystr(k)}: checkpoint {a.shape}, model {e.shape}"
           for (k, a), e in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(expected))
           if a.shape != e.shape]
    if jax.tree_util.tree_structure(params) != jax.tree_util.tree_structure(expected) or bad:
        raise ValueError(f"checkpoint shapes do not match the config: {bad[:3]}")
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), params)


def init_params(cfg: LlamaArchConfig, dtype: Any) -> dict:
    """Random parameters of the right shapes (used for shape checks and benchmarks)."""
    model = LlamaForCausalLM(cfg, dtype)
    T, R, W = 1, 1, 1
    md = AttentionMetadata(
        slot_mapping=jnp.zeros(T, jnp.int32), block_tables=jnp.zeros((R, W), jnp.int32),
        seq_lens=jnp.ones(R, jnp.int32), query_start_loc=jnp.array([0, 1], jnp.int32),
        tile_row=jnp.zeros(0, jnp.int32), tile_start=jnp.zeros(0, jnp.int32), tile_len=jnp.zeros(0, jnp.int32))
    kv = jnp.zeros((cfg.num_layers, 2, 2, 1, cfg.num_kv_heads, cfg.head_dim), dtype)
    return model.init(jax.random.key(0), jnp.zeros(T, jnp.int32), jnp.zeros(T, jnp.int32), kv, md,
                      jnp.zeros(R, jnp.int32))["params"]
