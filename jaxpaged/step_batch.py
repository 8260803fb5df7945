"""The data objects of one step between the runner's parts: the padded host batch (``StepBatch``), the
layout of its packed inputs (``InputLayout``), a step in flight (``LaunchedStep``) and its host results
(``StepOutput``). A module of its own so the arrows run one way: the batch builder makes these, the
device programs and the runner read them, and the engine takes the last two.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxpaged.kernels import AttentionMetadata
from jaxpaged.sampler import SamplerFlags, SamplerOutput, SamplingTensors


@dataclass(frozen=True)
class InputLayout:
    """The shapes of a step's int32 inputs in the packed array, in order: input_ids, positions, token_rows,
    the metadata arrays but the KV slots and block tables (``MD_ARRAYS``), the rows' block-table rows,
    logits_indices, prev_index, num_logits, greedy (1: the forward samples), the block-table writes.
    Static: part of the program's key, with the metadata's tile size and the block-table columns read."""

    shapes: tuple[tuple[int, ...], ...]
    tile_size: int
    table_width: int


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
    and reads the rows' tables from the device block tables (``BlockTable.tables``)."""
    table_rows: np.ndarray
    """[R_b] each row's row of the device block tables (padding rows: 0)."""
    table_width: int
    """Leading block-table columns the step reads (all of them, or a context bucket)."""
    step_table_writes: np.ndarray
    """``[3, R_b]`` (row, column, block id) writes to the device tables that the step program applies
    before reading them (padding: row ``NO_ROW``)."""
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
    packed: "tuple[np.ndarray, InputLayout] | None" = None
    """The int32 inputs packed in one array and their layout (``pack_inputs``), once built: the
    arrays above that go into it are views of it when the batch was advanced from the one before."""
    greedy_in_forward: bool = False
    """The forward program samples this batch (``BatchBuilder.greedy_in_forward``): no sampler program runs."""
    programs_known: bool = False
    """Its programs (``program_keys``) are known to be in the runner's ``program_keys``: a steady batch
    of the same shapes, flags and steps as the batch before (skips building the key tuples, hashing
    the sampler flags' dataclass and the lookups each step)."""

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
        forward = (
            "forward",
            self.input_ids.shape[0],
            self.logits_indices.shape[0],
            self.table_width,
            self.md.tile_row.shape[0],
            self.md.tile_size,
        )
        sampler = (
            "sampler",
            self.logits_indices.shape[0],
            self.prompt_targets.shape[0],
            self.flags,
            st.penalty_rows.shape[0],
            st.bias_rows.shape[0],
        )
        if self.num_steps > 1:  # one program: forward and sampler, stepped
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
