"""Turns a ``SchedulerOutput`` into padded device arrays and runs one jitted, KV-donating step.

The host side is vectorized numpy; per request it only copies the step's new token ids and
the block table row. Shapes are padded to power-of-two buckets (tokens, rows, block-table
width, prefill tiles) so the set of compiled programs stays small and known.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged import parallel
from jaxpaged.request import Request
from jaxpaged.sampler import SamplerFlags, SamplerOutput, SamplingTensors, prompt_logprobs, sample
from jaxpaged.sampling_params import MAX_LOGPROBS
from jaxpaged.scheduler import SchedulerOutput
from models.registry import BuiltModel
from pallas_kernels import AttentionMetadata, PAD_SLOT, build_prefill_tiles, copy_blocks, gathers_pages
from pallas_kernels.metadata import num_prefill_tiles

logger = logging.getLogger(__name__)

PREFILL_TILE = 64
# Bucket floors: padding a small batch up to these costs little and saves compiled programs.
MIN_TOKENS, MIN_CONTEXT, MIN_TILES = 8, 256, 4
# Floors of the compact sampling lists: (row, token) pairs for penalties and for bias/masks,
# and prompt positions scored for prompt logprobs.
MIN_PENALTY_PAIRS, MIN_BIAS_ENTRIES, MIN_PROMPT_POSITIONS = 256, 16, 16
_SEED_MASK = (1 << 64) - 1
# Sampler variants compiled at start-up: greedy, and plain random sampling (OpenAI's defaults).
PRECOMPILED_SAMPLERS = (SamplerFlags(all_greedy=True), SamplerFlags(all_greedy=False))


def _bucket(n: int, cap: int, floor: int = 1) -> int:
    """Smallest power of two >= max(n, floor), clipped to ``cap`` (never below ``n``)."""
    b = 1 << (max(n, floor, 1) - 1).bit_length()
    return max(min(b, cap), n)


@dataclass
class StepBatch:
    """Host arrays of one step, already padded to bucket shapes.

    ``logits_indices`` holds the ``R_b`` sampled rows' last tokens, then the (padded) prompt
    positions whose next-token logprobs were asked for: ``prompt_targets`` are those next tokens,
    ``prompt_rows`` (unpadded) their batch rows.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    md: AttentionMetadata
    logits_indices: np.ndarray
    sampling: SamplingTensors
    prompt_targets: np.ndarray
    prompt_rows: np.ndarray
    num_rows: int
    flags: SamplerFlags

    @property
    def program_keys(self) -> tuple[tuple, tuple]:
        """The shapes (and flags) that select the compiled forward and sampler programs."""
        st = self.sampling
        forward = ("forward", self.input_ids.shape[0], self.logits_indices.shape[0], self.md.block_tables.shape[1],
                   self.md.tile_row.shape[0], self.md.tile_size)
        sampler = ("sampler", self.logits_indices.shape[0], self.prompt_targets.shape[0], self.flags,
                   st.penalty_rows.shape[0], st.bias_rows.shape[0])
        return forward, sampler


@dataclass
class StepOutput:
    """One step's sampler results on the host, trimmed to the batch's rows and prompt positions."""

    sampled: SamplerOutput
    prompt: SamplerOutput | None
    prompt_rows: np.ndarray
    """Batch row of each ``prompt`` entry; a row's entries are consecutive prompt positions."""


def _step(module, params, kv_pages, input_ids, positions, md, logits_indices):
    logits, kv_pages = module.apply({"params": params}, input_ids, positions, kv_pages, md, logits_indices)
    return kv_pages, logits


@functools.cache
def _jit_step(mesh):
    """``_step`` jitted for one device mesh (None: one device). On a mesh the shardings are explicit:
    params as placed, KV pages split on the kv-head axis in and out (donated), step inputs
    replicated, and the vocabulary-sharded logits all-gathered (replicated) for the sampler."""
    if mesh is None:
        return jax.jit(_step, static_argnames=("module",), donate_argnames=("kv_pages",))
    kv, rep = parallel.kv_sharding(mesh), parallel.replicated(mesh)
    return jax.jit(_step, static_argnames=("module",), donate_argnames=("kv_pages",),
                   in_shardings=(None, kv, rep, rep, rep, rep), out_shardings=(kv, rep))


def step_fn(module, params, kv_pages, input_ids, positions, md, logits_indices):
    """The model part of the step: forward over the ragged batch, KV written in place, logits out.

    Module-level (the Flax module is a static, hashable argument, and carries its device mesh
    under tensor parallelism) so engines with the same model share compiled programs.
    """
    return _jit_step(getattr(module, "mesh", None))(module, params, kv_pages, input_ids, positions, md,
                                                     logits_indices)


step_fn.lower = lambda module, *args: _jit_step(getattr(module, "mesh", None)).lower(module, *args)


@functools.partial(jax.jit, static_argnames=("flags",))
def sample_fn(logits, sampling, prompt_targets, *, flags: SamplerFlags):
    """The sampling part of the step, on the device-resident logits: the sampled rows first, then
    the prompt positions scored for prompt logprobs. A program of its own, so the sampler's
    variants (flags) and the model's (shapes) are compiled independently, not as their product."""
    R = sampling.temperature.shape[0]
    sampled = sample(logits[:R], sampling, flags)
    prompt = (prompt_logprobs(logits[R:], prompt_targets, max(flags.num_logprobs, 0))
              if prompt_targets.shape[0] else None)
    return sampled, prompt


def _padded(values: np.ndarray, size: int, fill) -> np.ndarray:
    """``values`` followed by ``fill`` up to ``size`` (a padding row index is out of range: dropped)."""
    a = np.full(size, fill, values.dtype)
    a[:len(values)] = values
    return a


def _penalty_counts(r: Request) -> dict[int, int]:
    """The request's penalty pairs, token -> output count, brought up to date with its new output
    tokens: kept on the request, so a step costs O(new tokens), not O(prompt + output)."""
    if r.penalty_counts is None:
        with_prompt = r.sampling_params.repetition_penalty != 1.0
        r.penalty_counts = dict.fromkeys(r.prompt_token_ids, 0) if with_prompt else {}
    counts = r.penalty_counts
    for t in r.output_token_ids[r.num_penalty_counted:]:
        counts[t] = counts.get(t, 0) + 1
    r.num_penalty_counted = r.num_output_tokens
    return counts


def _logprobs_width(n: int) -> int:
    """Top logprobs computed for the batch: none beyond the chosen token's, or the most allowed
    (two variants only: a top-20 costs little more than a top-1)."""
    return 0 if n == 0 else MAX_LOGPROBS


_copy_blocks = jax.jit(copy_blocks, donate_argnums=(0,))


@jax.jit
def _gather_blocks(kv_pages, idx):
    return kv_pages[:, :, idx]


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter_blocks(kv_pages, blocks, dst):
    """``kv_pages[:, :, dst[i]] = blocks[:, :, i]``; ``dst < 0`` is skipped."""
    dst = jnp.where(dst < 0, kv_pages.shape[2], dst)
    return kv_pages.at[:, :, dst].set(blocks, mode="drop")


class ModelRunner:
    """Owns the parameters, the global KV page array and the jitted step."""

    def __init__(self, model: BuiltModel, *, num_blocks: int, block_size: int, dtype: Any,
                 max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 num_host_blocks: int = 0):
        # Under tensor parallelism (the module carries a mesh) params go into their shards and the
        # KV pages are created split on the kv-head axis; otherwise both live on the default device.
        mesh = getattr(model.module, "mesh", None)
        self.model = dataclasses.replace(model, params=parallel.place_params(model.params, mesh))
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.gathers_pages = gathers_pages(model.module.attention_backend)
        self.max_rows = _bucket(max_num_seqs, 1 << 30)
        s = model.shape
        kv_shape = (s.num_layers, 2, num_blocks, block_size, s.num_kv_heads, s.head_dim)
        self.kv_pages = (jnp.zeros(kv_shape, dtype) if mesh is None else
                         parallel.zeros(kv_shape, dtype, parallel.kv_sharding(mesh)))
        logger.info("memory per device: %s", parallel.format_memory(self.memory_per_device()))
        # Host page pool for swapped-out blocks (preemption_mode="swap"); zeros are allocated lazily.
        self.host_pages = np.zeros((s.num_layers, 2, num_host_blocks, block_size, s.num_kv_heads, s.head_dim),
                                   self.kv_pages.dtype)
        self.program_keys: set[tuple] = set()

    @property
    def num_compiled_programs(self) -> int:
        return len(self.program_keys)

    def memory_per_device(self) -> dict[Any, parallel.DeviceMemory]:
        """Bytes of parameter and KV-page shards on each of this process's devices."""
        return parallel.memory_per_device(self.model.params, self.kv_pages)

    def token_bucket(self, num_tokens: int) -> int:
        """Padded token count of a step: a power of two from ``MIN_TOKENS`` to the step budget."""
        return _bucket(num_tokens, self.max_num_batched_tokens, floor=MIN_TOKENS)

    def row_bucket(self, token_bucket: int) -> int:
        """Padded row count, a function of the token bucket (a step has at most one row per token),
        so the forward program is selected by the token bucket alone: a decode step of ``n`` rows
        and a prefill chunk of ``n`` tokens share it."""
        return min(token_bucket, self.max_rows)

    @property
    def token_buckets(self) -> list[int]:
        """Every token bucket a step can use."""
        out, b = [], self.token_bucket(1)
        while True:
            out.append(b)
            if b >= self.max_num_batched_tokens:
                return out
            b = self.token_bucket(b + 1)

    def prepare(self, out: SchedulerOutput) -> StepBatch:
        reqs = out.requests
        R = len(reqs)
        n = np.asarray(out.num_new_tokens, np.int32)
        starts = np.asarray(out.start_positions, np.int32)
        T = int(n.sum())
        T_b = self.token_bucket(T)
        R_b = self.row_bucket(T_b)
        seq_lens = starts + n
        W_b = (_bucket(-(-int(seq_lens.max()) // self.block_size), self.max_blocks_per_seq,
                       floor=MIN_CONTEXT // self.block_size) if self.gathers_pages else self.max_blocks_per_seq)

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
        if self.gathers_pages:
            tile = min(PREFILL_TILE, T_b)
            n_tiles = num_prefill_tiles(qsl, tile)
            P_b = 0 if n_tiles == 0 else _bucket(n_tiles, 1 << 30, floor=MIN_TILES)
            tile_row, tile_start, tile_len = build_prefill_tiles(qsl, tile, P_b)
        else:
            tile, (tile_row, tile_start, tile_len) = 1, (np.zeros(0, np.int32),) * 3
        md = AttentionMetadata(slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens_b,
                               query_start_loc=qsl, tile_row=tile_row, tile_start=tile_start,
                               tile_len=tile_len, tile_size=tile)
        prompt_idx, prompt_targets, prompt_rows = self._prompt_logprob_positions(reqs, starts, n, qsl)
        NP = len(prompt_idx)
        NP_b = 0 if NP == 0 else _bucket(NP, 1 << 30, floor=MIN_PROMPT_POSITIONS)
        # Sampled rows: one per request, then one per fork (sampled from its parent row's logits).
        fork_rows = np.asarray([row for row, _ in out.forks], np.int32)
        S = R + len(fork_rows)
        S_b = R_b if not len(fork_rows) else max(R_b, self.row_bucket(self.token_bucket(S)))
        logits_indices = np.zeros(S_b + NP_b, np.int32)
        logits_indices[:R] = qsl[1:R + 1] - 1
        logits_indices[R:S] = logits_indices[fork_rows]
        logits_indices[S_b:S_b + NP] = prompt_idx
        targets = _padded(prompt_targets, NP_b, 0)
        sampling, flags = self._sampling_arrays(reqs + [c for _, c in out.forks],
                                                np.concatenate([seq_lens, seq_lens[fork_rows]]), S_b, prompt_rows)
        return StepBatch(input_ids, positions, md, logits_indices, sampling, targets, prompt_rows, S, flags)

    @staticmethod
    def _prompt_logprob_positions(reqs: list[Request], starts: np.ndarray, n: np.ndarray, qsl: np.ndarray
                                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flat token indices, next prompt tokens and rows of the prompt positions still to score.

        Position ``p`` scores ``prompt[p + 1]``. Positions already scored (``len(prompt_logprobs) - 1``
        of them) are skipped, so a recomputed (preempted) prompt is not scored twice.
        """
        idx, targets, rows = [], [], []
        for i, r in enumerate(reqs):
            if r.prompt_logprobs is None:
                continue
            s = int(starts[i])
            lo, hi = max(s, len(r.prompt_logprobs) - 1), min(s + int(n[i]), r.num_prompt_tokens - 1)
            if lo >= hi:
                continue
            idx.append(np.arange(lo, hi, dtype=np.int32) - s + qsl[i])
            targets.append(np.asarray(r.prompt_token_ids[lo + 1:hi + 1], np.int32))
            rows.append(np.full(hi - lo, i, np.int32))
        if not idx:
            return (np.zeros(0, np.int32),) * 3
        return np.concatenate(idx), np.concatenate(targets), np.concatenate(rows)

    @staticmethod
    def _sampling_arrays(reqs: list[Request], seq_lens: np.ndarray, R_b: int, prompt_rows: np.ndarray
                         ) -> tuple[SamplingTensors, SamplerFlags]:
        """Per-row parameters, the compact penalty and bias lists, and the flags of the batch."""
        R = len(reqs)
        f32 = np.float32
        temperature, top_p, min_p = np.zeros(R_b, f32), np.ones(R_b, f32), np.zeros(R_b, f32)
        presence, frequency, repetition = np.zeros(R_b, f32), np.zeros(R_b, f32), np.ones(R_b, f32)
        top_k = np.zeros(R_b, np.int32)
        seeds = np.zeros(R_b, np.uint64)
        pen_rows, pen_tokens, pen_counts = [], [], []
        bias_rows, bias_tokens, bias_values = [], [], []
        width = -1
        for i, r in enumerate(reqs):
            sp = r.sampling_params
            temperature[i], top_p[i], min_p[i], top_k[i] = sp.temperature, sp.top_p, sp.min_p, max(sp.top_k, 0)
            presence[i], frequency[i], repetition[i] = sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty
            seeds[i] = r.seed & _SEED_MASK
            if sp.needs_penalties:
                counts = _penalty_counts(r)
                pen_rows.append(np.full(len(counts), i, np.int32))
                pen_tokens.append(np.fromiter(counts.keys(), np.int32, len(counts)))
                pen_counts.append(np.fromiter(counts.values(), np.float32, len(counts)))
            bias = dict(sp.logit_bias)
            if r.num_output_tokens < sp.min_tokens:
                # vLLM's min_tokens: EOS (unless ignored) and the stop ids cannot be sampled yet.
                masked = set(sp.stop_token_ids)
                if r.eos_token_id is not None and not sp.ignore_eos:
                    masked.add(r.eos_token_id)
                bias.update(dict.fromkeys(masked, -np.inf))
            if bias:
                bias_rows += [i] * len(bias)
                bias_tokens += bias.keys()
                bias_values += bias.values()
            if r.output_top_logprobs is not None:
                width = max(width, sp.logprobs)
        if len(prompt_rows):
            width = max(width, max(reqs[i].sampling_params.prompt_logprobs for i in set(prompt_rows.tolist())))
        position = np.zeros(R_b, np.int32)
        position[:R] = seq_lens

        n_pen = sum(len(a) for a in pen_rows)
        Np = 0 if not pen_rows else _bucket(n_pen, 1 << 30, floor=MIN_PENALTY_PAIRS)
        Nb = 0 if not bias_rows else _bucket(len(bias_rows), 1 << 30, floor=MIN_BIAS_ENTRIES)
        cat = (lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype))
        st = SamplingTensors(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, presence_penalty=presence,
            frequency_penalty=frequency, repetition_penalty=repetition,
            seed_lo=(seeds & 0xFFFFFFFF).astype(np.uint32), seed_hi=(seeds >> 32).astype(np.uint32),
            position=position,
            penalty_rows=_padded(cat(pen_rows, np.int32), Np, R_b),
            penalty_tokens=_padded(cat(pen_tokens, np.int32), Np, 0),
            penalty_counts=_padded(cat(pen_counts, np.float32), Np, 0.0),
            bias_rows=_padded(np.asarray(bias_rows, np.int32), Nb, R_b),
            bias_tokens=_padded(np.asarray(bias_tokens, np.int32), Nb, 0),
            bias_values=_padded(np.asarray(bias_values, np.float32), Nb, 0.0))
        sampled = temperature > 0
        flags = SamplerFlags(
            all_greedy=not sampled.any(), penalties=bool(pen_rows), bias=bool(bias_rows),
            top_k_top_p=bool(((top_k > 0) | (top_p < 1.0))[sampled].any()),
            num_logprobs=-1 if width < 0 else _logprobs_width(width))
        return st, flags

    def execute(self, out: SchedulerOutput) -> StepOutput:
        """Run one step; returns the sampled tokens (with logprobs) for ``out.requests``, then
        for ``out.forks``. Block transfers come first: swap-outs read blocks this step may
        reuse, then copy-on-write copies, then swap-ins."""
        self.apply_block_transfers(out)
        b = self.prepare(out)
        sampled, prompt = self._run(b)
        R, P = b.num_rows, len(b.prompt_rows)
        sampled = jax.tree_util.tree_map(lambda a: a[:R], sampled)
        if prompt is not None:
            prompt = jax.tree_util.tree_map(lambda a: a[:P], prompt)
        return StepOutput(sampled, prompt, b.prompt_rows)

    def _run(self, b: StepBatch) -> tuple[SamplerOutput, SamplerOutput | None]:
        """The device part of a step: inputs over, forward (KV donated), sampler, results back."""
        for key in b.program_keys:
            if key not in self.program_keys:
                self.program_keys.add(key)
                logger.debug("compiling step program %s", key)
        inputs, sampling, targets = jax.device_put(
            ((b.input_ids, b.positions, b.md, b.logits_indices), b.sampling, b.prompt_targets))
        self.kv_pages, logits = step_fn(self.model.module, self.model.params, self.kv_pages, *inputs)
        return jax.device_get(sample_fn(logits, sampling, targets, flags=b.flags))

    def precompile(self, sampler_flags: tuple[SamplerFlags, ...] = PRECOMPILED_SAMPLERS) -> int:
        """Compile the forward program of every token bucket and the sampler of every row bucket for
        each of ``sampler_flags``, by running them on all-padding inputs (no KV slot is written), so
        that serving never waits for a compile of these shapes. Returns how many programs that was.

        Only for backends that take full-width block tables: the XLA backend's programs also vary
        with the context and prefill-tile buckets, too many to compile ahead."""
        if self.gathers_pages:
            logger.info("precompile skipped: the %s attention backend's shapes depend on context length",
                        self.model.module.attention_backend)
            return 0
        before = self.num_compiled_programs
        empty = np.zeros(0, np.int32)
        for T_b in self.token_buckets:
            R_b = self.row_bucket(T_b)
            md = AttentionMetadata(slot_mapping=np.full(T_b, PAD_SLOT, np.int32),
                                   block_tables=np.zeros((R_b, self.max_blocks_per_seq), np.int32),
                                   seq_lens=np.zeros(R_b, np.int32), query_start_loc=np.zeros(R_b + 1, np.int32),
                                   tile_row=empty, tile_start=empty, tile_len=empty, tile_size=1)
            sampling, _ = self._sampling_arrays([], empty, R_b, empty)
            for flags in sampler_flags:
                self._run(StepBatch(np.zeros(T_b, np.int32), np.zeros(T_b, np.int32), md, np.zeros(R_b, np.int32),
                                    sampling, empty, empty, 0, flags))
        return self.num_compiled_programs - before

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        P = _bucket(len(pairs), 1 << 30)
        src = np.zeros(P, np.int32)
        dst = np.full(P, -1, np.int32)
        src[:len(pairs)], dst[:len(pairs)] = zip(*pairs)
        self.kv_pages = _copy_blocks(self.kv_pages, src, dst)

    def apply_block_transfers(self, out: SchedulerOutput) -> None:
        """The step's swap-outs, copy-on-write copies and swap-ins, in that order."""
        if out.blocks_to_swap_out:
            self._swap_out(out.blocks_to_swap_out)
        if out.blocks_to_copy:
            self._copy_blocks(out.blocks_to_copy)
        if out.blocks_to_swap_in:
            self._swap_in(out.blocks_to_swap_in)

    def _swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device blocks -> host pages, one batched gather."""
        dev, host = (np.asarray(a, np.int32) for a in zip(*pairs))
        idx = _padded(dev, _bucket(len(dev), 1 << 30), 0)
        blocks = np.asarray(jax.device_get(_gather_blocks(self.kv_pages, idx)))
        self.host_pages[:, :, host] = blocks[:, :, :len(dev)]

    def _swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host pages -> device blocks, one batched scatter into the donated pool."""
        host, dev = (np.asarray(a, np.int32) for a in zip(*pairs))
        P = _bucket(len(dev), 1 << 30)
        blocks = np.zeros(self.host_pages.shape[:2] + (P,) + self.host_pages.shape[3:], self.host_pages.dtype)
        blocks[:, :, :len(dev)] = self.host_pages[:, :, host]
        self.kv_pages = _scatter_blocks(self.kv_pages, blocks, _padded(dev, P, -1))
