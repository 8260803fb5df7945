"""Tensor parallelism over a device mesh: meshes, partition rules, weight layout and placement.

The mesh has axes ``("dp", "tp")``. One engine (one replica) uses a ``1 x tp`` mesh; data
parallelism runs ``dp`` such engines on disjoint device rows of ``device_grid(tp, dp)``
(``jaxpaged.data_parallel``), so the ``dp`` axis is there for a later in-engine batch split.

Partition rules (Megatron-style, two all-reduces per layer and nothing else inside the model):

* ``qkv_proj``, ``gate_up_proj``, ``up_proj``: split by output columns (heads / MLP width);
  their biases split the same way. The fused kernels are re-laid out at load time so that
  shard ``i`` holds ``[q_i | k_i | v_i]`` (``[gate_i | up_i]``): a contiguous column split of
  the canonical ``[q | k | v]`` would give shard 0 all the q heads and the last shard v.
* ``o_proj``, ``down_proj``: split by input rows; the partial products are all-reduced (GSPMD
  inserts it), then the (replicated) bias is added once.
* ``embed_tokens`` and ``lm_head``: split by vocabulary. They are the largest tensors of a small
  model (SmolLM2: 28M of 135M parameters), so replicating them would cost every device that much
  memory; the lookup becomes a masked local gather plus an all-reduce of ``[T, hidden]`` (not
  vocabulary-wide), and the head (tied or not) yields vocabulary-sharded logits whose
  all-gather (the step's ``out_shardings``) is the only vocabulary-wide communication. A
  vocabulary not divisible by ``tp`` falls back to replicating these two.
* Everything else (norms, learned positions, ``project_in``/``project_out``): replicated.
* KV pages ``[L, 2, blocks, block_size, Hkv, D]``: split on the kv-head axis (4). Block tables,
  slot mappings and sampling inputs are replicated.

Heads: ``num_heads`` must divide by ``tp``. When ``num_kv_heads`` does not, each kv head is
repeated ``r = tp / gcd(num_kv_heads, tp)`` times (``num_kv_heads * r`` = lcm, which divides
``num_heads``), so every shard has whole kv heads for its own query heads; the model is then
the same function with ``num_kv_heads * r`` kv heads, and the KV cache per device holds
``num_kv_heads * r / tp`` heads.

Weights go from host numpy straight into their shards (``jax.make_array_from_callback``: each
device receives only its slice); arrays already on a device (an orbax checkpoint) are resharded.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpaged.models.registry import BuiltModel, column_sections, parallel_style
from jaxpaged.kernels.sharded import KV_PAGES, TP_AXIS, tp_size

logger = logging.getLogger(__name__)

DP_AXIS = "dp"
_FUSED = ("qkv_proj", "gate_up_proj")  # column-parallel modules with several sections
_VOCAB_MODULES = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device holds for the engine: its parameter shards and its KV page shard."""

    params: int
    kv_cache: int

    @property
    def total(self) -> int:
        return self.params + self.kv_cache


# ---------------------------------------------------------------- meshes


def device_grid(tp: int, dp: int = 1, devices: Sequence[Any] | None = None) -> np.ndarray:
    """``[dp, tp]`` array of devices: row ``i`` is replica ``i``'s tensor-parallel group."""
    devices = list(jax.devices() if devices is None else devices)
    if tp < 1 or dp < 1:
        raise ValueError(f"tensor_parallel_size and data_parallel_size must be >= 1, got {tp} and {dp}.")
    if tp * dp > len(devices):
        what = (
            f"tensor_parallel_size={tp}"
            if dp == 1
            else f"data_parallel_size x tensor_parallel_size = {dp} x {tp} = {dp * tp}"
        )
        raise ValueError(
            f"{what} needs {tp * dp} devices, but only {len(devices)} are available "
            f"({devices[0].platform if devices else 'none'}). On CPU, more virtual devices come from "
            f"XLA_FLAGS=--xla_force_host_platform_device_count=N set before jax starts."
        )
    grid = np.empty((dp, tp), dtype=object)
    for i, d in enumerate(devices[: tp * dp]):
        grid[i // tp, i % tp] = d
    return grid


def make_mesh(devices: Sequence[Any]) -> Mesh:
    """A ``1 x len(devices)`` mesh with axes ``("dp", "tp")`` (Auto axes: GSPMD places the rest)."""
    grid = np.empty((1, len(devices)), dtype=object)
    grid[0, :] = list(devices)
    return Mesh(grid, (DP_AXIS, TP_AXIS))


def engine_mesh(tensor_parallel_size: int, devices: Sequence[Any] | None = None) -> Mesh | None:
    """The mesh of one engine: over ``devices`` if given (a data-parallel replica's row), else over
    the first ``tensor_parallel_size`` devices. None for the plain single-device, single-process engine."""
    if devices is None:
        if tensor_parallel_size == 1 and jax.process_count() == 1:
            return None
        devices = device_grid(tensor_parallel_size)[0]
    if len(devices) != tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} but {len(devices)} devices were given."
        )
    return make_mesh(devices)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def kv_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, KV_PAGES)


# ---------------------------------------------------------------- heads and layout


def kv_head_repeats(num_heads: int, num_kv_heads: int, tp: int) -> int:
    """How many times each kv head is repeated so that ``tp`` shards each hold whole kv heads for
    their query heads; ValueError when the query heads cannot be split evenly."""
    if num_heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the model's {num_heads} attention (query) "
            f"heads; use a tensor_parallel_size that divides {num_heads}."
        )
    return tp // math.gcd(num_kv_heads, tp)


def interleave_shards(a: Any, sizes: Sequence[int], n: int) -> Any:
    """``[A | B | ...]`` on the last axis -> ``[A_0 | B_0 | ... | A_1 | B_1 | ...]`` with ``X_i`` the
    ``i``-th of ``n`` equal pieces of ``X`` (inverse: ``jaxpaged.kernels.sharded.split_fused``)."""
    xp = np if isinstance(a, np.ndarray) else jnp
    parts = xp.split(a, np.cumsum(sizes)[:-1].tolist(), axis=-1)
    pieces = [xp.split(p, n, axis=-1) for p in parts]
    return xp.concatenate([pieces[j][i] for i in range(n) for j in range(len(parts))], axis=-1)


def _repeat_kv(a: Any, q_size: int, kv_heads: int, head_dim: int, r: int) -> Any:
    """Repeat each kv head of a ``[.., q | k | v]`` tensor ``r`` times (k and v parts)."""
    if r == 1:
        return a
    xp = np if isinstance(a, np.ndarray) else jnp
    q, k, v = xp.split(a, [q_size, q_size + kv_heads * head_dim], axis=-1)

    def rep(x):
        x = x.reshape(*x.shape[:-1], kv_heads, 1, head_dim)
        x = xp.broadcast_to(x, (*x.shape[:-2], r, head_dim))
        return x.reshape(*x.shape[:-3], kv_heads * r * head_dim)

    return xp.concatenate([q, rep(k), rep(v)], axis=-1)


def shard_model(model: BuiltModel, mesh: Mesh) -> BuiltModel:
    """The model for ``mesh``: checked for divisibility, kv heads repeated if needed, fused kernels
    re-laid out per shard, and the module told its mesh. Params stay where they were (host numpy
    or device arrays); ``place_params`` puts them into their shards."""
    module, n = model.module, tp_size(mesh)
    if "mesh" not in {f.name for f in dataclasses.fields(module)}:
        raise ValueError(
            f"{type(module).__name__} does not support tensor parallelism (no mesh field); "
            "use tensor_parallel_size=1."
        )
    cfg = module.cfg
    r = kv_head_repeats(cfg.num_heads, cfg.num_kv_heads, n)
    if cfg.intermediate_size % n:
        raise ValueError(f"tensor_parallel_size={n} does not divide the MLP width {cfg.intermediate_size}.")
    new_cfg = dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * r)
    if r > 1:
        logger.info(
            "tensor parallel: %d kv heads repeated %dx (%d kv heads, %d per device) for %d devices",
            cfg.num_kv_heads,
            r,
            new_cfg.num_kv_heads,
            new_cfg.num_kv_heads // n,
            n,
        )

    def relayout(path, a):
        names = [getattr(k, "key", str(k)) for k in path]
        fused = next((m for m in _FUSED if m in names), None)
        if fused == "qkv_proj":
            a = _repeat_kv(a, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads, cfg.head_dim, r)
        if fused is None or n == 1:
            return a
        return interleave_shards(a, column_sections(new_cfg, fused), n)

    params = jax.tree_util.tree_map_with_path(relayout, model.params)
    shape = dataclasses.replace(model.shape, num_kv_heads=new_cfg.num_kv_heads)
    return BuiltModel(module.clone(cfg=new_cfg, mesh=mesh), params, shape)


# ---------------------------------------------------------------- placement


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """A ``NamedSharding`` per param, by the model's partition rules (``parallel_style``, see the module doc)."""
    n = tp_size(mesh)

    def spec(path, a) -> NamedSharding:
        names = tuple(getattr(k, "key", str(k)) for k in path)
        style, nd = parallel_style(names), len(a.shape)
        axis = {"column": nd - 1, "vocab": 0, "row": nd - 2 if names[-1] == "kernel" else None}.get(style)
        if axis is None or nd == 0:
            return replicated(mesh)
        if a.shape[axis] % n:
            if any(m in names for m in _VOCAB_MODULES):
                logger.info(
                    "tensor parallel: %s (%s) replicated: %d does not divide by %d",
                    "/".join(names),
                    "x".join(map(str, a.shape)),
                    a.shape[axis],
                    n,
                )
                return replicated(mesh)
            raise ValueError(
                f"tensor_parallel_size={n} does not divide axis {axis} of {'/'.join(names)} {tuple(a.shape)}."
            )
        parts = [None] * nd
        parts[axis] = TP_AXIS
        return NamedSharding(mesh, P(*parts))

    return jax.tree_util.tree_map_with_path(spec, params)


def place_params(params: Any, mesh: Mesh | None) -> Any:
    """Params on their devices: with a mesh, each into its ``NamedSharding`` (from host numpy every
    device receives just its slice; this also works across processes); without, on the default device."""
    if mesh is None:
        return jax.device_put(params)

    def put(a, sharding):
        if isinstance(a, jax.Array):
            return jax.device_put(a, sharding)
        host = np.asarray(a)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree_util.tree_map(put, params, param_shardings(params, mesh))


def zeros(shape: Sequence[int], dtype: Any, sharding: NamedSharding) -> jax.Array:
    """A zero array created directly in its shards (never whole on one device)."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def memory_per_device(params: Any, kv_pages: jax.Array) -> dict[Any, DeviceMemory]:
    """Bytes of parameter and KV-page shards on each of this process's devices (replicated
    params count on every device that holds them)."""

    def tally(tree) -> dict[Any, int]:
        out: dict[Any, int] = {}
        for leaf in jax.tree_util.tree_leaves(tree):
            for shard in leaf.addressable_shards:
                out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
        return out

    p, kv = tally(params), tally(kv_pages)
    return {d: DeviceMemory(p.get(d, 0), kv.get(d, 0)) for d in sorted(set(p) | set(kv), key=lambda d: d.id)}


def format_memory(mem: dict[Any, DeviceMemory]) -> str:
    return "; ".join(
        f"{d}: {m.total / 2**20:.1f} MiB (params {m.params / 2**20:.1f}, KV {m.kv_cache / 2**20:.1f})"
        for d, m in mem.items()
    )
