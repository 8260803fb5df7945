"""Runs a ``SchedulerOutput`` on the device: the batch built on the host (``BatchBuilder``), then one
jitted, KV-donating step (``step_programs``).

A step is launched (``launch``: inputs over, forward and sampler dispatched, or for plain greedy
rows the forward alone, which takes their argmax; nothing waited for) and collected later
(``collect``: sampled tokens back to the host), so the engine can schedule and launch step k+1
while step k runs. The model reads a decode token sampled by the previous step straight from that
step's device output (``prev_index``), so no host round trip stands between two steps.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged import parallel
from jaxpaged.batch_builder import GREEDY, BatchBuilder
from jaxpaged.block_table import BlockTable
from jaxpaged.kernels import AttentionMetadata, gathers_pages
from jaxpaged.array_utils import padded
from jaxpaged.math_utils import cdiv, pow2_bucket
from jaxpaged.models.registry import BuiltModel
from jaxpaged.sampler import SamplerFlags, SamplerOutput, no_logprobs
from jaxpaged.scheduler_output import SchedulerOutput
from jaxpaged.sequence_slots import SequenceSlots
from jaxpaged.step_batch import LaunchedStep, StepBatch, StepOutput
from jaxpaged.step_programs import (
    NO_ROW,
    StepModel,
    jit_copy_blocks,
    jit_gather_blocks,
    jit_scatter_blocks,
    jit_step,
    jit_steps,
    packed_inputs,
    sample_fn,
)

logger = logging.getLogger(__name__)

PRECOMPILED_SAMPLERS = (GREEDY, SamplerFlags(all_greedy=False))
"""Sampler variants compiled at start-up: greedy, and plain random sampling (OpenAI's defaults)."""


@functools.cache
def _no_logprobs(rows: int) -> tuple[np.ndarray, ...]:
    """``sampler.no_logprobs`` on the host, built once per row count (a greedy step's output takes them)."""
    return no_logprobs(rows, np)


class ModelRunner:
    """Owns the parameters, the global KV page array, the persistent batch (``slots``) with its device block
    tables (``block_table``), and the batch builder (``batches``); launches and collects the steps."""

    def __init__(
        self,
        model: BuiltModel,
        *,
        num_blocks: int,
        block_size: int,
        dtype: Any,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        num_host_blocks: int = 0,
    ):
        # Under tensor parallelism (the module carries a mesh) params go into their shards and the
        # KV pages are created split on the kv-head axis; otherwise both live on the default device.
        mesh = self._mesh = getattr(model.module, "mesh", None)
        self.model = dataclasses.replace(model, params=parallel.place_params(model.params, mesh))
        self._step_model = StepModel.of(self.model.module, self.model.params)
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = cdiv(max_model_len, block_size)
        self.gathers_pages = gathers_pages(model.module.attention_backend)
        self.max_rows = pow2_bucket(max_num_seqs)
        s = model.shape
        self.vocab_size = s.vocab_size
        kv_shape = (s.num_layers, 2, num_blocks, block_size, s.num_kv_heads, s.head_dim)
        self.kv_pages = (
            jnp.zeros(kv_shape, dtype)
            if mesh is None
            else parallel.zeros(kv_shape, dtype, parallel.kv_sharding(mesh))
        )
        logger.info("memory per device: %s", parallel.format_memory(self.memory_per_device()))
        # Host page pool for swapped-out blocks (preemption_mode="swap"); zeros are allocated lazily.
        self.host_pages = np.zeros(
            (s.num_layers, 2, num_host_blocks, block_size, s.num_kv_heads, s.head_dim), self.kv_pages.dtype
        )
        # A step runs at most ``max_rows`` sequences: the device block tables have a row for each.
        self.block_table = BlockTable(self.max_blocks_per_seq, self.max_rows, mesh)
        self.slots = SequenceSlots(self.block_table, vocab_size=self.vocab_size)
        self.batches = BatchBuilder(
            self.slots,
            block_size=block_size,
            max_blocks_per_seq=self.max_blocks_per_seq,
            max_num_batched_tokens=max_num_batched_tokens,
            max_rows=self.max_rows,
            vocab_size=self.vocab_size,
            gathers_pages=self.gathers_pages,
            one_device=mesh is None,
        )
        # The last launched step's sampled tokens (fixed shape): in-flight decode inputs come from here.
        self._prev_tokens = (
            jnp.zeros(self.max_rows, jnp.int32)
            if mesh is None
            else parallel.zeros((self.max_rows,), jnp.int32, parallel.replicated(mesh))
        )
        self.program_keys: set[tuple] = set()

    @property
    def num_compiled_programs(self) -> int:
        return len(self.program_keys)

    def memory_per_device(self) -> dict[Any, parallel.DeviceMemory]:
        """Bytes of parameter and KV-page shards on each of this process's devices."""
        return parallel.memory_per_device(self.model.params, self.kv_pages)

    def row_bucket(self, token_bucket: int) -> int:
        return self.batches.row_bucket(token_bucket)

    @property
    def token_buckets(self) -> list[int]:
        return self.batches.token_buckets

    def prepare(self, out: SchedulerOutput) -> StepBatch:
        """The step's padded host arrays (``BatchBuilder.prepare``)."""
        return self.batches.prepare(out)

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
        # faster than a jax.device_put of the tree.
        bt = self.block_table
        bt.apply(b.table_writes)
        if b.num_steps > 1:
            m = self._step_model
            packed, layout = packed_inputs(b)
            self.kv_pages, sampled, self._prev_tokens, bt.tables = jit_steps(self._mesh)(
                m.statics,
                layout,
                b.flags,
                b.num_steps,
                self.max_rows,
                m.leaves,
                self.kv_pages,
                packed,
                bt.tables,
                b.row_steps,
                self._prev_tokens,
                b.sampling,
            )
            return LaunchedStep(sampled, None, b.prompt_rows, b.num_rows, b.num_steps)
        logits, tokens, prev_tokens = self.forward(b)
        if b.greedy_in_forward:
            self._prev_tokens = prev_tokens
            return LaunchedStep(
                SamplerOutput(tokens, *_no_logprobs(tokens.shape[0])), None, b.prompt_rows, b.num_rows
            )
        sampled, prompt, self._prev_tokens = sample_fn(
            logits, b.sampling, b.prompt_targets, flags=b.flags, num_token_slots=self.max_rows
        )
        return LaunchedStep(sampled, prompt, b.prompt_rows, b.num_rows)

    def forward(self, b: StepBatch) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Dispatch the forward program of a one-step batch (its ``table_writes`` must be applied
        before, as ``run_batch`` does), keep its KV pages and tables; its logits, and its sampled
        tokens and their fixed-shape copy if ``b.greedy_in_forward`` (else zeros and the previous
        ones), not waited for."""
        forward, args = self.forward_program(b)
        self.kv_pages, logits, self.block_table.tables, tokens, prev_tokens = forward(*args)
        return logits, tokens, prev_tokens

    def forward_program(self, b: StepBatch) -> tuple[Any, tuple]:
        """The jitted forward program of a one-step batch and its arguments, as ``forward`` calls it
        (``-> (kv_pages, logits, tables, tokens, prev_tokens)``, KV pages and tables donated; the
        batch's ``table_writes`` must be applied first)."""
        m = self._step_model
        packed, layout = packed_inputs(b)
        return jit_step(self._mesh), (
            m.statics,
            layout,
            m.leaves,
            self.kv_pages,
            packed,
            self.block_table.tables,
            self._prev_tokens,
        )

    @staticmethod
    def collect(step: LaunchedStep) -> StepOutput:
        """Wait for a launched step; its samples (for the requests, then the forks) on the host."""
        # np.asarray waits for each array and reads it (on CPU a zero-copy view), skipping
        # jax.device_get's asynchronous-copy machinery, a cost per array.
        R, P = step.num_rows, len(step.prompt_rows)
        rows = np.s_[:, :R] if step.num_steps > 1 else np.s_[:R]
        sampled = jax.tree_util.tree_map(lambda a: np.asarray(a)[rows], step.sampled)
        prompt = (
            None if step.prompt is None else jax.tree_util.tree_map(lambda a: np.asarray(a)[:P], step.prompt)
        )
        return StepOutput(sampled, prompt, step.prompt_rows)

    def precompile(
        self, sampler_flags: tuple[SamplerFlags, ...] = PRECOMPILED_SAMPLERS, num_steps: int = 1
    ) -> int:
        """Compile the forward program of every token bucket and the sampler of every row bucket for
        each of ``sampler_flags`` but plain greedy, which the forward samples (with ``num_steps`` > 1
        also the multi-step program of every bucket a decode batch can use), by running them on
        all-padding inputs (no KV slot is written), so that serving never waits for a compile of these
        shapes. Returns how many programs that was.

        Only for backends that take full-width block tables: the XLA backend's programs also vary
        with the context and prefill-tile buckets, too many to compile ahead."""
        if self.gathers_pages:
            logger.info(
                "precompile skipped: the %s attention backend's shapes depend on context length",
                self.model.module.attention_backend,
            )
            return 0
        before = self.num_compiled_programs
        self.block_table.compile_writes()
        empty = np.zeros(0, np.int32)
        for T_b in self.token_buckets:
            R_b = self.row_bucket(T_b)
            md = AttentionMetadata(
                slot_mapping=None,
                block_tables=None,
                seq_lens=np.zeros(R_b, np.int32),
                query_start_loc=np.zeros(R_b + 1, np.int32),
                tile_row=empty,
                tile_start=empty,
                tile_len=empty,
                tile_size=1,
            )
            sampling, _ = self.batches.sampling_tensors([], empty, empty, R_b, [])
            for flags in sampler_flags:
                batch = StepBatch(
                    np.zeros(T_b, np.int32),
                    np.zeros(T_b, np.int32),
                    np.full(T_b, -1, np.int32),
                    md,
                    np.zeros(R_b, np.int32),
                    self.max_blocks_per_seq,
                    np.full((3, R_b), NO_ROW, np.int32),
                    [],
                    np.zeros(R_b, np.int32),
                    np.full(T_b, -1, np.int32),
                    sampling,
                    empty,
                    empty,
                    0,
                    flags,
                    greedy_in_forward=self.batches.greedy_in_forward(flags, 1, 0),
                )
                self.collect(self.run_batch(batch))
                if num_steps > 1 and T_b <= self.batches.token_bucket(self.max_num_seqs):
                    self.collect(
                        self.run_batch(
                            dataclasses.replace(
                                batch,
                                num_steps=num_steps,
                                programs_known=False,
                                row_steps=np.zeros(R_b, np.int32),
                                greedy_in_forward=False,
                            )
                        )
                    )
        return self.num_compiled_programs - before

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        P = pow2_bucket(len(pairs))
        src = np.zeros(P, np.int32)
        dst = np.full(P, -1, np.int32)
        src[: len(pairs)], dst[: len(pairs)] = zip(*pairs)
        self.kv_pages = jit_copy_blocks(self.kv_pages, src, dst)

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
        idx = padded(dev, pow2_bucket(len(dev)), 0)
        blocks = np.asarray(jax.device_get(jit_gather_blocks(self.kv_pages, idx)))
        self.host_pages[:, :, host] = blocks[:, :, : len(dev)]

    def _swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host pages -> device blocks, one batched scatter into the donated pool."""
        host, dev = (np.asarray(a, np.int32) for a in zip(*pairs))
        P = pow2_bucket(len(dev))
        blocks = np.zeros(self.host_pages.shape[:2] + (P,) + self.host_pages.shape[3:], self.host_pages.dtype)
        blocks[:, :, : len(dev)] = self.host_pages[:, :, host]
        self.kv_pages = jit_scatter_blocks(self.kv_pages, blocks, padded(dev, P, -1))
