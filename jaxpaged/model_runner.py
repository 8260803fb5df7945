"""Turns a ``SchedulerOutput`` into padded device arrays and runs one jitted, KV-donating step.

The host side is vectorized numpy; per request it only copies the step's new token ids and
the block table row. Shapes are padded to power-of-two buckets (tokens, rows, block-table
width, prefill tiles) so the set of compiled programs stays small and known.
"""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.sampler import SamplingTensors, sample
from jaxpaged.scheduler import SchedulerOutput
from models.registry import BuiltModel
from pallas_kernels import AttentionMetadata, PAD_SLOT, build_prefill_tiles, copy_blocks
from pallas_kernels.metadata import num_prefill_tiles

logger = logging.getLogger(__name__)

PREFILL_TILE = 64
# Bucket floors: padding a small batch up to these costs little and saves compiled programs.
MIN_TOKENS, MIN_ROWS, MIN_CONTEXT, MIN_TILES = 16, 8, 256, 4


def _bucket(n: int, cap: int, floor: int = 1) -> int:
    """Smallest power of two >= max(n, floor), clipped to ``cap`` (never below ``n``)."""
    b = 1 << (max(n, floor, 1) - 1).bit_length()
    return max(min(b, cap), n)


@dataclass
class StepBatch:
    """Host arrays of one step, already padded to bucket shapes."""

    input_ids: np.ndarray
    positions: np.ndarray
    md: AttentionMetadata
    logits_indices: np.ndarray
    sampling: SamplingTensors
    num_rows: int
    all_greedy: bool
    use_top_k_top_p: bool

    @property
    def program_key(self) -> tuple:
        return (self.input_ids.shape[0], self.logits_indices.shape[0], self.md.block_tables.shape[1],
                self.md.tile_row.shape[0], self.md.tile_size, self.all_greedy, self.use_top_k_top_p)


@functools.partial(jax.jit, static_argnames=("module", "all_greedy", "use_top_k_top_p"),
                   donate_argnames=("kv_pages",))
def step_fn(module, params, kv_pages, input_ids, positions, md, logits_indices, sampling, *,
            all_greedy: bool, use_top_k_top_p: bool):
    """The whole device step: forward over the ragged batch, KV written in place, then sampling.

    Module-level (the Flax module is a static, hashable argument) so engines with the same
    model share compiled programs.
    """
    logits, kv_pages = module.apply({"params": params}, input_ids, positions, kv_pages, md, logits_indices)
    tokens, logprobs = sample(logits, sampling, all_greedy=all_greedy, use_top_k_top_p=use_top_k_top_p)
    return kv_pages, tokens, logprobs


_copy_blocks = jax.jit(copy_blocks, donate_argnums=(0,))


class ModelRunner:
    """Owns the parameters, the global KV page array and the jitted step."""

    def __init__(self, model: BuiltModel, *, num_blocks: int, block_size: int, dtype: Any,
                 max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int):
        self.model = model
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        s = model.shape
        self.kv_pages = jnp.zeros((s.num_layers, 2, num_blocks, block_size, s.num_kv_heads, s.head_dim), dtype)
        self.program_keys: set[tuple] = set()

    @property
    def num_compiled_programs(self) -> int:
        return len(self.program_keys)

    def prepare(self, out: SchedulerOutput) -> StepBatch:
        reqs = out.requests
        R = len(reqs)
        n = np.asarray(out.num_new_tokens, np.int32)
        starts = np.asarray(out.start_positions, np.int32)
        T = int(n.sum())
        T_b = _bucket(T, self.max_num_batched_tokens, floor=MIN_TOKENS)
        R_b = _bucket(R, self.max_num_seqs, floor=MIN_ROWS)
        seq_lens = starts + n
        W_b = _bucket(-(-int(seq_lens.max()) // self.block_size), self.max_blocks_per_seq,
                      floor=MIN_CONTEXT // self.block_size)

        qsl = np.full(R_b + 1, T, np.int32)
        qsl[0] = 0
        qsl[1:R + 1] = np.cumsum(n)
        row_of_tok = np.repeat(np.arange(R), n)
        positions = np.zeros(T_b, np.int32)
        positions[:T] = np.arange(T) - qsl[row_of_tok] + starts[row_of_tok]
        input_ids = np.zeros(T_b, np.int32)
        input_ids[:T] = np.fromiter(itertools.chain.from_iterable(
            r.token_ids_slice(s, s + k) for r, s, k in zip(reqs, out.start_positions, out.num_new_tokens)),
            np.int32, T)
        block_tables = np.zeros((R_b, W_b), np.int32)
        for i, r in enumerate(reqs):
            ids = r.block_ids[:W_b]
            block_tables[i, :len(ids)] = ids
        slot_mapping = np.full(T_b, PAD_SLOT, np.int32)
        pos = positions[:T]
        slot_mapping[:T] = block_tables[row_of_tok, pos // self.block_size] * self.block_size + pos % self.block_size
        seq_lens_b = np.zeros(R_b, np.int32)
        seq_lens_b[:R] = seq_lens
        tile = min(PREFILL_TILE, T_b)
        n_tiles = num_prefill_tiles(qsl, tile)
        P_b = 0 if n_tiles == 0 else _bucket(n_tiles, 1 << 30, floor=MIN_TILES)
        tile_row, tile_start, tile_len = build_prefill_tiles(qsl, tile, P_b)
        md = AttentionMetadata(slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens_b,
                               query_start_loc=qsl, tile_row=tile_row, tile_start=tile_start,
                               tile_len=tile_len, tile_size=tile)
        logits_indices = np.zeros(R_b, np.int32)
        logits_indices[:R] = qsl[1:R + 1] - 1
        return StepBatch(input_ids, positions, md, logits_indices, *self._sampling_arrays(reqs, seq_lens, R_b))

    @staticmethod
    def _sampling_arrays(reqs, seq_lens: np.ndarray, R_b: int) -> tuple[SamplingTensors, int, bool, bool]:
        R = len(reqs)
        temperature = np.zeros(R_b, np.float32)
        top_k = np.zeros(R_b, np.int32)
        top_p = np.ones(R_b, np.float32)
        seeds = np.zeros(R_b, np.uint64)
        for i, r in enumerate(reqs):
            sp = r.sampling_params
            temperature[i] = sp.temperature
            top_k[i] = max(sp.top_k, 0)
            top_p[i] = sp.top_p
            seeds[i] = r.seed
        position = np.zeros(R_b, np.int32)
        position[:R] = seq_lens
        st = SamplingTensors(temperature=temperature, top_k=top_k, top_p=top_p,
                             seed_lo=(seeds & 0xFFFFFFFF).astype(np.uint32),
                             seed_hi=(seeds >> 32).astype(np.uint32), position=position)
        sampled = temperature > 0
        all_greedy = not sampled.any()
        use_top_k_top_p = bool(((top_k > 0) | (top_p < 1.0))[sampled].any())
        return st, R, all_greedy, use_top_k_top_p

    def execute(self, out: SchedulerOutput) -> tuple[np.ndarray, np.ndarray]:
        """Run one step; returns the sampled token ids and their logprobs for ``out.requests``."""
        if out.blocks_to_copy:
            self._copy_blocks(out.blocks_to_copy)
        b = self.prepare(out)
        if b.program_key not in self.program_keys:
            self.program_keys.add(b.program_key)
            logger.debug("compiling step program %s", b.program_key)
        dev = jax.device_put((b.input_ids, b.positions, b.md, b.logits_indices, b.sampling))
        self.kv_pages, tokens, logprobs = step_fn(self.model.module, self.model.params, self.kv_pages, *dev,
                                                     all_greedy=b.all_greedy,
                                                     use_top_k_top_p=b.use_top_k_top_p)
        tokens, logprobs = jax.device_get((tokens, logprobs))
        return tokens[:b.num_rows], logprobs[:b.num_rows]

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        P = _bucket(len(pairs), 1 << 30)
        src = np.zeros(P, np.int32)
        dst = np.full(P, -1, np.int32)
        src[:len(pairs)], dst[:len(pairs)] = zip(*pairs)
        self.kv_pages = _copy_blocks(self.kv_pages, src, dst)
