"""The jitted device programs of a step, and the packing of their int32 inputs.

``_step`` (the forward of a one-step batch, which may take the argmax of plain greedy rows),
``sample_fn`` (the sampler, a program of its own), ``_steps`` (a multi-step decode group in one
program), the block-table writes and the KV block copies. Each is jitted once per device mesh
(``jit_step``, ...) and keyed by its static arguments, so engines with the same model share them.
``step_fn`` is the forward alone as a plain function, for research code and tests.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged import parallel
from jaxpaged.kernels import AttentionMetadata, PAD_SLOT, copy_blocks
from jaxpaged.kernels.kv_ops import gather_blocks, scatter_blocks
from jaxpaged.sampler import SamplerFlags, argmax, prompt_logprobs, sample
from jaxpaged.step_batch import InputLayout, StepBatch

NO_ROW = np.iinfo(np.int32).max
"""The row of a padding block-table write: out of range, so the scatter drops it (a negative index would wrap)."""


def _step(statics, layout, param_leaves, kv_pages, packed, tables, prev_tokens=None):
    """The forward of a one-step batch: ``(kv_pages, logits, tables, tokens, prev_tokens)``. When the
    packed ``greedy`` flag is set (``BatchBuilder.greedy_in_forward``: every logits row is a sampled
    row) ``tokens`` are the rows' argmax and ``prev_tokens`` them padded to its fixed shape, as
    ``sample_fn`` returns them; otherwise zeros and the ``prev_tokens`` given (the sampler program
    samples)."""
    # Params arrive as a flat tuple (structure static): jit flattens a tuple faster than a nested dict.
    # The int32 inputs arrive packed in one array (``pack_inputs``): each host array is a transfer of its own.
    # The block tables are written here too (donated): a program of their own would cost a dispatch a step.
    input_ids, positions, md, logits_indices, prev_index, num_logits, greedy, tables = unpack_inputs(
        packed, layout, tables, kv_pages.shape[3]
    )
    params = jax.tree_util.tree_unflatten(statics.tree, param_leaves)
    if prev_tokens is not None:
        input_ids = jnp.where(prev_index >= 0, prev_tokens[jnp.maximum(prev_index, 0)], input_ids)
    else:
        prev_tokens = jnp.zeros(logits_indices.shape[0], jnp.int32)
    logits, kv_pages = statics.module.apply(
        {"params": params}, input_ids, positions, kv_pages, md, logits_indices, num_logits
    )
    if getattr(statics.module, "mesh", None) is not None:  # the runner never sets the flag on a mesh
        return kv_pages, logits, tables, jnp.zeros(logits.shape[0], jnp.int32), prev_tokens

    def sampled(logits, prev):
        tokens = argmax(logits)
        n = min(tokens.shape[0], prev.shape[0])  # all of them when greedy (no prompt positions)
        return tokens, jnp.zeros_like(prev).at[:n].set(tokens[:n])

    with jax.named_scope("sampler"):  # benchmarks.profile counts these ops as the sampler's
        tokens, prev_tokens = jax.lax.cond(
            greedy[0] != 0,
            sampled,
            lambda logits, prev: (jnp.zeros(logits.shape[0], jnp.int32), prev),
            logits,
            prev_tokens,
        )
    return kv_pages, logits, tables, tokens, prev_tokens


MD_ARRAYS = ("seq_lens", "query_start_loc", "tile_row", "tile_start", "tile_len")


def pack_inputs(
    input_ids,
    positions,
    token_rows,
    md,
    logits_indices,
    table_rows,
    table_width,
    prev_index=None,
    num_logits=None,
    table_writes=None,
    greedy=False,
):
    """The step's int32 inputs as one flat host array, and its layout. The block tables go apart
    (``unpack_inputs`` applies ``table_writes`` to them, then reads rows ``table_rows``). No
    ``prev_index`` means no in-flight token (all -1), no ``num_logits`` every ``logits_indices``
    entry, no ``table_writes`` none."""
    if prev_index is None:
        prev_index = np.full(np.shape(input_ids), -1, np.int32)
    if num_logits is None:
        num_logits = np.shape(logits_indices)[0]
    if table_writes is None:
        table_writes = np.full((3, 0), NO_ROW, np.int32)
    arrays = [
        np.asarray(a, np.int32)
        for a in (
            input_ids,
            positions,
            token_rows,
            *(getattr(md, f) for f in MD_ARRAYS),
            table_rows,
            logits_indices,
            prev_index,
            num_logits,
            np.int32(greedy)[None],
            table_writes,
        )
    ]
    return (
        np.concatenate([a.ravel() for a in arrays]),
        InputLayout(tuple(a.shape for a in arrays), md.tile_size, table_width),
    )


def packed_inputs(b: StepBatch) -> tuple[np.ndarray, InputLayout]:
    """``b.packed``: the batch's int32 inputs packed (``pack_inputs``), built on first use."""
    if b.packed is None:
        b.packed = pack_inputs(
            b.input_ids,
            b.positions,
            b.token_rows,
            b.md,
            b.logits_indices,
            b.table_rows,
            b.table_width,
            b.prev_index,
            np.int32(b.num_logits),
            b.step_table_writes,
            b.greedy_in_forward,
        )
    return b.packed


@functools.cache
def packed_offsets(shapes: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """Where each array of a packed layout starts in the packed array."""
    return tuple(itertools.accumulate((math.prod(shape) for shape in shapes[:-1]), initial=0))


def _kv_slots(block_tables, rows, positions, block_size: int, valid):
    """Each token's KV slot: its row's block table at its position (block id * block size + offset);
    ``PAD_SLOT`` (nothing written) where not ``valid``."""
    slots = block_tables[jnp.maximum(rows, 0), positions // block_size] * block_size + positions % block_size
    return jnp.where(valid, slots, PAD_SLOT)


def unpack_inputs(packed, layout: InputLayout, tables, block_size: int):
    """``pack_inputs`` undone inside the program: static slices of the packed array, the writes
    applied to ``tables`` (returned), the rows' block tables gathered from them, and each token's KV
    slot looked up in its row's table (``PAD_SLOT`` for padding tokens)."""
    arrays, at = [], 0
    for shape in layout.shapes:
        size = math.prod(shape)
        arrays.append(packed[at : at + size].reshape(shape))
        at += size
    (
        input_ids,
        positions,
        token_rows,
        *md_arrays,
        table_rows,
        logits_indices,
        prev_index,
        num_logits,
        greedy,
        writes,
    ) = arrays
    tables = _write_tables(tables, writes)
    block_tables = tables[table_rows, : layout.table_width]
    md = AttentionMetadata(
        **dict(zip(MD_ARRAYS, md_arrays)),
        slot_mapping=_kv_slots(block_tables, token_rows, positions, block_size, token_rows >= 0),
        block_tables=block_tables,
        tile_size=layout.tile_size,
    )
    return input_ids, positions, md, logits_indices, prev_index, num_logits, greedy, tables


@functools.cache
def jit_step(mesh):
    """``_step`` jitted for one device mesh (None: one device). On a mesh the shardings are explicit:
    params as placed, KV pages split on the kv-head axis in and out (donated), step inputs
    replicated, and the vocabulary-sharded logits all-gathered (replicated) for the sampler (and the
    greedy tokens)."""
    static, donate = ("statics", "layout"), ("kv_pages", "tables")
    if mesh is None:
        return jax.jit(_step, static_argnames=static, donate_argnames=donate)
    kv, rep = parallel.kv_sharding(mesh), parallel.replicated(mesh)
    return jax.jit(
        _step,
        static_argnames=static,
        donate_argnames=donate,
        in_shardings=(None, kv, rep, rep, rep),
        out_shardings=(kv, rep, rep, rep, rep),
    )


def _write_tables(tables, writes):
    """``tables[row, column] = block`` for each ``[3, n]`` write (an out-of-range row: padding, dropped)."""
    return tables.at[writes[0], writes[1]].set(writes[2], mode="drop")


@functools.cache
def jit_table_writes(mesh):
    """``_write_tables`` jitted for one device mesh (tables donated; replicated on a mesh)."""
    if mesh is None:
        return jax.jit(_write_tables, donate_argnums=0)
    rep = parallel.replicated(mesh)
    return jax.jit(_write_tables, donate_argnums=0, in_shardings=(rep, rep), out_shardings=rep)


def step_call(
    module,
    params,
    kv_pages,
    input_ids,
    positions,
    md,
    logits_indices,
    prev_index=None,
    prev_tokens=None,
    num_logits=None,
):
    """``step_fn``'s jitted program and its arguments, for code that inspects it (``fn.lower(*args)``
    gives its HLO) rather than runs it: takes ``step_fn``'s arguments (``md.block_tables`` is the
    rows' tables, copied: the step donates its tables; the rows' tokens are given by
    ``md.query_start_loc``); ``fn(*args) -> (kv_pages, logits, tables, tokens, prev_tokens)``."""
    m = StepModel.of(module, params)
    R, W = np.shape(md.block_tables)
    qsl = np.asarray(md.query_start_loc)
    token_rows = np.full(np.shape(input_ids)[0], -1, np.int32)
    row_of_tok = np.repeat(np.arange(R), np.diff(qsl[: R + 1]))
    token_rows[: len(row_of_tok)] = row_of_tok
    packed, layout = pack_inputs(
        input_ids, positions, token_rows, md, logits_indices, np.arange(R), W, prev_index, num_logits
    )
    return jit_step(getattr(module, "mesh", None)), (
        m.statics,
        layout,
        m.leaves,
        kv_pages,
        packed,
        jnp.array(md.block_tables, jnp.int32),
        prev_tokens,
    )


def step_fn(*args, **kwargs):
    """``step_fn(module, params, kv_pages, input_ids, positions, md, logits_indices, prev_index=None,
    prev_tokens=None, num_logits=None) -> (kv_pages, logits)``: the model part of the step, forward
    over the ragged batch, KV written in place, logits out. Each token's KV slot is looked up in its
    row's ``md.block_tables`` at its position (``md.slot_mapping`` is not read).

    Module-level (the Flax module is part of a static argument, and carries its device mesh under
    tensor parallelism) so engines with the same model share compiled programs. ``params`` is the
    param tree, or the ``StepModel`` of both (what the runner passes each step).
    """
    fn, call_args = step_call(*args, **kwargs)
    kv_pages, logits, *_ = fn(*call_args)
    return kv_pages, logits


@dataclass(frozen=True, eq=False)
class _StepStatics:
    """The step program's static arguments, the Flax module and the param tree's structure, as one
    object hashed and compared by identity: jit hashes and compares its static arguments on every
    call, and a module's dataclass hash and equality are slow. Interned by ``_step_statics``: equal
    modules share one."""

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
    prompt = (
        prompt_logprobs(logits[R:], prompt_targets, max(flags.num_logprobs, 0))
        if prompt_targets.shape[0]
        else None
    )
    # Speculative decoding's verifying rows come after every row a later step may read from: not kept.
    n = min(R, num_token_slots)
    return sampled, prompt, jnp.zeros(num_token_slots, jnp.int32).at[:n].set(sampled.tokens[:n])


def _steps(
    statics,
    layout,
    flags,
    num_steps,
    num_token_slots,
    param_leaves,
    kv_pages,
    packed,
    tables,
    row_steps,
    prev_tokens,
    sampling,
):
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
    input_ids, positions, md, logits_indices, prev_index, num_logits, _, tables = unpack_inputs(
        packed, layout, tables, bs
    )
    params = jax.tree_util.tree_unflatten(statics.tree, param_leaves)
    ids = jnp.where(prev_index >= 0, prev_tokens[jnp.maximum(prev_index, 0)], input_ids)
    T, S = input_ids.shape[0], sampling.temperature.shape[0]
    last = jnp.maximum(row_steps - 1, 0)  # [R_b]; a decode row's token has its row's index
    tok_last = jnp.zeros(T, jnp.int32).at[: last.shape[0]].set(last)
    tok_steps = jnp.zeros(T, jnp.int32).at[: last.shape[0]].set(row_steps)
    tok_row = jnp.minimum(jnp.arange(T), last.shape[0] - 1)

    def one_step(carry, i):
        kv_pages, ids = carry
        active = jnp.sum(row_steps > i)  # the leading rows that still step
        pos = positions + jnp.minimum(i, tok_last)
        step_md = dataclasses.replace(
            md,
            slot_mapping=_kv_slots(md.block_tables, tok_row, pos, bs, i < tok_steps),
            seq_lens=jnp.where(i < row_steps, md.seq_lens + i, 0),
            query_start_loc=jnp.minimum(md.query_start_loc, active),
        )
        logits, kv_pages = statics.module.apply(
            {"params": params}, ids, pos, kv_pages, step_md, logits_indices, jnp.minimum(num_logits, active)
        )
        out = sample(logits[:S], dataclasses.replace(sampling, position=sampling.position + i), flags)
        return (kv_pages, ids.at[:S].set(out.tokens)), out

    (kv_pages, _), sampled = jax.lax.scan(one_step, (kv_pages, ids), jnp.arange(num_steps))
    final = sampled.tokens[last[:S], jnp.arange(S)]
    return kv_pages, sampled, jnp.zeros(num_token_slots, jnp.int32).at[:S].set(final), tables


@functools.cache
def jit_steps(mesh):
    """``_steps`` jitted for one device mesh, with ``jit_step``'s shardings."""
    static, donate = ("statics", "layout", "flags", "num_steps", "num_token_slots"), ("kv_pages", "tables")
    if mesh is None:
        return jax.jit(_steps, static_argnames=static, donate_argnames=donate)
    kv, rep = parallel.kv_sharding(mesh), parallel.replicated(mesh)
    return jax.jit(
        _steps,
        static_argnames=static,
        donate_argnames=donate,
        in_shardings=(None, kv, rep, rep, rep, rep, rep),
        out_shardings=(kv, rep, rep, rep),
    )


jit_copy_blocks = jax.jit(copy_blocks, donate_argnums=(0,))
jit_gather_blocks = jax.jit(gather_blocks)
jit_scatter_blocks = jax.jit(scatter_blocks, donate_argnums=(0,))
