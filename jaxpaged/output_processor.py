"""Output processing: take in a step's samples, apply the stop rules, detokenize, gather logprobs,
and build each request's ``RequestOutput`` (vLLM v1's ``OutputProcessor``).

A sample's tokens are appended as they come; a sample no rule can end yet (no stop strings, no
logprobs, no token of its stop ids, under ``max_tokens``) takes the fast path: it is detokenized
only when something reads its text. A failure in one request's own processing ends that request
(the engine's ``fail``), not the step.

Structured outputs: each sample of a constrained request has a grammar matcher that takes each of
its tokens as it is appended. A sample whose grammar is complete ends with "stop"; one whose
grammar refuses its token, or is complete before ``min_tokens``, is at a dead end and ends with
"error" (vLLM's ``FINISHED_ERROR``).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax

from jaxpaged.beam_search import BeamSearch
from jaxpaged.detokenizer import make_detokenizer
from jaxpaged.request import CompletionOutput, Logprob, Request, RequestOutput, RequestStatus, TokenLogprobs
from jaxpaged.sampling_params import RequestOutputKind
from jaxpaged.scheduler import Scheduler
from jaxpaged.scheduler_output import SchedulerOutput
from jaxpaged.step_batch import StepOutput
from jaxpaged.tokenizer import IncrementalDetokenizer, Tokenizer


def _stop_prefix_len(text: str, stops: list[str], end: int) -> int:
    """Length of the longest tail of ``text[:end]`` that is a proper prefix of a stop string (held
    back while streaming: the next tokens may complete the stop string, and it must never be sent)."""
    best = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, end), best, -1):
            if text.endswith(stop[:length], 0, end):
                best = length
                break
    return best


def _verified_rows(rows, verified: dict[int, list[int]]):
    """``rows`` (``(sampled row, request)`` pairs) with each verifying row replaced by the sampled rows whose
    tokens it keeps (``LLMEngine._verify``); its placeholder count grows by the extra tokens."""
    for i, req in rows:
        taken = verified.get(i)
        if taken is None:
            yield i, req
            continue
        req.num_output_placeholders += len(taken) - 1
        for row in taken:
            yield row, req


@dataclass
class ProcessedStep:
    """What one step's samples produced."""

    outputs: list[RequestOutput]
    beam_searches: list[BeamSearch]
    """The searches one of whose beams took its candidates (``BeamSearches.step`` selects)."""
    num_first_or_dropped: int
    """Tokens that were a sample's first, or were dropped (the rest were decode tokens)."""


class OutputProcessor:
    """The live samples' detokenizers and groups, and the per-step processing of their tokens."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        scheduler: Scheduler,
        beam_of: dict[str, BeamSearch],
        fail: Callable[[str, Exception], None],
    ) -> None:
        """``beam_of``: each live beam's search (``BeamSearches.of_beam``); ``fail``: ends a request
        whose own processing raised (``LLMEngine._fail``)."""
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self._beam_of = beam_of
        # A weak reference: the engine owns this processor, and a cycle would keep a dropped engine (and its
        # KV pool) alive until a full garbage collection.
        self._fail = weakref.WeakMethod(fail)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.groups: dict[str, Request] = {}
        """Every live sample's request id -> the request it belongs to (the first sample)."""
        self.num_synchronous = 0
        """Live requests whose steps need the previous step's tokens on the host (penalties)."""
        self._token_text: dict[int, str] = {}

    # ---- requests -------------------------------------------------------------------------

    def make_detokenizers(self, reqs: Sequence[Request]) -> list[IncrementalDetokenizer]:
        """The detokenizers of every sample of ``reqs``, in order (built before the requests are queued:
        once the scheduler holds them, nothing left may fail)."""
        return [
            make_detokenizer(self.tokenizer, req.sampling_params, r.prompt_token_ids)
            for req in reqs
            for r in (req, *req.forks)
        ]

    def add_requests(self, reqs: Sequence[Request], detokenizers: Sequence[IncrementalDetokenizer]) -> None:
        """Track the samples of ``reqs``, just queued, with their ``make_detokenizers``."""
        self.num_synchronous += sum(req.sampling_params.needs_host_tokens for req in reqs)
        members = [(req, r) for req in reqs for r in (req, *req.forks)]
        for (req, r), d in zip(members, detokenizers):
            self._detokenizers[r.request_id] = d
            self.groups[r.request_id] = req

    def forget(self, parent: Request) -> None:
        """Drop the per-sample state of a request that finished or was aborted."""
        if parent.request_id in self.groups:
            self.num_synchronous -= parent.sampling_params.needs_host_tokens
        for r in [parent, *parent.forks]:
            self._detokenizers.pop(r.request_id, None)
            self.groups.pop(r.request_id, None)

    # ---- a step's samples -----------------------------------------------------------------

    def process(
        self, out: SchedulerOutput, res: StepOutput, now: float, verified: dict[int, list[int]] | None = None
    ) -> ProcessedStep:
        """Append a step's samples, check their stops, and build the outputs of the requests with
        something to report; beams' candidates go to their searches. ``verified``: for each verifying row
        (``out.spec_token_ids``), the sampled rows of the tokens it keeps, appended in order."""
        self._record_prompt_logprobs(out.requests, res)
        touched: dict[str, Request] = {}
        searches: dict[str, BeamSearch] = {}
        if out.num_steps > 1:
            num_first_or_dropped = self._append_steps(out, res.sampled, now, touched, searches)
        else:
            # Rows that sample: requests whose step reached their last known token, then the forks.
            R = len(out.requests)
            rows = itertools.compress(enumerate(out.requests), out.samples)
            if verified:
                rows = _verified_rows(rows, verified)
            if out.forks:
                rows = itertools.chain(rows, ((R + j, child) for j, (_, child) in enumerate(out.forks)))
            num_first_or_dropped = self._append_samples(rows, res.sampled, now, touched, searches)
        outputs = []
        for parent in touched.values():
            if parent.request_id not in self.groups:
                continue  # one of its samples failed (``_fail``) after it reported
            try:
                output = self._make_output(parent)
            except Exception as e:
                self._fail()(parent.request_id, e)
                continue
            if output is not None:
                outputs.append(output)
            if output is not None and output.finished:
                self.forget(parent)
        return ProcessedStep(outputs, list(searches.values()), num_first_or_dropped)

    def _append_steps(
        self,
        out: SchedulerOutput,
        sampled,
        now: float,
        touched: dict[str, Request],
        searches: dict[str, BeamSearch],
    ) -> int:
        """A multi-step batch's samples (``[num_steps, rows]`` arrays), row by row. A row with no stop
        strings (``final_stop_ids`` or ``stream_stop_ids``) and no logprobs in the batch, none of whose
        tokens ends it, takes them all at once (a streamed one: detokenized at once, as one delta);
        the others go token by token through ``_append_samples``. Returns how many tokens were a
        sample's first, or were dropped (as ``_append_samples``)."""
        num_steps = out.num_steps
        num_first = 0
        plain = sampled.logprobs.size == 0
        columns = sampled.tokens.T.tolist()
        rest = []
        running = RequestStatus.RUNNING
        for j, (req, n) in enumerate(zip(out.requests, out.num_new_tokens)):
            ids, stream = req.output_token_ids, req.stream_stop_ids
            stops = req.final_stop_ids if stream is None else stream
            if plain and stops is not None and (req.status is running or not req.is_finished):
                new = columns[j][:n] if n < num_steps else columns[j]
                if len(ids) + n < req.max_tokens and stops.isdisjoint(new):
                    if not ids:
                        req.first_token_time = now
                        num_first += 1
                    ids += new
                    req.num_output_placeholders -= n
                    if stream is not None:
                        try:
                            self._passed(req, new, touched)
                        except Exception as e:
                            self._fail()(req.request_id, e)
                    continue
            rest.extend(range(j * num_steps, j * num_steps + n))
        if rest:
            # Row-major: entry j * num_steps + t is row j's sample of step t.
            flat = jax.tree_util.tree_map(
                lambda a: a.swapaxes(0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:]), sampled
            )
            return num_first + self._append_samples(
                ((i, out.requests[i // num_steps]) for i in rest), flat, now, touched, searches
            )
        return num_first

    def _append_samples(
        self, rows, sampled, now: float, touched: dict[str, Request], searches: dict[str, BeamSearch]
    ) -> int:
        """Append one step's sampled token to each ``(row, request)`` of ``rows`` and check its stops;
        the groups with something to report go to ``touched``, the beam searches to ``searches``.
        Returns how many of the tokens were a sample's first or were dropped (counted in these rare
        branches, so that ``LLMEngine._record_step`` knows the decode tokens without a count per row)."""
        tokens, logprobs = sampled.tokens.tolist(), sampled.logprobs.tolist()
        beam_of, running = self._beam_of, RequestStatus.RUNNING
        num_first_or_dropped = 0
        for i, req in rows:
            req.num_output_placeholders -= 1
            # Aborted (or stopped) while this step ran: its token is dropped. The identity test first: it
            # spares the common running row a property call.
            if req.status is not running and req.is_finished:
                num_first_or_dropped += 1
                continue
            try:  # one request's failure is its own (``_fail``), not the step's
                if beam_of:
                    search = beam_of.get(req.request_id)
                    if search is not None:
                        num_candidates = 2 * search.params.beam_width
                        search.pending[req.request_id] = (
                            sampled.top_ids[i, :num_candidates].tolist(),
                            sampled.top_logprobs[i, :num_candidates].tolist(),
                        )
                        req.waiting_for_group = True
                        searches[search.root.request_id] = search
                        continue
                ids = req.output_token_ids
                if not ids:
                    req.first_token_time = now
                    num_first_or_dropped += 1
                token, sp = tokens[i], req.sampling_params
                ids.append(token)
                if req.grammar is not None:
                    req.grammar.accept(token)  # its verdict is read by ``_stop_status``
                if logprobs and sp.needs_logprobs:
                    req.output_logprobs.append(logprobs[i])
                if req.output_top_logprobs is not None:
                    req.output_top_logprobs.append(
                        self._token_logprobs(
                            token,
                            logprobs[i],
                            int(sampled.ranks[i]),
                            sampled.top_ids[i, : sp.logprobs],
                            sampled.top_logprobs[i, : sp.logprobs],
                        )
                    )
                # The common decode step: with no stop strings only EOS, a stop id or the length limit can
                # end a sample, and none does here.
                stops = req.final_stop_ids
                if stops is not None and len(ids) < req.max_tokens and token not in stops:
                    continue  # detokenized when it ends (``_check_stop``)
                stops = req.stream_stop_ids
                if stops is not None and len(ids) < req.max_tokens and token not in stops:
                    self._passed(req, (token,), touched)
                    continue
                status = self._check_stop(req)
                if status is not None:
                    req.finished_time = now
                    self.scheduler.finish_request(req, status)
                elif sp.output_kind is RequestOutputKind.FINAL_ONLY:
                    continue
                parent = self.groups[req.request_id]
                touched[parent.request_id] = parent
            except Exception as e:
                self._fail()(req.request_id, e)
        return num_first_or_dropped

    def _passed(self, req: Request, new: Sequence[int], touched: dict[str, Request]) -> None:
        """Take in ``new``, tokens just appended to a streamed sample with no stop strings
        (``stream_stop_ids``) that end nothing: their text is added and the sample's group reports."""
        self._detokenizers[req.request_id].step(new)
        parent = self.groups[req.request_id]
        touched[parent.request_id] = parent

    def _record_prompt_logprobs(self, reqs: list[Request], res: StepOutput) -> None:
        """Append this step's scored prompt positions (consecutive, in order, per row)."""
        if res.prompt is None:
            return
        p = res.prompt
        for j, row in enumerate(res.prompt_rows.tolist()):
            req = reqs[row]
            width = req.sampling_params.prompt_logprobs
            try:
                req.prompt_logprobs.append(
                    self._token_logprobs(
                        int(p.tokens[j]),
                        float(p.logprobs[j]),
                        int(p.ranks[j]),
                        p.top_ids[j, :width],
                        p.top_logprobs[j, :width],
                    )
                )
            except Exception as e:
                self._fail()(req.request_id, e)

    def _token_logprobs(self, token: int, logprob: float, rank: int, top_ids, top_logprobs) -> TokenLogprobs:
        """vLLM's per-position dict: the chosen (or prompt) token first, then the top-N by rank."""
        ids = [token, *(int(t) for t in top_ids)]
        missing = [t for t in ids if t not in self._token_text]
        for t in missing:
            self._token_text[t] = self.tokenizer.decode([t], skip_special_tokens=False)
        entries = {token: Logprob(logprob, rank, self._token_text[token])}
        for r, (t, lp) in enumerate(zip(ids[1:], top_logprobs.tolist()), start=1):
            entries.setdefault(t, Logprob(lp, r, self._token_text[t]))
        return entries

    def _check_stop(self, req: Request) -> RequestStatus | None:
        """Detokenize the new token and decide whether the sample is done. A sample whose text
        nothing reads before it finishes (``FINAL_ONLY``, no stop strings) is detokenized only then,
        token by token as it would have been. A finished sample's detokenizer is flushed, so its
        text ends as the full decode does (even mid-character)."""
        sp = req.sampling_params
        ids = req.output_token_ids
        if sp.stop or sp.output_kind is not RequestOutputKind.FINAL_ONLY:
            detok = self._detokenizers[req.request_id]
            before = len(detok.text)
            detok.step(ids[-1:])
        elif self._stop_status(req, "", 0) is None:  # its stops do not read the text
            return None
        else:
            detok = self._detokenizers[req.request_id]
            for t in ids[:-1]:
                detok.step([t])
            before = len(detok.text)
            detok.step(ids[-1:])
        status = self._stop_status(req, detok.text, before)
        if status is not None:
            detok.flush()
        return status

    @staticmethod
    def _stop_status(req: Request, text: str, before: int) -> RequestStatus | None:
        """vLLM's stop rules, in its order; ``text[before:]`` is the new token's text. A constrained
        sample at a dead end (the module docstring) ends first; one whose grammar is complete
        after the other rules."""
        sp, ids = req.sampling_params, req.output_token_ids
        num_outputs, token = len(ids), ids[-1]
        grammar = req.grammar
        if grammar is not None and (
            grammar.error is not None or (grammar.complete and num_outputs < sp.min_tokens)
        ):
            return RequestStatus.FINISHED_ERROR
        if num_outputs < sp.min_tokens:
            return None
        eos = token == req.eos_token_id and not sp.ignore_eos
        if eos or token in sp.stop_token_ids:
            req.stop_reason = None if eos else token
            if not sp.include_stop_str_in_output:
                req.output_text_end = before  # the stop token's own text is not output
            return RequestStatus.FINISHED_STOPPED
        hits = sp.stop and [
            (at, stop) for stop in sp.stop if (at := text.find(stop, max(0, before - len(stop) + 1))) >= 0
        ]
        if hits:
            at, stop = min(hits, key=lambda h: h[0])
            req.stop_reason = stop
            req.output_text_end = at + len(stop) if sp.include_stop_str_in_output else at
            return RequestStatus.FINISHED_STOPPED
        if grammar is not None and grammar.complete:
            return RequestStatus.FINISHED_STOPPED
        if num_outputs >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _completion(self, req: Request) -> CompletionOutput:
        """One sample's output; while it runs, text that may begin a stop string is held back.
        With ``RequestOutputKind.DELTA`` its text, token ids and logprobs are only the new ones."""
        sp = req.sampling_params
        full = self._detokenizers[req.request_id].text
        end = len(full) if req.output_text_end is None else req.output_text_end
        if sp.stop and not sp.include_stop_str_in_output and not req.is_finished:
            end -= _stop_prefix_len(full, sp.stop, end)
        delta_text, req.num_text_sent = full[req.num_text_sent : end], end
        ids, sent = req.output_token_ids, req.num_tokens_sent
        req.num_tokens_sent = len(ids)
        delta_ids = ids[sent:]
        top = req.output_top_logprobs
        if sp.output_kind is RequestOutputKind.DELTA:  # O(new tokens): nothing old is copied
            text, token_ids, top = delta_text, delta_ids, None if top is None else top[sent:]
        else:
            text, token_ids, top = full[:end], list(ids), None if top is None else list(top)
        # Positional: a dataclass's keyword call is slower, and this runs per sample per step.
        return CompletionOutput(
            req.sample_index,
            text,
            token_ids,
            req.cumulative_logprob if sp.needs_logprobs else None,
            top,
            req.status.finish_reason,
            req.stop_reason,
            delta_text,
            delta_ids,
        )

    def _make_output(self, parent: Request) -> RequestOutput | None:
        """The request's output, or None while ``best_of > n`` samples run (the best are only known at
        the end) or while a ``FINAL_ONLY`` request runs."""
        sp, forks = parent.sampling_params, parent.forks
        samples = [parent, *forks]
        finished = parent.is_finished and (not forks or all(r.is_finished for r in forks))
        if not finished and (sp.best_of > sp.n or sp.output_kind is RequestOutputKind.FINAL_ONLY):
            return None
        if sp.best_of > sp.n:
            samples = sorted(samples, key=lambda r: r.cumulative_logprob, reverse=True)[: sp.n]
        metrics = {"arrival_time": parent.arrival_time, "first_scheduled_time": parent.first_scheduled_time}
        first = (
            parent.first_token_time
            if not forks
            else min((t for r in samples if (t := r.first_token_time) is not None), default=None)
        )
        if first is not None:
            metrics["first_token_time"] = first
        if finished:
            metrics["finished_time"] = max(r.finished_time or 0.0 for r in samples)
        verifications = sum(r.num_spec_verifications for r in samples)
        if verifications:
            drafted = sum(r.num_spec_draft_tokens for r in samples)
            kept = sum(r.num_spec_accepted_tokens for r in samples)
            metrics["spec_decode_num_draft_tokens"] = drafted
            metrics["spec_decode_num_accepted_tokens"] = kept
            metrics["spec_decode_acceptance_rate"] = kept / drafted
            metrics["spec_decode_mean_acceptance_length"] = 1 + kept / verifications
        prompt_logprobs = parent.prompt_logprobs
        if prompt_logprobs is not None:
            if sp.output_kind is not RequestOutputKind.DELTA:
                prompt_logprobs = list(prompt_logprobs)
            elif any(r.num_tokens_sent for r in samples):
                prompt_logprobs = None  # sent with the first output
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            [self._completion(r) for r in samples],
            finished,
            metrics,
            prompt_logprobs,
        )
