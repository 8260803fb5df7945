"""The KV pool's plan: how many blocks it holds (on the device and, for swapping, the host), and the
longest sequence the engine then accepts, checked against the model and the scheduler's config."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax

from jaxpaged.config import EngineConfig
from jaxpaged.kv_cache_size import auto_kv_cache_memory, budget_rule
from jaxpaged.models.registry import ModelShape


@dataclass(frozen=True)
class CacheInfo:
    """How the KV-cache budget was turned into blocks (reported at start-up)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1  # block 0 is the null block

    @property
    def num_tokens(self) -> int:
        return self.num_usable_blocks * self.block_size


@dataclass(frozen=True)
class KVCachePlan:
    cache_info: CacheInfo
    num_host_blocks: int
    """Blocks of the host's swap space (``swap_space``)."""
    max_model_len: int


def plan_kv_cache(
    config: EngineConfig, shape: ModelShape, itemsize: int, group: Sequence[jax.Device]
) -> KVCachePlan:
    """The pool for ``config`` and a model of ``shape`` on the devices ``group`` (raises ``ValueError`` for
    a budget under two blocks or a ``max_model_len`` the model or the scheduler cannot run)."""
    mc, cc, sc = config.model, config.cache, config.scheduler
    tp = config.parallel.tensor_parallel_size
    # Per device: under tensor parallelism a device holds num_kv_heads / tp heads of every block.
    bytes_per_block = (
        shape.num_layers * 2 * cc.block_size * (shape.num_kv_heads // tp) * shape.head_dim * itemsize
    )
    max_pos = shape.max_position_embeddings
    if mc.max_model_len is not None and mc.max_model_len > max_pos:
        raise ValueError(
            f"max_model_len={mc.max_model_len} exceeds the model's "
            f"max_position_embeddings={max_pos}; use at most {max_pos}."
        )
    kv_memory = cc.kv_cache_memory
    if cc.sized_automatically:
        kv_memory = auto_kv_cache_memory(
            bytes_per_block,
            cc.block_size,
            sc.max_num_seqs,
            mc.max_model_len or max_pos,
            group,
            cc.gpu_memory_utilization,
        )
    num_blocks = cc.num_blocks_override or kv_memory // bytes_per_block
    if num_blocks < 2:
        if cc.num_blocks_override:
            raise ValueError(
                f"num_gpu_blocks_override={num_blocks}: the pool needs at least 2 blocks "
                f"(block 0 is the reserved null block)."
            )
        budget = (
            f"{budget_rule(cc.gpu_memory_utilization)} ({kv_memory} bytes)"
            if cc.sized_automatically
            else f"kv_cache_memory={kv_memory} bytes"
        )
        raise ValueError(
            f"{budget} holds {max(num_blocks, 0)} blocks of {bytes_per_block} bytes; give at least "
            f"{2 * bytes_per_block} bytes (kv_cache_memory)."
        )
    pool_tokens = (num_blocks - 1) * cc.block_size
    # Unless told otherwise, a sequence may grow as long as the model allows and the pool holds.
    max_model_len = mc.max_model_len or min(max_pos, pool_tokens)
    if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"with chunked prefill disabled, max_num_batched_tokens "
            f"({sc.max_num_batched_tokens}) must be >= max_model_len ({max_model_len})."
        )
    return KVCachePlan(
        CacheInfo(num_blocks, cc.block_size, bytes_per_block), cc.swap_space // bytes_per_block, max_model_len
    )
