"""Host batch building: a ``SchedulerOutput`` turned into a ``StepBatch`` of padded numpy arrays.

Vectorized numpy over the persistent batch (``SequenceSlots``): per request and step only the new
token ids (prompt chunks) are copied from Python lists. Shapes are padded to power-of-two buckets
(tokens, rows, block-table width, prefill tiles) so the set of compiled programs stays small and
known. A steady decode step (the same sequences as the step before, all tokens in flight) is built by
advancing the previous batch's packed inputs (``_next_steady_batch``).
"""

from __future__ import annotations

import itertools

import numpy as np

from jaxpaged.kernels import AttentionMetadata, build_prefill_tiles
from jaxpaged.kernels.metadata import num_prefill_tiles
from jaxpaged.array_utils import padded
from jaxpaged.math_utils import cdiv, pow2_bucket
from jaxpaged.request import Request
from jaxpaged.sampler import SamplerFlags, SamplingTensors
from jaxpaged.sampling_inputs import build_sampling_tensors
from jaxpaged.scheduler_output import SchedulerOutput
from jaxpaged.sequence_slots import SequenceSlots
from jaxpaged.step_batch import InputLayout, StepBatch
from jaxpaged.step_programs import packed_inputs, packed_offsets

PREFILL_TILE = 64
# Bucket floors: padding a small batch up to these costs little and saves compiled programs.
MIN_TOKENS, MIN_CONTEXT, MIN_TILES = 8, 256, 4
# Floor of the prompt positions scored for prompt logprobs.
MIN_PROMPT_POSITIONS = 16
_PAST_IN_FLIGHT = (
    "a step needs token ids that neither the host nor the previous step's samples hold (the "
    "engine scheduled past an in-flight step)"
)
GREEDY = SamplerFlags()
"""Plain greedy sampling (no logprobs, penalties or bias): a one-step batch with these flags and no
prompt logprobs takes its argmax inside the forward program (``step_programs._step``), with no sampler program."""


def _replaced(obj, **changes):
    """``dataclasses.replace`` for the step's plain dataclasses without running ``__init__`` again:
    a shallow copy with ``changes``, cheaper than the generated ``__init__`` (a steady decode step makes three)."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__, **changes)
    return new


class BatchBuilder:
    """Builds each step's ``StepBatch`` from the scheduler's output, the persistent batch (``slots``)
    and its block table's pending writes."""

    def __init__(
        self,
        slots: SequenceSlots,
        *,
        block_size: int,
        max_blocks_per_seq: int,
        max_num_batched_tokens: int,
        max_rows: int,
        vocab_size: int,
        gathers_pages: bool,
        one_device: bool,
    ) -> None:
        self.slots = slots
        self.block_table = slots.block_table
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.gathers_pages = gathers_pages
        self._one_device = one_device
        # Read-only row arrays of decode steps: 0, 1, 2, ... and ones (a step has at most one row per token).
        self._iota = np.arange(max_num_batched_tokens + 1, dtype=np.int32)
        self._ones = np.ones(max_num_batched_tokens, np.int32)
        self._iota.flags.writeable = self._ones.flags.writeable = False
        self._sampling_cache: tuple | None = None
        """(slots, S_b, tensors, flags) of the last batch whose sampling inputs can be reused."""
        self._steady: tuple[np.ndarray, StepBatch] | None = None
        """(slots, batch) of the last step if it was a steady decode step (``_next_steady_batch``)."""

    def token_bucket(self, num_tokens: int) -> int:
        """Padded token count of a step: a power of two from ``MIN_TOKENS`` to the step budget."""
        return pow2_bucket(num_tokens, self.max_num_batched_tokens, floor=MIN_TOKENS)

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
        if (
            self._steady is not None
            and self._steady[0] is slots
            and appended
            and not children
            and not any(out.num_host_tokens)
            and all(out.samples)
        ):
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
        qsl[1 : R + 1] = iota[1 : R + 1] if decode else np.cumsum(n)
        row_of_tok = iota[:R] if decode else np.repeat(iota[:R], n)
        positions = np.zeros(T_b, np.int32)
        positions[:T] = starts if decode else iota[:T] - qsl[row_of_tok] + starts[row_of_tok]
        input_ids, prev_index = self._token_ids(
            reqs, slots, starts, n, out.num_host_tokens, qsl, T_b, out.spec_token_ids
        )
        table_rows = padded(self.block_table.device_rows(slots), R_b, 0)
        token_rows = padded(row_of_tok, T_b, -1)
        seq_lens_b = padded(seq_lens, R_b, 0)
        if self.gathers_pages:
            tile = min(PREFILL_TILE, T_b)
            n_tiles = num_prefill_tiles(qsl, tile)
            P_b = 0 if n_tiles == 0 else pow2_bucket(n_tiles, floor=MIN_TILES)
            tile_row, tile_start, tile_len = build_prefill_tiles(qsl, tile, P_b)
        else:
            tile, (tile_row, tile_start, tile_len) = 1, (np.zeros(0, np.int32),) * 3
        md = AttentionMetadata(
            slot_mapping=None,
            block_tables=None,
            seq_lens=seq_lens_b,
            query_start_loc=qsl,
            tile_row=tile_row,
            tile_start=tile_start,
            tile_len=tile_len,
            tile_size=tile,
        )
        prompt_idx, prompt_targets, prompt_rows = self._prompt_logprob_positions(
            reqs, np.flatnonzero(slots_state.prompt_logprobs[slots]).tolist(), starts, n, qsl
        )
        NP = len(prompt_idx)
        NP_b = 0 if NP == 0 else pow2_bucket(NP, floor=MIN_PROMPT_POSITIONS)
        # Sampled rows: one per request, then one per fork (sampled from its parent row's logits), then
        # one per draft a verifying row checks (``SchedulerOutput.verify_rows``).
        fork_rows = np.asarray([row for row, _ in out.forks], np.int32)
        verify_rows, verify_at = self._verify_rows(out, qsl)
        S = R + len(fork_rows) + len(verify_rows)
        S_b = R_b if S == R else max(R_b, self.row_bucket(self.token_bucket(S)))
        if S_b < S:  # verifying rows can outnumber max_rows
            S_b = pow2_bucket(S)
        logits_indices = np.zeros(S_b + NP_b, np.int32)
        logits_indices[:R] = qsl[1 : R + 1] - 1
        logits_indices[R : R + len(fork_rows)] = logits_indices[fork_rows]
        if len(verify_rows):
            logits_indices[R + len(fork_rows) : S] = verify_at
        logits_indices[S_b : S_b + NP] = prompt_idx
        targets = padded(prompt_targets, NP_b, 0)
        prompt_widths = [reqs[i].sampling_params.prompt_logprobs for i in set(prompt_rows.tolist())]
        # A fork samples with its own slot's parameters (its seed); a verifying row with its request's.
        extra_slots = np.concatenate([fork_slots, slots[verify_rows]]) if len(verify_rows) else fork_slots
        seqs = reqs + children + [reqs[i] for i in verify_rows.tolist()]
        sampling, flags = self._sampling_inputs(
            seqs,
            np.concatenate([slots, extra_slots]) if len(extra_slots) else slots,
            # A verifying row samples the position after its token: its draft's.
            np.concatenate(
                [seq_lens, seq_lens[fork_rows], verify_at - qsl[verify_rows] + starts[verify_rows] + 1]
            ),
            S_b,
            prompt_widths,
            self._drafts_before(out, len(fork_rows)),
        )
        if all(out.samples):
            slots_state.last_sample_row[slots] = iota[:R]
        else:
            samples = np.fromiter(out.samples, bool, R)
            slots_state.last_sample_row[slots[samples]] = np.flatnonzero(samples)
        slots_state.last_sample_row[fork_slots] = np.arange(R, R + len(fork_slots), dtype=np.int32)
        step_writes = np.empty((3, R_b), np.int32)
        table_writes = self.block_table.take_step_writes(step_writes)
        b = StepBatch(
            input_ids,
            positions,
            token_rows,
            md,
            table_rows,
            W_b,
            step_writes,
            table_writes,
            logits_indices,
            prev_index,
            sampling,
            targets,
            prompt_rows,
            S,
            flags,
            out.num_steps,
            row_steps,
            greedy_in_forward=self.greedy_in_forward(flags, out.num_steps, NP_b),
        )
        # A decode step of in-flight tokens whose rows sample at their own indices: the next step of
        # the same sequences reads its tokens where this one samples them.
        steady = (
            decode
            and not children
            and not NP
            and all(out.samples)
            and np.array_equal(prev_index[:R], iota[:R])
        )
        self._steady = (slots, b) if steady else None
        return b

    @staticmethod
    def _drafts_before(out: SchedulerOutput, num_forks: int) -> list[list[int] | None]:
        """For each sampled row (rows, forks, verifying rows) of a step with drafts, the drafts before the
        position it samples (its penalty counts, ``min_tokens`` mask and grammar state count them as output),
        None for a row of a request without drafts; empty without drafts."""
        spec = out.spec_token_ids
        if not spec:
            return []
        before = [spec.get(i) for i in range(len(out.requests))] + [None] * num_forks
        for i in sorted(spec):
            before += [spec[i][:j] for j in range(len(spec[i]))]
        return before

    @staticmethod
    def _verify_rows(out: SchedulerOutput, qsl: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Speculative decoding's extra sampled rows, in ``verify_rows`` order: each one's batch row, and
        the token index whose logits it samples (a row's last known token, then each draft but its last)."""
        spec = out.spec_token_ids
        if not spec:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        rows = sorted(spec)
        counts = np.fromiter((len(spec[i]) for i in rows), np.int32, len(rows))
        batch_rows = np.repeat(np.asarray(rows, np.int32), counts)
        within = np.arange(len(batch_rows), dtype=np.int32) - np.repeat(np.cumsum(counts) - counts, counts)
        return batch_rows, qsl[batch_rows] + within

    def _next_steady_batch(self, last: StepBatch, slots: np.ndarray, out: SchedulerOutput) -> StepBatch:
        """The step after a steady decode step ``last`` of the same sequences, all its tokens in
        flight, every block-table change since an appended block: the rows' layout (query starts,
        logits rows, in-flight token rows, table rows, prompt positions: none) is ``last``'s, and each
        row's position moved by the tokens it computed in ``last`` (1, or its steps in a group). So
        the packed inputs are ``last``'s with positions and sequence lengths advanced by that much
        (the program looks each token's KV slot up in its row's table, so a row entering a new block
        costs the host nothing) and this step's table writes: far fewer numpy operations, each slow
        once the device step has evicted the host's caches.
        ``last_sample_row`` already holds each row's own index.
        Either step may be a multi-step group (prepared as its first decode step, its rows' steps
        going along)."""
        R, T_b, R_b = len(slots), last.input_ids.shape[0], last.table_rows.shape[0]
        packed, layout = packed_inputs(last)
        _, at_pos, _, at_len, *_, at_greedy, at_writes = packed_offsets(layout.shapes)
        moved = 1 if last.num_steps == 1 else last.row_steps[:R]
        packed = packed.copy()
        for at in (at_pos, at_len):
            packed[at : at + R] += moved
        seq_lens = packed[at_len : at_len + R_b]
        step_writes = packed[at_writes : at_writes + 3 * R_b].reshape(3, R_b)
        table_writes = self.block_table.take_step_writes(step_writes)
        row_steps = self._row_steps(out, R_b)
        width = self._table_width(seq_lens[:R], row_steps)
        if width != layout.table_width:
            layout = InputLayout(layout.shapes, layout.tile_size, width)
        sampling, flags = self._sampling_inputs(
            out.requests, slots, seq_lens, last.sampling.temperature.shape[0], []
        )
        md = _replaced(last.md, seq_lens=seq_lens)
        # The programs' keys are the last batch's but for these (its penalty and bias lists may change).
        same_programs = (
            width == last.table_width
            and flags is last.flags
            and out.num_steps == last.num_steps
            and sampling.penalty_rows.shape == last.sampling.penalty_rows.shape
            and sampling.bias_rows.shape == last.sampling.bias_rows.shape
        )
        greedy = self.greedy_in_forward(flags, out.num_steps, 0)
        packed[at_greedy] = greedy
        b = _replaced(
            last,
            positions=packed[at_pos : at_pos + T_b],
            md=md,
            table_width=width,
            step_table_writes=step_writes,
            table_writes=table_writes,
            sampling=sampling,
            flags=flags,
            num_steps=out.num_steps,
            row_steps=row_steps,
            packed=(packed, layout),
            greedy_in_forward=greedy,
            programs_known=last.programs_known and same_programs,
        )
        self._steady = (slots, b)
        return b

    def greedy_in_forward(self, flags: SamplerFlags, num_steps: int, num_prompt_positions: int) -> bool:
        """Whether the forward program samples a batch (``StepBatch.greedy_in_forward``): one step of plain
        greedy rows (``GREEDY``), no prompt positions, one device. No sampler program runs then, saving the
        host its launch (under tensor parallelism the argmax would gather the vocabulary-split logits a
        second time)."""
        return self._one_device and num_steps == 1 and not num_prompt_positions and flags == GREEDY

    @staticmethod
    def _row_steps(out: SchedulerOutput, R_b: int) -> np.ndarray | None:
        """``StepBatch.row_steps`` of a multi-step batch (None for one step)."""
        if out.num_steps == 1:
            return None
        return padded(np.fromiter(out.num_new_tokens, np.int32, len(out.requests)), R_b, 0)

    def _table_width(self, seq_lens: np.ndarray, row_steps: np.ndarray | None = None) -> int:
        """Block-table columns a step reads for sequences of ``seq_lens`` tokens (a multi-step batch's
        rows growing by their ``row_steps`` - 1 more)."""
        if not self.gathers_pages:
            return self.max_blocks_per_seq
        longest = int(seq_lens.max()) + (0 if row_steps is None else int(row_steps.max()) - 1)
        return pow2_bucket(
            cdiv(longest, self.block_size), self.max_blocks_per_seq, floor=MIN_CONTEXT // self.block_size
        )

    def _token_ids(
        self,
        reqs: list[Request],
        slots: np.ndarray,
        starts: np.ndarray,
        n: np.ndarray,
        host_n: list[int],
        qsl: np.ndarray,
        T_b: int,
        spec: dict[int, list[int]],
    ) -> tuple[np.ndarray, np.ndarray]:
        """``input_ids`` of the step (the host's part of each row's span, its first ``host_n``
        tokens; a verifying row's ``spec`` drafts after its last token), and ``prev_index``: the row's
        last token, if its id is still on the device, is the previous step's sample at that row."""
        input_ids = np.zeros(T_b, np.int32)
        R = len(n)
        prev_index = np.full(T_b, -1, np.int32)
        if not any(host_n):
            # Every row's tokens are in flight (a steady decode batch): one each, the last sample.
            src = self.slots.last_sample_row[slots]
            if n.sum() > R or (src < 0).any():
                raise RuntimeError(_PAST_IN_FLIGHT)
            prev_index[qsl[1 : R + 1] - 1] = src
            return input_ids, prev_index
        host_n = np.fromiter(host_n, np.int32, R)
        rows = np.flatnonzero(host_n)
        H = int(host_n.sum())
        if H:
            k = host_n[rows]

            def row_tokens(i: int, s: int, c: int) -> list[int]:
                drafts = spec.get(i)
                if drafts is None:
                    return reqs[i].token_ids_slice(s, s + c)
                return reqs[i].token_ids_slice(s, s + c - len(drafts)) + drafts

            tokens_of = row_tokens if spec else lambda i, s, c: reqs[i].token_ids_slice(s, s + c)
            flat = np.fromiter(
                itertools.chain.from_iterable(
                    map(tokens_of, rows.tolist(), starts[rows].tolist(), k.tolist())
                ),
                np.int32,
                H,
            )
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
    def _prompt_logprob_positions(
        reqs: list[Request], rows: list[int], starts: np.ndarray, n: np.ndarray, qsl: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
            targets.append(np.asarray(r.prompt_token_ids[lo + 1 : hi + 1], np.int32))
            out_rows.append(np.full(hi - lo, i, np.int32))
        if not idx:
            return (np.zeros(0, np.int32),) * 3
        return np.concatenate(idx), np.concatenate(targets), np.concatenate(out_rows)

    def _sampling_inputs(
        self,
        seqs: list[Request],
        slots: np.ndarray,
        positions: np.ndarray,
        S_b: int,
        prompt_widths: list[int],
        drafts_before: list[list[int] | None] = (),
    ) -> tuple[SamplingTensors, SamplerFlags]:
        """``sampling_tensors``, or for a batch of the same sequences as the previous one (the same
        slot array: ``SequenceSlots.slots`` reuses it) whose parameters are fixed (no per-step
        penalty, bias or min_tokens lists) the previous tensors with the new positions."""
        cached = self._sampling_cache
        if cached is not None and cached[0] is slots and cached[1] == S_b and not prompt_widths:
            position = positions if len(positions) == S_b else padded(positions, S_b, 0)
            return _replaced(cached[2], position=position), cached[3]
        sampling, flags = self.sampling_tensors(seqs, slots, positions, S_b, prompt_widths, drafts_before)
        fixed = not prompt_widths and not self.slots.needs_host_lists[slots].any()
        self._sampling_cache = (slots, S_b, sampling, flags) if fixed else None
        return sampling, flags

    def sampling_tensors(
        self,
        seqs: list[Request],
        slots: np.ndarray,
        positions: np.ndarray,
        S_b: int,
        prompt_widths: list[int],
        drafts_before: list[list[int] | None] = (),
    ) -> tuple[SamplingTensors, SamplerFlags]:
        """``build_sampling_tensors`` over this builder's persistent batch."""
        return build_sampling_tensors(
            self.slots, seqs, slots, positions, S_b, prompt_widths, self.vocab_size, drafts_before
        )
