"""The native CPU layer kernels (``jaxpaged.kernels.cpu_layer_ops``): the rotary embedding,
RMSNorm (with the residual add fused) and SiLU(gate) * up, against torch's (HF's) arithmetic and the
model's XLA path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxpaged.models.decoder import Norm, activate, apply_rope, rope_tables
from jaxpaged.kernels.cpu_layer_ops import (
    cpu_rms_norm,
    cpu_rope_qkv,
    cpu_silu_and_mul,
    native_layer_ops_available,
)

needs_kernels = pytest.mark.skipif(
    not native_layer_ops_available(), reason="native CPU layer kernels not built"
)


def _to_torch(a: jax.Array) -> torch.Tensor:
    """A float32 or bfloat16 array as a torch tensor of the same dtype and values."""
    t = torch.from_numpy(np.array(a.astype(jnp.float32)))
    return t.to(torch.bfloat16) if a.dtype == jnp.bfloat16 else t


def _f32(a) -> np.ndarray:
    return np.asarray(
        a.float().numpy() if isinstance(a, torch.Tensor) else jnp.asarray(a).astype(jnp.float32)
    )


@needs_kernels
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim",
    [(1, 1, 1, 32), (7, 3, 1, 64), (64, 9, 3, 64), (5, 2, 2, 128), (3, 4, 2, 40)],
)
def test_native_rotary_matches_torch(dtype, tokens: int, heads: int, kv_heads: int, head_dim: int) -> None:
    """q and k come out of the fused projection rotated as HF's ``q * cos + rotate_half(q) * sin`` rounds
    them in torch, bit for bit in both dtypes, and v as its slice; in bfloat16 also bit for bit the
    model's XLA path (``apply_rope``), which in float32 may fuse a multiply-add."""
    rng = np.random.default_rng(tokens * heads + head_dim)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = jnp.asarray(rng.standard_normal((tokens, q_size + 2 * kv_size)) * 4, dtype)
    positions = jnp.asarray(rng.integers(0, 4096, tokens), jnp.int32)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, head_dim, 2) / head_dim))
    C, S = rope_tables(positions, inv_freq, dtype)
    q, k, v = jax.jit(cpu_rope_qkv, static_argnums=(3, 4))(qkv, C, S, heads, kv_heads)
    cos = _to_torch(C.reshape(tokens, 1, head_dim))
    sin = -_to_torch(S.reshape(tokens, 1, head_dim)[..., : head_dim // 2]).repeat(1, 1, 2)
    half = head_dim // 2
    for out, part in (
        (q, qkv[:, :q_size].reshape(tokens, heads, head_dim)),
        (k, qkv[:, q_size : q_size + kv_size].reshape(tokens, kv_heads, head_dim)),
    ):
        x = _to_torch(part)
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        np.testing.assert_array_equal(_f32(out), _f32(x * cos + rotated * sin))
        if dtype == jnp.bfloat16:
            np.testing.assert_array_equal(_f32(out), _f32(jax.jit(apply_rope)(part, C, S)))
    np.testing.assert_array_equal(
        _f32(v), _f32(qkv[:, q_size + kv_size :].reshape(tokens, kv_heads, head_dim))
    )


@needs_kernels
def test_native_rotary_zeroes_padding_rows_and_rejects_bad_input() -> None:
    rng = np.random.default_rng(3)
    qkv = jnp.asarray(rng.standard_normal((6, 4 * 16)), jnp.float32)
    C, S = rope_tables(jnp.arange(6), 1.0 / (10000.0 ** (np.arange(0, 16, 2) / 16)), jnp.float32)
    padded = jax.jit(cpu_rope_qkv, static_argnums=(3, 4))(qkv, C, S, 2, 1, jnp.int32(4))
    full = cpu_rope_qkv(qkv, C, S, 2, 1)
    for p, f in zip(padded, full):
        np.testing.assert_array_equal(np.asarray(p[:4]), np.asarray(f[:4]))
        assert not np.asarray(p[4:]).any() and np.asarray(f[4:]).any()
    with pytest.raises(ValueError, match="one dtype"):
        cpu_rope_qkv(qkv.astype(jnp.bfloat16), C, S, 2, 1)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_rope_qkv(qkv.astype(jnp.float16), C.astype(jnp.float16), S.astype(jnp.float16), 2, 1)
    with pytest.raises(ValueError, match="D even"):
        cpu_rope_qkv(qkv, C, S, 3, 1)
    with pytest.raises(ValueError, match="D even"):
        cpu_rope_qkv(jnp.zeros((6, 4 * 7), jnp.float32), C, S, 2, 1)


def _torch_rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``LlamaRMSNorm.forward``."""
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(h.dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tokens,d", [(1, 16), (5, 40), (64, 576), (130, 100)])
def test_native_rms_norm_matches_torch(dtype, tokens: int, d: int) -> None:
    """The fused add is torch's bit for bit; the norm agrees with HF's RMSNorm up to the order of the
    sum of squares: within one rounding of the dtype, and at least as often exact as the model's
    XLA path (whose rsqrt is an approximation)."""
    rng = np.random.default_rng(tokens * d)
    h = jnp.asarray(rng.standard_normal((tokens, d)) * 3, dtype)
    residual = jnp.asarray(rng.standard_normal((tokens, d)), dtype)
    weight = jnp.asarray(1 + rng.standard_normal(d) / 4, dtype)
    eps = 1e-5
    total, normed = jax.jit(lambda h, r, w: cpu_rms_norm(h, w, eps, r))(h, residual, weight)
    alone = jax.jit(lambda h, w: cpu_rms_norm(h, w, eps))(total, weight)

    hf_total = _to_torch(h) + _to_torch(residual)
    hf = _f32(_torch_rms_norm(hf_total, _to_torch(weight), eps))
    np.testing.assert_array_equal(_f32(total), _f32(hf_total))
    np.testing.assert_array_equal(_f32(normed), _f32(alone))
    ulp = 2.0**-7 if dtype == jnp.bfloat16 else 2.0**-22
    np.testing.assert_allclose(_f32(normed), hf, rtol=ulp, atol=1e-6)

    module = Norm("rmsnorm", eps, dtype)
    xla = _f32(module.apply({"params": {"weight": weight}}, h, residual)[1])
    assert (_f32(normed) != hf).mean() <= (xla != hf).mean()


@needs_kernels
def test_native_bfloat16_rounding_of_ties_infinities_and_nans_is_torchs() -> None:
    """The fused add's sum rounded to bfloat16 as torch rounds it: halfway cases to even, overflow to
    infinity, NaN kept NaN, in a row's full vectors and in its masked tail (d = 40 = 16 + 16 + 8)."""
    cases = [
        (1.0, 2.0**-8),
        (1 + 2.0**-7, 2.0**-8),
        (-1 - 2.0**-7, -(2.0**-8)),
        (3.0, 2.0**-7),
        (np.inf, 1.0),
        (np.inf, -np.inf),
        (np.nan, 1.0),
        (3.3895e38, 3.3895e38),
        (-0.0, -0.0),
        (0.5, -0.5),
    ]
    h, residual = np.zeros((2, 40), np.float32), np.zeros((2, 40), np.float32)
    for i, (a, b) in enumerate(cases):
        for j in (i, 30 + i):  # lanes of full vectors, then of the tail
            h[i % 2, j], residual[i % 2, j] = a, b
    h, residual = jnp.asarray(h, jnp.bfloat16), jnp.asarray(residual, jnp.bfloat16)
    total, _ = cpu_rms_norm(h, jnp.ones(40, jnp.bfloat16), 1e-5, residual)
    want = _f32(_to_torch(h) + _to_torch(residual))
    assert np.isnan(want).sum() == 4 and np.isinf(want).sum() == 4  # the cases are what they claim
    np.testing.assert_array_equal(_f32(total), want)
    numbers = ~np.isnan(want)  # a NaN's sign is the hardware's choice
    np.testing.assert_array_equal(np.signbit(_f32(total))[numbers], np.signbit(want)[numbers])


@needs_kernels
def test_native_rms_norm_zeroes_padding_rows() -> None:
    """Rows from ``num_rows`` on are a padded batch's padding: zero in both outputs, the real rows as
    in a call without padding."""
    rng = np.random.default_rng(0)
    h, residual = (jnp.asarray(rng.standard_normal((8, 48)), jnp.float32) for _ in range(2))
    weight = jnp.ones(48, jnp.float32)
    total, normed = jax.jit(lambda n: cpu_rms_norm(h, weight, 1e-6, residual, n))(jnp.int32(3))
    full_total, full_normed = cpu_rms_norm(h, weight, 1e-6, residual)
    for padded, full in ((total, full_total), (normed, full_normed)):
        np.testing.assert_array_equal(np.asarray(padded[:3]), np.asarray(full[:3]))
        assert not np.asarray(padded[3:]).any()
    assert np.asarray(full_normed[3:]).any()


@needs_kernels
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_rms_norm_reads_a_stacked_weight_in_place(dtype) -> None:
    """With ``layer`` the weight is ``[L, d]``, every layer's: the result equals the norm with that
    layer's weight alone, with and without the fused residual add, under jit; and the non-native
    path (``Norm`` with ``num_layers``) picks the same row."""
    rng = np.random.default_rng(3)
    h, residual = (jnp.asarray(rng.standard_normal((6, 40)), dtype) for _ in range(2))
    weights = jnp.asarray(1 + rng.standard_normal((3, 40)) / 4, dtype)
    for layer in range(3):
        alone = cpu_rms_norm(h, weights[layer], 1e-5, residual)
        stacked = jax.jit(lambda h, r, w: cpu_rms_norm(h, w, 1e-5, r, layer=layer))(h, residual, weights)
        for got, want in zip(stacked, alone):
            np.testing.assert_array_equal(_f32(got), _f32(want))
        np.testing.assert_array_equal(
            _f32(cpu_rms_norm(h, weights, 1e-5, layer=layer)), _f32(cpu_rms_norm(h, weights[layer], 1e-5))
        )
        xla = Norm("rmsnorm", 1e-5, dtype, num_layers=3).apply(
            {"params": {"weight": weights}}, h, layer=layer
        )
        own = Norm("rmsnorm", 1e-5, dtype).apply({"params": {"weight": weights[layer]}}, h)
        np.testing.assert_array_equal(_f32(xla), _f32(own))
    with pytest.raises(ValueError, match="layer 3 is not in the stacked weight"):
        cpu_rms_norm(h, weights, 1e-5, layer=3)
    with pytest.raises(ValueError, match=r"h\[T, d\]"):
        cpu_rms_norm(h, weights, 1e-5)  # a stack without a layer


@needs_kernels
def test_native_rms_norm_rejects_other_dtypes_and_shapes() -> None:
    h = jnp.zeros((4, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_rms_norm(h.astype(jnp.float16), jnp.ones(8, jnp.float16), 1e-5)
    with pytest.raises(ValueError, match="one dtype"):
        cpu_rms_norm(h, jnp.ones(8, jnp.float32), 1e-5)
    with pytest.raises(ValueError, match=r"h\[T, d\]"):
        cpu_rms_norm(h, jnp.ones(7, jnp.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="residual like h"):
        cpu_rms_norm(h, jnp.ones(8, jnp.bfloat16), 1e-5, residual=jnp.zeros((3, 8), jnp.bfloat16))
    with pytest.raises(ValueError, match="num_rows must be a scalar"):
        cpu_rms_norm(h, jnp.ones(8, jnp.bfloat16), 1e-5, num_rows=jnp.array([1], jnp.int32))


@needs_kernels
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tokens,n", [(1, 8), (7, 40), (64, 1536)])
def test_native_silu_and_mul_matches_torch(dtype, tokens: int, n: int) -> None:
    """``round(silu(gate)) * up`` as torch's ``F.silu(gate) * up``: bit for bit in bfloat16 (the kernel's
    exp is accurate well within a bfloat16 rounding), in float32 within four float32 roundings and at least
    as often exact as the model's XLA path; the extremes (exp overflowing, signed zeros) as torch's."""
    rng = np.random.default_rng(tokens + n)
    gate_up = np.asarray(rng.standard_normal((tokens, 2 * n)) * 4, np.float32)
    gate_up[0, :8] = [100.0, -100.0, 0.0, -0.0, 88.7, -90.0, 88.75, -88.7]
    gate_up = jnp.asarray(gate_up, dtype)
    native = _f32(jax.jit(cpu_silu_and_mul)(gate_up))
    gate, up = gate_up[:, :n], gate_up[:, n:]
    hf = _f32(torch.nn.functional.silu(_to_torch(gate)) * _to_torch(up))
    if dtype == jnp.bfloat16:
        np.testing.assert_array_equal(native, hf)
    else:
        np.testing.assert_allclose(native, hf, rtol=2.0**-21, atol=0)
        np.testing.assert_array_equal(np.signbit(native), np.signbit(hf))
        xla = _f32(jax.jit(lambda g, u: activate("silu", g) * u)(gate, up))
        assert (native != hf).mean() <= (xla != hf).mean()


@needs_kernels
def test_native_silu_and_mul_zeroes_padding_rows_and_rejects_bad_input() -> None:
    gate_up = jnp.asarray(np.random.default_rng(1).standard_normal((6, 32)), jnp.bfloat16)
    padded = np.asarray(jax.jit(cpu_silu_and_mul)(gate_up, jnp.int32(2)).astype(jnp.float32))
    full = np.asarray(cpu_silu_and_mul(gate_up).astype(jnp.float32))
    np.testing.assert_array_equal(padded[:2], full[:2])
    assert not padded[2:].any() and full[2:].any()
    with pytest.raises(ValueError, match=r"gate_up\[T, 2n\]"):
        cpu_silu_and_mul(jnp.zeros((4, 7), jnp.bfloat16))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_silu_and_mul(jnp.zeros((4, 8), jnp.float16))
    with pytest.raises(ValueError, match="num_rows must be a scalar"):
        cpu_silu_and_mul(gate_up, jnp.array([2, 2], jnp.int32))
