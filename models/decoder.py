"""One generic decoder-only transformer in Flax linen, shared by every model family.

Llama, Mistral, Qwen2, OPT and GPT-2 differ only in choices a frozen ``DecoderConfig`` names
(RMSNorm or LayerNorm, pre- or post-norm, gated-SiLU or plain MLP, rotary or learned positions,
biases, tied head); each family's module (``llama.py``, ``opt.py``, ``gpt2.py``) only reads its
HF config into one and maps its HF tensor names onto this param tree
(``hf_conversion.convert_hf``).

The model sees a flat ragged batch of tokens and the global KV page array, never requests.
Layers are unrolled, each with its own parameter arrays (``layers_0`` ... ``layers_{L-1}``): on
CPU a scan over stacked weights made XLA copy every layer's weight slice each step, which cost
half of a small-batch decode step (and so would a static slice per layer). ``scan_layers`` (off unless
asked for: meant for GPUs and TPUs, whose compile time grows with the unrolled depth) runs layers 1..L-1 as
one ``lax.scan`` over params stacked by ``params.stack_layers`` instead. With the native CPU
matmul (``matmul_backend="cpu"``) every kind of layer weight is instead one array stacked over the
layers (``layers`` below, each leaf ``[L, ...]``), which the native kernels read at the layer's
offset in place (``params.pack_for_matmul_backend`` stacks them): a step's jitted call then takes
SmolLM2's parameters as 9 arrays instead of 183, and each array argument costs the host time at every call.
Each layer scatters its new K/V into the page array
``[L, 2, num_blocks, block_size, Hkv, D]`` in place (``write_kv``), addressed by its (static)
layer index, then attends through ``paged_attention`` (every backend).

Param tree (the same names mean the same thing in every family; tensor-parallel rules key on them):
``embed_tokens.embedding [V, E]``, optional ``embed_positions.embedding`` (learned positions),
``project_in`` / ``project_out`` (E != hidden), and per layer ``i`` under ``layers_{i}``:
``input_layernorm``, ``post_attention_layernorm`` (``weight``, plus ``bias`` for LayerNorm),
``qkv_proj`` (output columns [q heads | k heads | v heads]), ``o_proj``, ``gate_up_proj``
([gate | up]) or ``up_proj``, ``down_proj``; then an optional final ``norm``, and ``lm_head``
unless tied. Kernels are ``[in, out]``.

A float32 model's dots ask for full float32 precision (``matmul_precision``): a GPU's default
rounds float32 inputs to TF32, and greedy tokens would then drift from a float32 reference.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels import AttentionMetadata, cpu_matmul
from jaxpaged.kernels.cpu_layer_ops import (
    NATIVE_DTYPES,
    cpu_rms_norm,
    cpu_rope_qkv,
    cpu_silu_and_mul,
    native_layer_ops_available,
)
from jaxpaged.kernels.kv_ops import take_rows
from jaxpaged.kernels.precision import matmul_precision
from jaxpaged.kernels.sharded import paged_attention, split_fused, write_kv
from jaxpaged.math_utils import cdiv

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rope", "learned")
ACTIVATIONS = {
    "silu": nn.silu,
    "swish": nn.silu,
    "relu": nn.relu,
    "gelu": functools.partial(nn.gelu, approximate=False),
    "gelu_new": functools.partial(nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(nn.gelu, approximate=True),
}


@dataclass(frozen=True)
class DecoderConfig:
    """The hyper-parameters the forward pass needs (hashable: a static jit argument)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    norm_eps: float = 1e-5
    pre_norm: bool = True  # False: OPT's post-LN (norm after each residual add)
    final_norm: bool = True  # a norm before the LM head
    gated_mlp: bool = True  # act(gate) * up (Llama) or act(up) (OPT, GPT-2)
    activation: str = "silu"  # a key of ACTIVATIONS
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    position: str = "rope"  # "rope" | "learned" (embedding of position + offset)
    position_offset: int = 0  # OPT's learned positions start at index 2
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    sliding_window: int | None = None  # keys with position > q_pos - window (HF's semantics)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    word_embed_dim: int | None = None  # OPT's word_embed_proj_dim; None: hidden_size

    def __post_init__(self):
        if self.norm not in NORMS:
            raise ValueError(f"norm {self.norm!r} is not supported; supported: {NORMS}.")
        if self.position not in POSITIONS:
            raise ValueError(
                f"position embedding {self.position!r} is not supported; supported: {POSITIONS}."
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation {self.activation!r} is not supported; supported: {sorted(ACTIVATIONS)}."
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}.")

    @property
    def embed_dim(self) -> int:
        return self.word_embed_dim or self.hidden_size


def rope_inv_freq(cfg: DecoderConfig) -> np.ndarray:
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
        inv = np.where(
            wavelen > old_len / low, inv / factor, np.where(wavelen < old_len / high, inv, smoothed)
        )
    return inv.astype(np.float32)


def activate(name: str, x: jax.Array) -> jax.Array:
    """``ACTIVATIONS[name]`` of ``x`` computed in float32 and rounded once to ``x``'s dtype, as torch's
    kernels compute 16-bit inputs; jnp's composite in bfloat16 rounds after each of its operations
    (its SiLU agreed with torch's bfloat16 SiLU on 61% of inputs)."""
    return ACTIVATIONS[name](x.astype(jnp.float32)).astype(x.dtype)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """The step's rotary tables ``(C, S)``, each ``[T, 1, 2, D/2]``: ``C`` holds ``(cos, cos)`` and ``S``
    ``(-sin, sin)`` of each token's angles, for ``apply_rope``. Computed once per step: behind an
    optimization barrier, so XLA does not fuse the cosines and sines into every layer's rotation and
    evaluate them there again for every head."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    tables = jnp.stack([cos, cos], axis=1)[:, None], jnp.stack([-sin, sin], axis=1)[:, None]
    return jax.lax.optimization_barrier(tuple(t.astype(dtype) for t in tables))


def apply_rope(x: jax.Array, C: jax.Array, S: jax.Array) -> jax.Array:
    """HF's rotate-half convention on ``x[T, H, D]`` with ``rope_tables``: viewing each head as two
    halves ``(x1, x2)``, the result is ``(x1 cos - x2 sin, x2 cos + x1 sin)`` = ``x * C + swap(x) * S``,
    where ``swap`` reverses the halves. Written so, XLA's CPU fusion ran 5-7x faster than stacking or
    concatenating the two rotated halves (which took 5% of a SmolLM2 workload's time). The native CPU
    kernels do this (and the q/k/v split) in ``cpu_rope_qkv``."""
    T, H, D = x.shape
    halves = x.reshape(T, H, 2, D // 2)
    return (halves * C + halves[:, :, ::-1] * S).reshape(T, H, D)


def layer_name(i: int) -> str:
    """The param-tree key (and module name) of layer ``i``."""
    return f"layers_{i}"


class Embed(nn.Module):
    """An embedding table ``[num_embeddings, features]``: ``__call__`` looks rows up (a 16-bit
    table through an integer view: no float32 copy of the table on CPU), ``attend`` is ``h @ table.T``."""

    num_embeddings: int
    features: int
    dtype: Any

    def setup(self) -> None:
        self.embedding = self.param(
            "embedding", nn.linear.default_embed_init, (self.num_embeddings, self.features), self.dtype
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        return take_rows(self.embedding, ids)

    def attend(self, h: jax.Array) -> jax.Array:
        return jnp.dot(h, self.embedding.T, precision=matmul_precision(self.dtype))


class Linear(nn.Module):
    """A dense layer ``x @ kernel (+ bias)``. With the ``cpu`` matmul backend its kernel is the
    native CPU matmul's packed weight (``pack_for_matmul_backend`` packs a ``[in, out]`` kernel once,
    at load), or its quantized weight (uint8); otherwise the ``[in, out]`` kernel goes through XLA's dot. ``out_dtype`` (default
    ``dtype``) float32 keeps a bfloat16 layer's float32 accumulation (the LM head's logits).
    ``num_rows`` (an int32 scalar) counts the leading rows of ``x`` that are real tokens: the native
    matmul computes only those (the rest come out zero); XLA's dot computes every row.
    ``num_layers`` > 0: the params stack every layer's along a leading axis and a call computes
    layer ``layer`` (the native matmul reads its kernel in place)."""

    features: int
    use_bias: bool
    dtype: Any
    backend: str = "xla"
    out_dtype: Any = None
    num_layers: int = 0

    @nn.compact
    def __call__(
        self, x: jax.Array, num_rows: jax.Array | None = None, layer: int | None = None
    ) -> jax.Array:
        k = x.shape[-1]
        stack = (self.num_layers,) if self.num_layers else ()
        if self.backend == "cpu":
            kernel = self.get_variable("params", "kernel")
            if (
                kernel is None or kernel.dtype != jnp.uint8
            ):  # else a quantized weight (cpu_matmul.pack_quantized)
                shape = (cdiv(self.features, cpu_matmul.PANEL), k, cpu_matmul.PANEL)
                kernel = self.param("kernel", nn.initializers.zeros, stack + shape, self.dtype)
            y = cpu_matmul.matmul(x.reshape(-1, k), kernel, self.features, self.out_dtype, num_rows, layer)
            y = y.reshape(*x.shape[:-1], self.features)
        else:
            kernel = self.param(
                "kernel", nn.initializers.lecun_normal(), stack + (k, self.features), self.dtype
            )
            y = jnp.dot(
                x,
                _layer_of(kernel, layer),
                precision=matmul_precision(self.dtype),
                preferred_element_type=self.out_dtype,
            )
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, stack + (self.features,), self.dtype)
            y = y + _layer_of(bias, layer).astype(y.dtype)
        return y


def _layer_of(param: jax.Array, layer: int | None) -> jax.Array:
    """A layer's slice of a param stacked over the layers (``layer`` None: ``param`` is one layer's)."""
    return param if layer is None else param[layer]


class Norm(nn.Module):
    """RMSNorm (``weight``) or LayerNorm (``weight``, ``bias``), statistics in float32.

    With ``residual`` the norm is of ``x + residual`` and returns ``(x + residual, normed)``, as
    vLLM's ``RMSNorm(x, residual)``: with ``native`` (the native CPU kernels, one device) a float32 or
    bfloat16 RMSNorm is then one C++ pass (``cpu_rms_norm``) instead of XLA's add, reduction and
    scaling fusions; rows from ``num_rows`` on (padding) may come out zero. ``num_layers`` and
    ``layer``: as ``Linear``'s (the native kernel reads a stacked weight in place)."""

    kind: str
    eps: float
    dtype: Any
    native: bool = False
    num_layers: int = 0

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        residual: jax.Array | None = None,
        num_rows: jax.Array | None = None,
        layer: int | None = None,
    ):
        d = x.shape[-1]
        stack = (self.num_layers,) if self.num_layers else ()
        w = self.param("weight", nn.initializers.ones, stack + (d,), self.dtype)
        if (
            self.native
            and self.kind == "rmsnorm"
            and x.ndim == 2
            and x.dtype == w.dtype
            and x.dtype in NATIVE_DTYPES
        ):
            return cpu_rms_norm(x, w, self.eps, residual, num_rows, layer)
        w = _layer_of(w, layer)
        if residual is not None:
            x = x + residual
        x32 = x.astype(jnp.float32)
        if self.kind == "layernorm":
            x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        y = w * x32.astype(self.dtype)
        if self.kind == "layernorm":
            y = y + _layer_of(self.param("bias", nn.initializers.zeros, stack + (d,), self.dtype), layer)
        return y if residual is None else (x, y)


def native_layer_ops(attention_backend: str, mesh: Any) -> bool:
    """Whether the layers' elementwise ops (rotary embedding, RMSNorm, SiLU(gate) * up) go to
    the native CPU kernels: with the native attention kernels, on one device (a sharded model keeps
    XLA's ops), where they were built."""
    return attention_backend == "cpu" and mesh is None and native_layer_ops_available()


class DecoderLayer(nn.Module):
    """One attention + MLP block for layer ``layer`` of the pages: ``(h, delta, kv_pages) -> (h, delta,
    kv_pages)``, the residual stream being ``h + delta`` (``delta`` None: ``h``). A pre-norm layer leaves
    its last residual add to the next norm, which fuses it (``Norm(x, residual)``). With ``num_layers``
    > 0 one instance holds every layer's params, stacked, and each call runs layer ``layer``."""

    cfg: DecoderConfig
    dtype: Any
    attention_backend: str
    mesh: Any = None  # tensor parallelism: heads split over the mesh's "tp" axis (jaxpaged.parallel)
    matmul_backend: str = "xla"
    num_layers: int = 0

    @nn.compact
    def __call__(
        self,
        h: jax.Array,
        delta: jax.Array | None,
        kv_pages: jax.Array,
        rope: tuple[jax.Array, jax.Array] | None,
        md: AttentionMetadata,
        layer: int,
    ):
        c = self.cfg
        T = h.shape[0]
        num_rows = md.num_real_tokens
        native = native_layer_ops(self.attention_backend, self.mesh)
        # The params' layer: ours when they are stacked, else they are this layer's own.
        pick = layer if self.num_layers else None
        dense = functools.partial(
            Linear, dtype=self.dtype, backend=self.matmul_backend, num_layers=self.num_layers
        )
        norm = functools.partial(Norm, c.norm, c.norm_eps, self.dtype, native, self.num_layers)
        attn_norm = functools.partial(norm(name="input_layernorm"), layer=pick)
        mlp_norm = functools.partial(norm(name="post_attention_layernorm"), layer=pick)
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

        if not c.pre_norm:
            x = h
        elif delta is None:
            x = attn_norm(h, num_rows=num_rows)
        else:
            h, x = attn_norm(h, delta, num_rows)
        qkv = dense(q_size + 2 * kv_size, use_bias=c.qkv_bias, name="qkv_proj")(x, num_rows, pick)
        if native and rope is not None and qkv.ndim == 2 and qkv.dtype in NATIVE_DTYPES:
            q, k, v = cpu_rope_qkv(qkv, *rope, c.num_heads, c.num_kv_heads, num_rows)
        else:
            q, k, v = split_fused(qkv, (q_size, kv_size, kv_size), self.mesh)
            q = q.reshape(T, c.num_heads, c.head_dim)
            k, v = k.reshape(T, c.num_kv_heads, c.head_dim), v.reshape(T, c.num_kv_heads, c.head_dim)
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        kv_pages = write_kv(
            kv_pages, layer, k, v, md.slot_mapping, backend=self.attention_backend, mesh=self.mesh
        )
        scale = c.head_dim**-0.5 if c.attn_scale is None else c.attn_scale
        attn = paged_attention(
            q,
            kv_pages,
            layer,
            md,
            backend=self.attention_backend,
            mesh=self.mesh,
            scale=scale,
            sliding_window=c.sliding_window,
        )
        o = dense(c.hidden_size, use_bias=c.o_bias, name="o_proj")(attn.reshape(T, q_size), num_rows, pick)
        if c.pre_norm:
            h, x = mlp_norm(h, o, num_rows)
        else:
            h = x = attn_norm(h + o)
        act = functools.partial(activate, c.activation)
        if c.gated_mlp:
            gate_up = dense(2 * c.intermediate_size, use_bias=c.mlp_bias, name="gate_up_proj")(
                x, num_rows, pick
            )
            if native and c.activation == "silu" and gate_up.ndim == 2 and gate_up.dtype in NATIVE_DTYPES:
                y = cpu_silu_and_mul(gate_up, num_rows)
            else:
                gate, up = split_fused(gate_up, (c.intermediate_size, c.intermediate_size), self.mesh)
                y = act(gate) * up
        else:
            y = act(dense(c.intermediate_size, use_bias=c.mlp_bias, name="up_proj")(x, num_rows, pick))
        down = dense(c.hidden_size, use_bias=c.mlp_bias, name="down_proj")(y, num_rows, pick)
        if c.pre_norm:
            return h, down, kv_pages
        return mlp_norm(h + down), None, kv_pages


class DecoderForCausalLM(nn.Module):
    """``(input_ids[T], positions[T], kv_pages, md, logits_indices[R], num_logits) -> (logits[R, V] f32, kv_pages)``.

    Tokens past ``md.num_real_tokens`` and ``logits_indices`` entries past ``num_logits`` (an
    int32 scalar; None: all) are padding, which the native matmul does not compute."""

    cfg: DecoderConfig
    dtype: Any = jnp.float32
    attention_backend: str = "xla"
    mesh: Any = None  # set by jaxpaged.parallel.shard_model for tensor parallelism
    matmul_backend: str = "xla"  # "cpu": kernels packed for the native CPU matmul (one device only)
    scan_layers: bool = False  # layers 1..L-1 as one lax.scan over params stacked by stack_layers

    @nn.compact
    def __call__(
        self, input_ids, positions, kv_pages, md: AttentionMetadata, logits_indices, num_logits=None
    ):
        c = self.cfg
        dense = functools.partial(Linear, use_bias=False, dtype=self.dtype, backend=self.matmul_backend)
        project = c.embed_dim != c.hidden_size
        embed = Embed(c.vocab_size, c.embed_dim, self.dtype, name="embed_tokens")
        h = embed(input_ids)
        if project:
            h = dense(c.hidden_size, name="project_in")(h, md.num_real_tokens)
        rope = None
        if c.position == "rope":
            rope = rope_tables(positions, rope_inv_freq(c), self.dtype)
        else:
            h = h + Embed(
                c.max_position_embeddings + c.position_offset,
                c.hidden_size,
                self.dtype,
                name="embed_positions",
            )(positions + c.position_offset)
        delta = None
        # The native CPU matmul reads every layer's weights from arrays stacked over the layers.
        stacked = self.matmul_backend == "cpu"
        layer_kind = functools.partial(
            DecoderLayer, c, self.dtype, self.attention_backend, self.mesh, self.matmul_backend
        )
        if self.scan_layers:
            h, delta, kv_pages = self._scanned_layers(layer_kind, h, kv_pages, rope, md)
        else:
            layers = (
                [layer_kind(c.num_layers, name="layers")] * c.num_layers
                if stacked
                else [layer_kind(name=layer_name(i)) for i in range(c.num_layers)]
            )
            for i, layer in enumerate(layers):
                h, delta, kv_pages = layer(h, delta, kv_pages, rope, md, i)
        h = h[logits_indices]
        delta = None if delta is None else delta[logits_indices]
        if c.final_norm:
            norm = Norm(
                c.norm,
                c.norm_eps,
                self.dtype,
                native_layer_ops(self.attention_backend, self.mesh),
                name="norm",
            )
            h = norm(h, num_rows=num_logits) if delta is None else norm(h, delta, num_logits)[1]
        elif delta is not None:
            h = h + delta
        if project:
            h = dense(c.embed_dim, name="project_out")(h, num_logits)
        # The native matmul needs its own packed copy of a tied head (the embedding, transposed).
        tied = c.tie_word_embeddings and self.matmul_backend != "cpu"
        logits = (
            embed.attend(h)
            if tied
            else dense(c.vocab_size, name="lm_head", out_dtype=jnp.float32)(h, num_logits)
        )
        return logits.astype(jnp.float32), kv_pages

    def _scanned_layers(self, layer_kind, h, kv_pages, rope, md):
        """Every layer on params stacked over the layers (``layers``, leaves ``[L, ...]``): layer 0 as a
        call (it creates the params at init, and its output fixes the loop carry's structure: a pre-norm
        layer returns a residual ``delta``), layers 1..L-1 as one ``lax.scan`` over the layer index, which
        the weights, the page array and the kernels take as a traced scalar. XLA then compiles one layer,
        not L: the lever on an accelerator's compile time. Off on CPU, where XLA copied every layer's
        weight slices out of the stack at each step of such a loop."""
        if (
            self.matmul_backend != "xla"
            or native_layer_ops(self.attention_backend, self.mesh)
            or self.mesh is not None
        ):
            raise ValueError(
                "scan_layers runs XLA's dot and ops on one device (matmul_backend='xla', no native "
                "layer ops, no tensor parallelism)"
            )
        L = self.cfg.num_layers
        h, delta, kv_pages = layer_kind(L, name="layers")(h, None, kv_pages, rope, md, 0)
        params = {"params": self.variables["params"]["layers"]}
        step = layer_kind(L)

        def body(carry, i):
            return step.apply(params, *carry, rope, md, i), None

        return jax.lax.scan(body, (h, delta, kv_pages), jnp.arange(1, L, dtype=jnp.int32))[0]
