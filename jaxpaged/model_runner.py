"""Turns a ``SchedulerOutput`` into padded device arrays and runs one jitted, KV-donating step.

The host side is vectorized numpy over a persistent batch (``SequenceSlots``): every sequence
the runner has seen keeps a slot, a row of per-sequence arrays gathered by slot each step, and
the block tables have a device copy updated by the entries that changed. Per request and step
only the new token ids (prompt chunks) are copied from Python lists. Shapes are padded to
power-of-two buckets (tokens, rows, block-table width, prefill tiles) so the set of compiled
programs stays small and known.

A step is launched (``launch``: inputs over, forward and sampler dispatched, or for plain greedy
rows the forward alone, which takes their argmax; nothing waited for) and collected later
(``collect``: sampled tokens back to the host), so the engine can schedule and launch step k+1
while step k runs. The model reads a decode token sampled by the
previous step straight from that step's device output (``prev_index``), so no host round trip
stands between two steps.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged import parallel
from jaxpaged.request import Request
from jaxpaged.sampler import (SamplerFlags, SamplerOutput, SamplingTensors, argmax, no_logprobs, prompt_logprobs,
                              sample)
from jaxpaged.sampling_params import MAX_LOGPROBS
from jaxpaged.scheduler import SchedulerOutput
from jaxpaged.sequence_slots import SequenceSlots
from jaxpaged.structured_outputs import fill_bitmask
from jaxpaged.models.registry import BuiltModel
from jaxpaged.kernels import AttentionMetadata, PAD_SLOT, build_prefill_tiles, copy_blocks, gathers_pages
from jaxpaged.kernels.kv_ops import gather_blocks, scatter_blocks
from jaxpaged.kernels.metadata import num_prefill_tiles

logger = logging.getLogger(__name__)

PREFILL_TILE = 64
# Bucket floors: padding a small batch up to these costs little and saves compiled programs.
MIN_TOKENS, MIN_CONTEXT, MIN_TILES = 8, 256, 4
# Floors of the compact sampling lists: (row, token) pairs for penalties and for bias/masks,
# and prompt positions scored for prompt logprobs.
MIN_PENALTY_PAIRS, MIN_BIAS_ENTRIES, MIN_PROMPT_POSITIONS = 256, 16, 16
# Device block-table writes: up to a step's row bucket of them go into the step program's inputs (a
# decode step of 256 rows at block size 8 writes ~32 entries); more (sequences getting a device row,
# whose whole tables are written) go first through a program of their own, in chunks padded to 64,
# 256, 1024 or 4096 entries (each size compiled at start-up).
TABLE_WRITE_SIZES = (64, 256, 1024, 4096)
# The row of a padding write: out of range, so the scatter drops it (a negative index would wrap).
_NO_ROW = np.iinfo(np.int32).max
_PAST_IN_FLIGHT = ("a step needs token ids that neither the host nor the previous step's samples hold (the "
                   "engine scheduled past an in-flight step)")
GREEDY = SamplerFlags()
"""Plain greedy sampling (no logprobs, penalties or bias): a one-step batch with these flags and no
prompt logprobs takes its argmax inside the forward program (``_step``), with no sampler program."""
# Sampler variants compiled at start-up: greedy, and plain random sampling (OpenAI's defaults).
PRECOMPILED_SAMPLERS = (GREEDY, SamplerFlags(all_greedy=False))


def _bucket(n: int, cap: int, floor: int = 1) -> int:
    """Smallest power of two >= max(n, floor), clipped to ``cap`` (never below ``n``)."""
    b = 1 << (max(n, floor, 1) - 1).bit_length()
    return max(min(b, cap), n)


@dataclass
class StepBatch:
    """Host arrays of one step, already padded to bucket shapes.

    ``logits_indices`` holds the ``R_b`` sampled rows' last tokens, then the (padded) prompt
    positions whose next-token logprobs were asked for: ``prompt_targets`` are those next tokens,
    ``prompt_rows`` (unpadded) their batch rows. ``prev_index[t] >= 0`` marks a token whose id
    the host does not know yet: it is the previous step's sampled token of that row.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    token_rows: np.ndarray
    """[T_b] each token's row (padding tokens: -1). The step program derives each token's KV slot from
    its row's block table and its position, so a decode step of the same rows sends no slots."""
    md: AttentionMetadata
    """Its ``slot_mapping`` and ``block_tables`` are None: the program derives the one (``token_rows``)
    and reads the rows' tables from the runner's device copy."""
    table_rows: np.ndarray
    """[R_b] each row's row of the device block tables (padding rows: 0)."""
    table_width: int
    """Leading block-table columns the step reads (all of them, or a context bucket)."""
    step_table_writes: np.ndarray
    """``[3, R_b]`` (row, column, block id) writes to the device tables that the step program applies
    before reading them (padding: row ``_NO_ROW``)."""
    table_writes: list[np.ndarray]
    """Padded ``[3, U_b]`` further writes, applied by a program of their own before the step."""
    logits_indices: np.ndarray
    prev_index: np.ndarray
    sampling: SamplingTensors
    prompt_targets: np.ndarray
    prompt_rows: np.ndarray
    num_rows: int
    flags: SamplerFlags
    num_steps: int = 1
    """More than 1: a multi-step decode batch (``SchedulerOutput.num_steps``), one program."""
    row_steps: np.ndarray | None = None
    """[R_b] steps each row of a multi-step batch decodes (padding rows: 0)."""
    packed: "tuple[np.ndarray, _InputLayout] | None" = None
    """The int32 inputs packed in one array and their layout (``_pack_inputs``), once built: the
    arrays above that go into it are views of it when the batch was advanced from the one before."""
    greedy_in_forward: bool = False
    """The forward program samples this batch (``ModelRunner.greedy_in_forward``): no sampler program runs."""
    programs_known: bool = False
    """Its programs (``program_keys``) are known to be in the runner's ``program_keys``: a steady batch
    of the same shapes, flags and steps as the batch before (checking the keys costs ~40 us with the
    host's caches cold: building the key tuples, hashing the sampler flags' dataclass, the lookups)."""

    @property
    def num_logits(self) -> int:
        """Leading ``logits_indices`` entries that matter (the LM head computes only those): the
        sampled rows, or with prompt positions every entry up to the last of them."""
        P = len(self.prompt_rows)
        return self.num_rows if P == 0 else self.sampling.temperature.shape[0] + P

    @property
    def program_keys(self) -> tuple[tuple, ...]:
        """The shapes (and flags) that select the compiled forward and sampler programs."""
        st = self.sampling
        forward = ("forward", self.input_ids.shape[0], self.logits_indices.shape[0], self.table_width,
                   self.md.tile_row.shape[0], self.md.tile_size)
        sampler = ("sampler", self.logits_indices.shape[0], self.prompt_targets.shape[0], self.flags,
                   st.penalty_rows.shape[0], st.bias_rows.shape[0])
        if self.num_steps > 1:      # one program: forward and sampler, stepped
            return (("steps", self.num_steps, forward, sampler),)
        return (forward,) if self.greedy_in_forward else (forward, sampler)


@dataclass
class LaunchedStep:
    """A step dispatched to the device: its sampler outputs are still device arrays."""

    sampled: SamplerOutput
    prompt: SamplerOutput | None
    prompt_rows: np.ndarray
    num_rows: int
    num_steps: int = 1
    """More than 1: ``sampled``'s arrays have a leading step axis."""


@dataclass
class StepOutput:
    """One step's sampler results on the host, trimmed to the batch's rows and prompt positions
    (a multi-step batch's ``sampled`` arrays have a leading step axis)."""

    sampled: SamplerOutput
    prompt: SamplerOutput | None
    prompt_rows: np.ndarray
    """Batch row of each ``prompt`` entry; a row's entries are consecutive prompt positions."""


def _step(statics, layout, param_leaves, kv_pages, packed, tables, prev_tokens=None):
    """The forward of a one-step batch: ``(kv_pages, logits, tables, tokens, prev_tokens)``. When the
    packed ``greedy`` flag is set (``ModelRunner.greedy_in_forward``: every logits row is a sampled
    row) ``tokens`` are the rows' argmax and ``prev_tokens`` them padded to its fixed shape, as
    ``sample_fn`` returns them; otherwise zeros and the ``prev_tokens`` given (the sampler program
    samples)."""
    # The params arrive as a flat tuple (their structure static): flattening SmolLM2's nested dict of
    # 183 arrays cost each jit call 0.1-0.3 ms more than a tuple does. The step's int32 inputs arrive
    # packed in one array (``_pack_inputs``): each host array handed to a jitted call is a transfer
    # of its own, ~5 us each once the device step has evicted the host's caches. The block tables
    # are updated here too (donated): a program of their own cost a dispatch, ~0.06 ms a step at 256 rows.
    input_ids, positions, md, logits_indices, prev_index, num_logits, greedy, tables = _unpack_inputs(
        packed, layout, tables, kv_pages.shape[3])
    params = jax.tree_util.tree_unflatten(statics.tree, param_leaves)
    if prev_tokens is not None:
        input_ids = jnp.where(prev_index >= 0, prev_tokens[jnp.maximum(prev_index, 0)], input_ids)
    else:
        prev_tokens = jnp.zeros(logits_indices.shape[0], jnp.int32)
    logits, kv_pages = statics.module.apply({"params": params}, input_ids, positions, kv_pages, md, logits_indices,
                                            num_logits)
    if getattr(statics.module, "mesh", None) is not None:   # the runner never sets the flag on a mesh
        return kv_pages, logits, tables, jnp.zeros(logits.shape[0], jnp.int32), prev_tokens

    def sampled(logits, prev):
        tokens = argmax(logits)
        n = min(tokens.shape[0], prev.shape[0])   # all of them when greedy (no prompt positions)
        return tokens, jnp.zeros_like(prev).at[:n].set(tokens[:n])

    with jax.named_scope("sampler"):           # benchmarks.profile counts these ops as the sampler's
        tokens, prev_tokens = jax.lax.cond(greedy[0] != 0, sampled,
                                           lambda logits, prev: (jnp.zeros(logits.shape[0], jnp.int32), prev),
                                           logits, prev_tokens)
    return kv_pages, logits, tables, tokens, prev_tokens


_MD_ARRAYS = ("seq_lens", "query_start_loc", "tile_row", "tile_start", "tile_len")


@dataclass(frozen=True)
class _InputLayout:
    """The shapes of a step's int32 inputs in the packed array, in order: input_ids, positions, token_rows,
    the metadata arrays but the KV slots and block tables (``_MD_ARRAYS``), the rows' block-table rows,
    logits_indices, prev_index, num_logits, greedy (1: the forward samples), the block-table writes.
    Static: part of the program's key, with the metadata's tile size and the block-table columns read."""

    shapes: tuple[tuple[int, ...], ...]
    tile_size: int
    table_width: int


def _pack_inputs(input_ids, positions, token_rows, md, logits_indices, table_rows, table_width, prev_index=None,
                 num_logits=None, table_writes=None, greedy=False):
    """The step's int32 inputs as one flat host array, and its layout. The block tables go apart
    (``_unpack_inputs`` applies ``table_writes`` to them, then reads rows ``table_rows``). No
    ``prev_index`` means no in-flight token (all -1), no ``num_logits`` every ``logits_indices``
    entry, no ``table_writes`` none."""
    if prev_index is None:
        prev_index = np.full(np.shape(input_ids), -1, np.int32)
    if num_logits is None:
        num_logits = np.shape(logits_indices)[0]
    if table_writes is None:
        table_writes = np.full((3, 0), _NO_ROW, np.int32)
    arrays = [np.asarray(a, np.int32) for a in (input_ids, positions, token_rows, *(getattr(md, f) for f in _MD_ARRAYS),
                                                  table_rows, logits_indices, prev_index, num_logits,
                                                  np.int32(greedy)[None], table_writes)]
    return (np.concatenate([a.ravel() for a in arrays]),
            _InputLayout(tuple(a.shape for a in arrays), md.tile_size, table_width))


@functools.cache
def _offsets(shapes: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """Where each array of a packed layout starts in the packed array."""
    return tuple(itertools.accumulate((math.prod(shape) for shape in shapes[:-1]), initial=0))


def _replaced(obj, **changes):
    """``dataclasses.replace`` for the step's plain dataclasses without running ``__init__`` again:
    a shallow copy with ``changes``, several times cheaper (a steady decode step makes three)."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__, **changes)
    return new


def _kv_slots(block_tables, rows, positions, block_size: int, valid):
    """Each token's KV slot: its row's block table at its position (block id * block size + offset);
    ``PAD_SLOT`` (nothing written) where not ``valid``."""
    slots = block_tables[jnp.maximum(rows, 0), positions // block_size] * block_size + positions % block_size
    return jnp.where(valid, slots, PAD_SLOT)


def _unpack_inputs(packed, layout: _InputLayout, tables, block_size: int):
    """``_pack_inputs`` undone inside the program: static slices of the packed array, the writes
    applied to ``tables`` (returned), the rows' block tables gathered from them, and each token's KV
    slot looked up in its row's table (``PAD_SLOT`` for padding tokens)."""
    arrays, at = [], 0
    for shape in layout.shapes:
        size = math.prod(shape)
        arrays.append(packed[at:at + size].reshape(shape))
        at += size
    input_ids, positions, token_rows, *md_arrays, table_rows, logits_indices, prev_index, num_logits, greedy, writes = arrays
    tables = _write_tables(tables, writes)
    block_tables = tables[table_rows, :layout.table_width]
    md = AttentionMetadata(**dict(zip(_MD_ARRAYS, md_arrays)),
                           slot_mapping=_kv_slots(block_tables, token_rows, positions, block_size, token_rows >= 0),
                           block_tables=block_tables, tile_size=layout.tile_size)
    return input_ids, positions, md, logits_indices, prev_index, num_logits, greedy, tables


@functools.cache
def _jit_step(mesh):
    """``_step`` jitted for one device mesh (None: one device). On a mesh the shardings are explicit:
    params as placed, KV pages split on the kv-head axis in and out (donated), step inputs
    replicated, and the vocabulary-sharded logits all-gathered (replicated) for the sampler (and the
    greedy tokens)."""
    static, donate = ("statics", "layout"), ("kv_pages", "tables")
    if mesh is None:
        return jax.jit(_step, static_argnames=static, donate_argnames=donate)
    kv, rep = parallel.kv_sharding(mesh), parallel.replicated(mesh)
    return jax.jit(_step, static_argnames=static, donate_argnames=donate,
                   in_shardings=(None, kv, rep, rep, rep), out_shardings=(kv, rep, rep, rep, rep))


def _write_tables(tables, writes):
    """``tables[row, column] = block`` for each ``[3, n]`` write (an out-of-range row: padding, dropped)."""
    return tables.at[writes[0], writes[1]].set(writes[2], mode="drop")


@functools.cache
def _jit_table_writes(mesh):
    """``_write_tables`` jitted for one device mesh (tables donated; replicated on a mesh)."""
    if mesh is None:
        return jax.jit(_write_tables, donate_argnums=0)
    rep = parallel.replicated(mesh)
    return jax.jit(_write_tables, donate_argnums=0, in_shardings=(rep, rep), out_shardings=rep)


def _step_call(module, params, kv_pages, input_ids, positions, md, logits_indices, prev_index=None,
               prev_tokens=None, num_logits=None):
    """The jitted step and its arguments (``md.block_tables`` is the rows' tables, copied: the step
    donates its tables; the rows' tokens are given by ``md.query_start_loc``)."""
    m = StepModel.of(module, params)
    R, W = np.shape(md.block_tables)
    qsl = np.asarray(md.query_start_loc)
    token_rows = _padded(np.repeat(np.arange(R), np.diff(qsl[:R + 1])), np.shape(input_ids)[0], -1)
    packed, layout = _pack_inputs(input_ids, positions, token_rows, md, logits_indices, np.arange(R), W, prev_index,
                                  num_logits)
    return _jit_step(getattr(module, "mesh", None)), (m.statics, layout, m.leaves, kv_pages, packed,
                                                      jnp.array(md.block_tables, jnp.int32), prev_tokens)


def step_fn(*args, **kwargs):
    """``step_fn(module, params, kv_pages, input_ids, positions, md, logits_indices, prev_index=None,
    prev_tokens=None, num_logits=None) -> (kv_pages, logits)``: the model part of the step, forward
    over the ragged batch, KV written in place, logits out. Each token's KV slot is looked up in its
    row's ``md.block_tables`` at its position (``md.slot_mapping`` is not read).

    Module-level (the Flax module is part of a static argument, and carries its device mesh under
    tensor parallelism) so engines with the same model share compiled programs. ``params`` is the
    param tree, or the ``StepModel`` of both (what the runner passes each step).
    """
    fn, call_args = _step_call(*args, **kwargs)
    kv_pages, logits, *_ = fn(*call_args)
    return kv_pages, logits


def _lower_step(*args, **kwargs):
    fn, call_args = _step_call(*args, **kwargs)
    return fn.lower(*call_args)


step_fn.lower = _lower_step


@dataclass(frozen=True, eq=False)
class _StepStatics:
    """The step program's static arguments, the Flax module and the param tree's structure, as one
    object hashed and compared by identity. jit hashes and compares its static arguments on every
    call, and a module's dataclass hash and equality cost 20-50 us each once the device step has
    evicted the host's caches. Interned by ``_step_statics``: equal modules share one."""

    module: Any
    tree: Any


@functools.cache
def _step_statics(module, tree) -> _StepStatics:
    return _StepStatics(module, tree)


@dataclass(frozen=True)
class StepModel:
    """A model as the step program takes it: its param leaves flattened once, and its statics."""

    statics: _StepStatics
    leaves: tuple

    @classmethod
    def of(cls, module, params) -> "StepModel":
        """``module`` with ``params`` (a param tree, or already a ``StepModel``)."""
        if isinstance(params, cls):
            return params
        leaves, tree = jax.tree_util.tree_flatten(params)
        return cls(_step_statics(module, tree), tuple(leaves))


@functools.partial(jax.jit, static_argnames=("flags", "num_token_slots"))
def sample_fn(logits, sampling, prompt_targets, *, flags: SamplerFlags, num_token_slots: int):
    """The sampling part of the step, on the device-resident logits: the sampled rows first, then
    the prompt positions scored for prompt logprobs. A program of its own, so the sampler's
    variants (flags) and the model's (shapes) are compiled independently, not as their product.
    Also returns the sampled tokens padded to ``num_token_slots`` (a fixed shape), which the next
    step's forward reads its in-flight decode tokens from."""
    R = sampling.temperature.shape[0]
    sampled = sample(logits[:R], sampling, flags)
    prompt = (prompt_logprobs(logits[R:], prompt_targets, max(flags.num_logprobs, 0))
              if prompt_targets.shape[0] else None)
    return sampled, prompt, jnp.zeros(num_token_slots, jnp.int32).at[:R].set(sampled.tokens)


def _steps(statics, layout, flags, num_steps, num_token_slots, param_leaves, kv_pages, packed, tables, row_steps,
           prev_tokens, sampling):
    """``num_steps`` decode steps of a batch of one-token rows (each a sequence's next token) in one
    program: each step's forward writes the rows' K/V and samples their next tokens, which are the
    next step's inputs. Row ``r`` runs ``row_steps[r]`` steps (not increasing along the rows), so
    each step computes a prefix of the rows: the rest are padding in it, as the bucket's padding
    rows are (no query, no KV written, no logits). Samples are returned for every step
    (``[num_steps, S]``; a row's samples past its steps are junk), and each row's last valid one in
    the next step's in-flight token array, as ``sample_fn`` does for one step. The same per-step
    arithmetic as ``_step`` then ``sample_fn``: a step of a multi-step batch samples what the one
    step would."""
    bs = kv_pages.shape[3]
    input_ids, positions, md, logits_indices, prev_index, num_logits, _, tables = _unpack_inputs(packed, layout, tables,
                                                                                                 bs)
    params = jax.tree_util.tree_unflatten(statics.tree, param_leaves)
    ids = jnp.where(prev_index >= 0, prev_tokens[jnp.maximum(prev_index, 0)], input_ids)
    T, S = input_ids.shape[0], sampling.temperature.shape[0]
    last = jnp.maximum(row_steps - 1, 0)                  # [R_b]; a decode row's token has its row's index
    tok_last = jnp.zeros(T, jnp.int32).at[:last.shape[0]].set(last)
    tok_steps = jnp.zeros(T, jnp.int32).at[:last.shape[0]].set(row_steps)
    tok_row = jnp.minimum(jnp.arange(T), last.shape[0] - 1)

    def one_step(carry, i):
        kv_pages, ids = carry
        active = jnp.sum(row_steps > i)                   # the leading rows that still step
        pos = positions + jnp.minimum(i, tok_last)
        step_md = dataclasses.replace(md, slot_mapping=_kv_slots(md.block_tables, tok_row, pos, bs, i < tok_steps),
                                      seq_lens=jnp.where(i < row_steps, md.seq_lens + i, 0),
                                      query_start_loc=jnp.minimum(md.query_start_loc, active))
        logits, kv_pages = statics.module.apply({"params": params}, ids, pos, kv_pages, step_md, logits_indices,
                                                jnp.minimum(num_logits, active))
        out = sample(logits[:S], dataclasses.replace(sampling, position=sampling.position + i), flags)
        return (kv_pages, ids.at[:S].set(out.tokens)), out

    (kv_pages, _), sampled = jax.lax.scan(one_step, (kv_pages, ids), jnp.arange(num_steps))
    final = sampled.tokens[last[:S], jnp.arange(S)]
    return kv_pages, sampled, jnp.zeros(num_token_slots, jnp.int32).at[:S].set(final), tables


@functools.cache
def _jit_steps(mesh):
    """``_steps`` jitted for one device mesh, with ``_jit_step``'s shardings."""
    static, donate = ("statics", "layout", "flags", "num_steps", "num_token_slots"), ("kv_pages", "tables")
    if mesh is None:
        return jax.jit(_steps, static_argnames=static, donate_argnames=donate)
    kv, rep = parallel.kv_sharding(mesh), parallel.replicated(mesh)
    return jax.jit(_steps, static_argnames=static, donate_argnames=donate,
                   in_shardings=(None, kv, rep, rep, rep, rep, rep), out_shardings=(kv, rep, rep, rep))


@functools.cache
def _no_logprobs(rows: int) -> tuple[np.ndarray, ...]:
    """``sampler.no_logprobs`` on the host, built once per row count (a greedy step's output takes them)."""
    return no_logprobs(rows, np)


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


def _host_lists(r: Request) -> tuple[tuple[np.ndarray, np.ndarray] | None, dict[int, float]]:
    """A sequence's per-step sampler lists: its penalty (tokens, counts), if it has penalties, and its
    logit bias with the ``min_tokens`` mask."""
    sp = r.sampling_params
    penalties = None
    if sp.needs_penalties:
        counts = _penalty_counts(r)
        penalties = (np.fromiter(counts.keys(), np.int32, len(counts)),
                     np.fromiter(counts.values(), np.float32, len(counts)))
    bias = dict(sp.logit_bias)
    # Tokens before the one this row samples: its own and earlier in-flight ones are placeholders.
    if r.num_output_tokens + r.num_output_placeholders - 1 < sp.min_tokens:
        # vLLM's min_tokens: EOS (unless ignored) and the stop ids cannot be sampled yet.
        masked = set(sp.stop_token_ids)
        if r.eos_token_id is not None and not sp.ignore_eos:
            masked.add(r.eos_token_id)
        bias.update(dict.fromkeys(masked, -np.inf))
    return penalties, bias


def _logprobs_width(n: int) -> int:
    """Top logprobs computed for the batch: none beyond the chosen token's, or the most allowed
    (two variants only: a top-20 costs little more than a top-1)."""
    return 0 if n == 0 else MAX_LOGPROBS


_copy_blocks = jax.jit(copy_blocks, donate_argnums=(0,))
_gather_blocks = jax.jit(gather_blocks)
_scatter_blocks = jax.jit(scatter_blocks, donate_argnums=(0,))


class ModelRunner:
    """Owns the parameters, the global KV page array, the persistent batch and the jitted step."""

    def __init__(self, model: BuiltModel, *, num_blocks: int, block_size: int, dtype: Any,
                 max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 num_host_blocks: int = 0):
        # Under tensor parallelism (the module carries a mesh) params go into their shards and the
        # KV pages are created split on the kv-head axis; otherwise both live on the default device.
        mesh = self._mesh = getattr(model.module, "mesh", None)
        self.model = dataclasses.replace(model, params=parallel.place_params(model.params, mesh))
        self._step_model = StepModel.of(self.model.module, self.model.params)
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.gathers_pages = gathers_pages(model.module.attention_backend)
        self.max_rows = _bucket(max_num_seqs, 1 << 30)
        s = model.shape
        self.vocab_size = s.vocab_size
        kv_shape = (s.num_layers, 2, num_blocks, block_size, s.num_kv_heads, s.head_dim)
        self.kv_pages = (jnp.zeros(kv_shape, dtype) if mesh is None else
                         parallel.zeros(kv_shape, dtype, parallel.kv_sharding(mesh)))
        logger.info("memory per device: %s", parallel.format_memory(self.memory_per_device()))
        # Host page pool for swapped-out blocks (preemption_mode="swap"); zeros are allocated lazily.
        self.host_pages = np.zeros((s.num_layers, 2, num_host_blocks, block_size, s.num_kv_heads, s.head_dim),
                                   self.kv_pages.dtype)
        # A step runs at most ``max_rows`` sequences: the device block tables have a row for each.
        self.slots = SequenceSlots(self.max_blocks_per_seq, num_device_rows=self.max_rows, vocab_size=self.vocab_size)
        table_shape = (self.max_rows, self.max_blocks_per_seq)
        self._tables = (jnp.zeros(table_shape, jnp.int32) if mesh is None else
                        parallel.zeros(table_shape, jnp.int32, parallel.replicated(mesh)))
        # The last launched step's sampled tokens (fixed shape): in-flight decode inputs come from here.
        self._prev_tokens = (jnp.zeros(self.max_rows, jnp.int32) if mesh is None else
                             parallel.zeros((self.max_rows,), jnp.int32, parallel.replicated(mesh)))
        self.program_keys: set[tuple] = set()
        # Read-only row arrays of decode steps: 0, 1, 2, ... and ones (a step has at most one row per token).
        self._iota = np.arange(max_num_batched_tokens + 1, dtype=np.int32)
        self._ones = np.ones(max_num_batched_tokens, np.int32)
        self._iota.flags.writeable = self._ones.flags.writeable = False
        self._sampling_cache: tuple | None = None
        """(slots, S_b, tensors, flags) of the last batch whose sampling inputs can be reused."""
        self._steady: tuple[np.ndarray, StepBatch] | None = None
        """(slots, batch) of the last step if it was a steady decode step (``_next_steady_batch``)."""

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
        """The step's padded host arrays. Also records, for every sequence that samples in this
        step, the row it samples at (the next step's in-flight decode input is read from there)."""
        slots_state = self.slots
        appended = slots_state.update(out.block_table_updates, out.finished_request_ids)
        reqs = out.requests
        children = [c for _, c in out.forks]
        R = len(reqs)
        slots = slots_state.slots(reqs)
        if (self._steady is not None and self._steady[0] is slots and appended and not children
                and not any(out.num_host_tokens) and all(out.samples)):
            return self._next_steady_batch(self._steady[1], slots, out)
        fork_slots = np.fromiter(map(slots_state.slot, children), np.int32, len(children))
        # A multi-step batch is prepared as its first step, a decode step: its rows' steps go along.
        multi = out.num_steps > 1
        T = R if multi else out.total_num_tokens
        # A decode step (one token per row, the common step) takes its row arrays from ``_iota``.
        decode = T == R
        iota = self._iota
        n = self._ones[:R] if decode else np.fromiter(out.num_new_tokens, np.int32, R)
        starts = np.fromiter(out.start_positions, np.int32, R)
        T_b = self.token_bucket(T)
        R_b = self.row_bucket(T_b)
        seq_lens = starts + n
        row_steps = self._row_steps(out, R_b)
        W_b = self._table_width(seq_lens, row_steps)

        qsl = np.full(R_b + 1, T, np.int32)
        qsl[0] = 0
        qsl[1:R + 1] = iota[1:R + 1] if decode else np.cumsum(n)
        row_of_tok = iota[:R] if decode else np.repeat(iota[:R], n)
        positions = np.zeros(T_b, np.int32)
        positions[:T] = starts if decode else iota[:T] - qsl[row_of_tok] + starts[row_of_tok]
        input_ids, prev_index = self._token_ids(reqs, slots, starts, n, out.num_host_tokens, qsl, T_b)
        table_rows = _padded(slots_state.device_rows(slots), R_b, 0)
        token_rows = _padded(row_of_tok, T_b, -1)
        seq_lens_b = _padded(seq_lens, R_b, 0)
        if self.gathers_pages:
            tile = min(PREFILL_TILE, T_b)
            n_tiles = num_prefill_tiles(qsl, tile)
            P_b = 0 if n_tiles == 0 else _bucket(n_tiles, 1 << 30, floor=MIN_TILES)
            tile_row, tile_start, tile_len = build_prefill_tiles(qsl, tile, P_b)
        else:
            tile, (tile_row, tile_start, tile_len) = 1, (np.zeros(0, np.int32),) * 3
        md = AttentionMetadata(slot_mapping=None, block_tables=None, seq_lens=seq_lens_b,
                               query_start_loc=qsl, tile_row=tile_row, tile_start=tile_start,
                               tile_len=tile_len, tile_size=tile)
        prompt_idx, prompt_targets, prompt_rows = self._prompt_logprob_positions(
            reqs, np.flatnonzero(slots_state.prompt_logprobs[slots]).tolist(), starts, n, qsl)
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
        prompt_widths = [reqs[i].sampling_params.prompt_logprobs for i in set(prompt_rows.tolist())]
        sampling, flags = self._sampling_inputs(reqs + children, np.concatenate([slots, fork_slots]) if children else slots,
                                                np.concatenate([seq_lens, seq_lens[fork_rows]]), S_b, prompt_widths)
        if all(out.samples):
            slots_state.last_sample_row[slots] = iota[:R]
        else:
            samples = np.fromiter(out.samples, bool, R)
            slots_state.last_sample_row[slots[samples]] = np.flatnonzero(samples)
        slots_state.last_sample_row[fork_slots] = np.arange(R, S, dtype=np.int32)
        step_writes = np.empty((3, R_b), np.int32)
        table_writes = self._table_writes(step_writes)
        b = StepBatch(input_ids, positions, token_rows, md, table_rows, W_b, step_writes, table_writes, logits_indices,
                      prev_index, sampling, targets, prompt_rows, S, flags, out.num_steps, row_steps,
                      greedy_in_forward=self.greedy_in_forward(flags, out.num_steps, NP_b))
        # A decode step of in-flight tokens whose rows sample at their own indices: the next step of
        # the same sequences reads its tokens where this one samples them.
        steady = (decode and not children and not NP and all(out.samples)
                  and np.array_equal(prev_index[:R], iota[:R]))
        self._steady = (slots, b) if steady else None
        return b

    def _next_steady_batch(self, last: StepBatch, slots: np.ndarray, out: SchedulerOutput) -> StepBatch:
        """The step after a steady decode step ``last`` of the same sequences, all its tokens in
        flight, every block-table change since an appended block: the rows' layout (query starts,
        logits rows, in-flight token rows, table rows, prompt positions: none) is ``last``'s, and each
        row's position moved by the tokens it computed in ``last`` (1, or its steps in a group). So
        the packed inputs are ``last``'s with positions and sequence lengths advanced by that much
        (the program looks each token's KV slot up in its row's table, so a row entering a new block
        costs the host nothing) and this step's table writes: ~10 numpy operations instead of ~65
        (each costs 10-50 us once the device step has evicted the host's caches, measured).
        ``last_sample_row`` already holds each row's own index.
        Either step may be a multi-step group (prepared as its first decode step, its rows' steps
        going along)."""
        R, T_b, R_b = len(slots), last.input_ids.shape[0], last.table_rows.shape[0]
        packed, layout = self._packed_inputs(last)
        _, at_pos, _, at_len, *_, at_greedy, at_writes = _offsets(layout.shapes)
        moved = 1 if last.num_steps == 1 else last.row_steps[:R]
        packed = packed.copy()
        for at in (at_pos, at_len):
            packed[at:at + R] += moved
        seq_lens = packed[at_len:at_len + R_b]
        step_writes = packed[at_writes:at_writes + 3 * R_b].reshape(3, R_b)
        table_writes = self._table_writes(step_writes)
        row_steps = self._row_steps(out, R_b)
        width = self._table_width(seq_lens[:R], row_steps)
        if width != layout.table_width:
            layout = _InputLayout(layout.shapes, layout.tile_size, width)
        sampling, flags = self._sampling_inputs(out.requests, slots, seq_lens, last.sampling.temperature.shape[0], [])
        md = _replaced(last.md, seq_lens=seq_lens)
        # The programs' keys are the last batch's but for these (its penalty and bias lists may change).
        same_programs = (width == last.table_width and flags is last.flags and out.num_steps == last.num_steps
                         and sampling.penalty_rows.shape == last.sampling.penalty_rows.shape
                         and sampling.bias_rows.shape == last.sampling.bias_rows.shape)
        greedy = self.greedy_in_forward(flags, out.num_steps, 0)
        packed[at_greedy] = greedy
        b = _replaced(last, positions=packed[at_pos:at_pos + T_b], md=md, table_width=width,
                      step_table_writes=step_writes, table_writes=table_writes, sampling=sampling, flags=flags,
                      num_steps=out.num_steps, row_steps=row_steps, packed=(packed, layout), greedy_in_forward=greedy,
                      programs_known=last.programs_known and same_programs)
        self._steady = (slots, b)
        return b

    def greedy_in_forward(self, flags: SamplerFlags, num_steps: int, num_prompt_positions: int) -> bool:
        """Whether the forward program samples a batch (``StepBatch.greedy_in_forward``): one step of plain
        greedy rows (``GREEDY``), no prompt positions, one device. No sampler program runs then: its
        launch cost the host ~0.12 ms a step at 64-256 rows, measured (under tensor parallelism the
        argmax would gather the vocabulary-split logits a second time)."""
        return self._mesh is None and num_steps == 1 and not num_prompt_positions and flags == GREEDY

    @staticmethod
    def _row_steps(out: SchedulerOutput, R_b: int) -> np.ndarray | None:
        """``StepBatch.row_steps`` of a multi-step batch (None for one step)."""
        if out.num_steps == 1:
            return None
        return _padded(np.fromiter(out.num_new_tokens, np.int32, len(out.requests)), R_b, 0)

    def _table_width(self, seq_lens: np.ndarray, row_steps: np.ndarray | None = None) -> int:
        """Block-table columns a step reads for sequences of ``seq_lens`` tokens (a multi-step batch's
        rows growing by their ``row_steps`` - 1 more)."""
        if not self.gathers_pages:
            return self.max_blocks_per_seq
        longest = int(seq_lens.max()) + (0 if row_steps is None else int(row_steps.max()) - 1)
        return _bucket(-(-longest // self.block_size), self.max_blocks_per_seq, floor=MIN_CONTEXT // self.block_size)

    def _table_writes(self, step: np.ndarray) -> list[np.ndarray]:
        """The queued device block-table writes: up to ``size`` of them into ``step`` (``[3, size]``, for
        the step program; the rest of it padding), the others in padded chunks, returned (for the
        table-write program). Each entry is written once, so the order the two programs apply them in
        does not matter."""
        step.fill(_NO_ROW)
        writes = self.slots.take_table_writes()
        if writes is None:
            return []
        size = step.shape[1]
        n = min(size, writes.shape[1])
        step[:, :n] = writes[:, :n]
        writes = writes[:, n:]
        chunks, largest = [], TABLE_WRITE_SIZES[-1]
        for at in range(0, writes.shape[1], largest):
            part = writes[:, at:at + largest]
            chunk = np.full((3, next(u for u in TABLE_WRITE_SIZES if u >= part.shape[1])), _NO_ROW, np.int32)
            chunk[:, :part.shape[1]] = part
            chunks.append(chunk)
        return chunks

    def _token_ids(self, reqs: list[Request], slots: np.ndarray, starts: np.ndarray, n: np.ndarray,
                   host_n: list[int], qsl: np.ndarray, T_b: int) -> tuple[np.ndarray, np.ndarray]:
        """``input_ids`` of the step (the host's part of each row's span, its first ``host_n``
        tokens), and ``prev_index``: the row's last token, if its id is still on the device, is the
        previous step's sample at that row."""
        input_ids = np.zeros(T_b, np.int32)
        R = len(n)
        prev_index = np.full(T_b, -1, np.int32)
        if not any(host_n):
            # Every row's tokens are in flight (a steady decode batch): one each, the last sample.
            src = self.slots.last_sample_row[slots]
            if n.sum() > R or (src < 0).any():
                raise RuntimeError(_PAST_IN_FLIGHT)
            prev_index[qsl[1:R + 1] - 1] = src
            return input_ids, prev_index
        host_n = np.fromiter(host_n, np.int32, R)
        rows = np.flatnonzero(host_n)
        H = int(host_n.sum())
        if H:
            k = host_n[rows]
            flat = np.fromiter(itertools.chain.from_iterable(
                reqs[i].token_ids_slice(s, s + c) for i, s, c in zip(rows.tolist(), starts[rows].tolist(), k.tolist())),
                np.int32, H)
            within = np.arange(H) - np.repeat(np.cumsum(k) - k, k)
            input_ids[np.repeat(qsl[rows], k) + within] = flat
        pending = np.flatnonzero(host_n < n)
        if len(pending):
            src = self.slots.last_sample_row[slots[pending]]
            if (n[pending] - host_n[pending] > 1).any() or (src < 0).any():
                raise RuntimeError(_PAST_IN_FLIGHT)
            prev_index[qsl[pending + 1] - 1] = src
        return input_ids, prev_index

    @staticmethod
    def _prompt_logprob_positions(reqs: list[Request], rows: list[int], starts: np.ndarray, n: np.ndarray,
                                  qsl: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flat token indices, next prompt tokens and rows of the prompt positions still to score,
        among ``rows`` (the rows of requests that score their prompt).

        Position ``p`` scores ``prompt[p + 1]``. Positions already scored (``len(prompt_logprobs) - 1``
        of them) are skipped, so a recomputed (preempted) prompt is not scored twice.
        """
        idx, targets, out_rows = [], [], []
        for i in rows:
            r = reqs[i]
            s = int(starts[i])
            lo, hi = max(s, len(r.prompt_logprobs) - 1), min(s + int(n[i]), r.num_prompt_tokens - 1)
            if lo >= hi:
                continue
            idx.append(np.arange(lo, hi, dtype=np.int32) - s + qsl[i])
            targets.append(np.asarray(r.prompt_token_ids[lo + 1:hi + 1], np.int32))
            out_rows.append(np.full(hi - lo, i, np.int32))
        if not idx:
            return (np.zeros(0, np.int32),) * 3
        return np.concatenate(idx), np.concatenate(targets), np.concatenate(out_rows)

    def _sampling_inputs(self, seqs: list[Request], slots: np.ndarray, positions: np.ndarray, S_b: int,
                         prompt_widths: list[int]) -> tuple[SamplingTensors, SamplerFlags]:
        """``_sampling_tensors``, or for a batch of the same sequences as the previous one (the same
        slot array: ``SequenceSlots.slots`` reuses it) whose parameters are fixed (no per-step
        penalty, bias or min_tokens lists) the previous tensors with the new positions."""
        cached = self._sampling_cache
        if cached is not None and cached[0] is slots and cached[1] == S_b and not prompt_widths:
            position = positions if len(positions) == S_b else _padded(positions, S_b, 0)
            return _replaced(cached[2], position=position), cached[3]
        sampling, flags = self._sampling_tensors(seqs, slots, positions, S_b, prompt_widths)
        fixed = not prompt_widths and not self.slots.needs_host_lists[slots].any()
        self._sampling_cache = (slots, S_b, sampling, flags) if fixed else None
        return sampling, flags

    def _sampling_tensors(self, seqs: list[Request], slots: np.ndarray, positions: np.ndarray, S_b: int,
                          prompt_widths: list[int]) -> tuple[SamplingTensors, SamplerFlags]:
        """Per-row parameters gathered from the sequences' slots, the compact penalty and bias lists
        and the grammar bitmask (built only for the sequences that have them), and the flags of the
        batch. A sequence whose lists fail to build goes to ``SequenceSlots.failed`` (one request's
        failure, not the step's)."""
        st = self.slots
        f32 = np.float32
        pen_rows, pen_tokens, pen_counts = [], [], []
        bias_rows, bias_tokens, bias_values = [], [], []
        constrained = []
        for i in np.flatnonzero(st.needs_host_lists[slots]).tolist():
            r = seqs[i]
            try:
                penalties, bias = _host_lists(r)
            except Exception as e:      # this request's failure: its row runs without its lists
                st.failed[r.request_id] = e
                continue
            if r.grammar is not None:
                constrained.append((r.grammar, i))
            if penalties is not None:
                tokens, counts = penalties
                pen_rows.append(np.full(len(tokens), i, np.int32))
                pen_tokens.append(tokens)
                pen_counts.append(counts)
            if bias:
                bias_rows += [i] * len(bias)
                bias_tokens += bias.keys()
                bias_values += bias.values()
        width = max([int(st.logprobs[slots].max(initial=-1)), *prompt_widths])
        n_pen = sum(len(a) for a in pen_rows)
        Np = 0 if not pen_rows else _bucket(n_pen, 1 << 30, floor=MIN_PENALTY_PAIRS)
        Nb = 0 if not bias_rows else _bucket(len(bias_rows), 1 << 30, floor=MIN_BIAS_ENTRIES)
        cat = (lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype))
        seeds = _padded(st.seed[slots], S_b, 0)
        temperature, top_k, top_p = (_padded(st.temperature[slots], S_b, 0.0), _padded(st.top_k[slots], S_b, 0),
                                     _padded(st.top_p[slots], S_b, 1.0))
        sampling = SamplingTensors(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=_padded(st.min_p[slots], S_b, 0.0),
            presence_penalty=_padded(st.presence[slots], S_b, 0.0),
            frequency_penalty=_padded(st.frequency[slots], S_b, 0.0),
            repetition_penalty=_padded(st.repetition[slots], S_b, 1.0),
            seed_lo=(seeds & 0xFFFFFFFF).astype(np.uint32), seed_hi=(seeds >> 32).astype(np.uint32),
            position=_padded(positions, S_b, 0),
            penalty_rows=_padded(cat(pen_rows, np.int32), Np, S_b),
            penalty_tokens=_padded(cat(pen_tokens, np.int32), Np, 0),
            penalty_counts=_padded(cat(pen_counts, f32), Np, 0.0),
            bias_rows=_padded(np.asarray(bias_rows, np.int32), Nb, S_b),
            bias_tokens=_padded(np.asarray(bias_tokens, np.int32), Nb, 0),
            bias_values=_padded(np.asarray(bias_values, f32), Nb, 0.0))
        if constrained:
            sampling.allowed = fill_bitmask(constrained, S_b, self.vocab_size)
        sampled = temperature > 0
        flags = SamplerFlags(
            all_greedy=not sampled.any(), penalties=bool(pen_rows), bias=bool(bias_rows),
            top_k_top_p=bool(((top_k > 0) | (top_p < 1.0))[sampled].any()),
            chosen_logprobs=bool(st.chosen_logprobs[slots].any()),
            num_logprobs=-1 if width < 0 else _logprobs_width(width), bitmask=bool(constrained))
        return sampling, flags

    def launch(self, out: SchedulerOutput) -> LaunchedStep | None:
        """Apply the step's block transfers and dispatch its programs without waiting for them;
        None if no request runs. Block transfers come first: swap-outs read blocks this step may
        reuse, then copy-on-write copies, then swap-ins."""
        self.apply_block_transfers(out)
        if out.is_empty:
            self.slots.update(out.block_table_updates, out.finished_request_ids)
            return None
        return self.run_batch(self.prepare(out))

    def run_batch(self, b: StepBatch) -> LaunchedStep:
        """The device part of a step: inputs over, forward (KV donated), sampler; not waited for."""
        if not b.programs_known:
            for key in b.program_keys:
                if key not in self.program_keys:
                    self.program_keys.add(key)
                    logger.debug("compiling step program %s", key)
            b.programs_known = True
        # Host arrays go straight into the jitted calls: their C++ dispatch copies them to the device
        # several times faster than a jax.device_put of the tree.
        self._write_tables(b.table_writes)
        if b.num_steps > 1:
            m = self._step_model
            packed, layout = self._packed_inputs(b)
            self.kv_pages, sampled, self._prev_tokens, self._tables = _jit_steps(self._mesh)(
                m.statics, layout, b.flags, b.num_steps, self.max_rows, m.leaves, self.kv_pages, packed, self._tables,
                b.row_steps, self._prev_tokens, b.sampling)
            return LaunchedStep(sampled, None, b.prompt_rows, b.num_rows, b.num_steps)
        logits, tokens, prev_tokens = self.forward(b)
        if b.greedy_in_forward:
            self._prev_tokens = prev_tokens
            return LaunchedStep(SamplerOutput(tokens, *_no_logprobs(tokens.shape[0])), None, b.prompt_rows, b.num_rows)
        sampled, prompt, self._prev_tokens = sample_fn(logits, b.sampling, b.prompt_targets, flags=b.flags,
                                                       num_token_slots=self.max_rows)
        return LaunchedStep(sampled, prompt, b.prompt_rows, b.num_rows)

    @staticmethod
    def _packed_inputs(b: StepBatch) -> tuple[np.ndarray, _InputLayout]:
        """``b.packed``, built on first use."""
        if b.packed is None:
            b.packed = _pack_inputs(b.input_ids, b.positions, b.token_rows, b.md, b.logits_indices, b.table_rows,
                                    b.table_width, b.prev_index, np.int32(b.num_logits), b.step_table_writes,
                                    b.greedy_in_forward)
        return b.packed

    def forward(self, b: StepBatch) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Dispatch the forward program of a one-step batch (its ``table_writes`` must be applied
        before, as ``run_batch`` does), keep its KV pages and tables; its logits, and its sampled
        tokens and their fixed-shape copy if ``b.greedy_in_forward`` (else zeros and the previous
        ones), not waited for."""
        forward, args = self.forward_program(b)
        self.kv_pages, logits, self._tables, tokens, prev_tokens = forward(*args)
        return logits, tokens, prev_tokens

    def forward_program(self, b: StepBatch) -> tuple[Any, tuple]:
        """The jitted forward program of a one-step batch and its arguments, as ``forward`` calls it
        (``-> (kv_pages, logits, tables, tokens, prev_tokens)``, KV pages and tables donated; the
        batch's ``table_writes`` must be applied first)."""
        m = self._step_model
        packed, layout = self._packed_inputs(b)
        return _jit_step(self._mesh), (m.statics, layout, m.leaves, self.kv_pages, packed, self._tables,
                                       self._prev_tokens)

    def _write_tables(self, chunks: list[np.ndarray]) -> None:
        """Apply padded block-table writes to the device tables (donated: updated in place)."""
        for chunk in chunks:
            self._tables = _jit_table_writes(self._mesh)(self._tables, chunk)

    @staticmethod
    def collect(step: LaunchedStep) -> StepOutput:
        """Wait for a launched step; its samples (for the requests, then the forks) on the host."""
        # np.asarray waits for each array and reads it (on CPU a zero-copy view); jax.device_get's
        # asynchronous-copy machinery cost ~20 us per array.
        R, P = step.num_rows, len(step.prompt_rows)
        rows = np.s_[:, :R] if step.num_steps > 1 else np.s_[:R]
        sampled = jax.tree_util.tree_map(lambda a: np.asarray(a)[rows], step.sampled)
        prompt = None if step.prompt is None else jax.tree_util.tree_map(lambda a: np.asarray(a)[:P], step.prompt)
        return StepOutput(sampled, prompt, step.prompt_rows)

    def execute(self, out: SchedulerOutput) -> StepOutput | None:
        """Run one step and wait for it (``launch`` then ``collect``)."""
        step = self.launch(out)
        return None if step is None else self.collect(step)

    def precompile(self, sampler_flags: tuple[SamplerFlags, ...] = PRECOMPILED_SAMPLERS, num_steps: int = 1) -> int:
        """Compile the forward program of every token bucket and the sampler of every row bucket for
        each of ``sampler_flags`` but plain greedy, which the forward samples (with ``num_steps`` > 1
        also the multi-step program of every bucket a decode batch can use), by running them on
        all-padding inputs (no KV slot is written), so that serving never waits for a compile of these
        shapes. Returns how many programs that was.

        Only for backends that take full-width block tables: the XLA backend's programs also vary
        with the context and prefill-tile buckets, too many to compile ahead."""
        if self.gathers_pages:
            logger.info("precompile skipped: the %s attention backend's shapes depend on context length",
                        self.model.module.attention_backend)
            return 0
        before = self.num_compiled_programs
        self._write_tables([np.full((3, u), _NO_ROW, np.int32) for u in TABLE_WRITE_SIZES])
        empty = np.zeros(0, np.int32)
        for T_b in self.token_buckets:
            R_b = self.row_bucket(T_b)
            md = AttentionMetadata(slot_mapping=None, block_tables=None,
                                   seq_lens=np.zeros(R_b, np.int32), query_start_loc=np.zeros(R_b + 1, np.int32),
                                   tile_row=empty, tile_start=empty, tile_len=empty, tile_size=1)
            sampling, _ = self._sampling_tensors([], empty, empty, R_b, [])
            for flags in sampler_flags:
                batch = StepBatch(np.zeros(T_b, np.int32), np.zeros(T_b, np.int32), np.full(T_b, -1, np.int32), md,
                                  np.zeros(R_b, np.int32), self.max_blocks_per_seq,
                                  np.full((3, R_b), _NO_ROW, np.int32), [],
                                  np.zeros(R_b, np.int32), np.full(T_b, -1, np.int32),
                                  sampling, empty, empty, 0, flags,
                                  greedy_in_forward=self.greedy_in_forward(flags, 1, 0))
                self.collect(self.run_batch(batch))
                if num_steps > 1 and T_b <= self.token_bucket(self.max_num_seqs):
                    self.collect(self.run_batch(dataclasses.replace(batch, num_steps=num_steps, programs_known=False,
                                                                    row_steps=np.zeros(R_b, np.int32),
                                                                    greedy_in_forward=False)))
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
