"""``LLMEngine``: add requests, step the model, collect outputs.

One ``step()`` = schedule (pure Python) -> launch (jitted programs, not waited for) -> collect ->
process: append the sampled tokens, check stops, detokenize, free finished requests' blocks. With
async scheduling (the default) the processing of step k runs while step k+1, already scheduled
and launched, runs on the device: ``step()`` returns the outputs of the step before the one it
launched. The scheduler counts tokens in flight as known (output placeholders) and the model
reads them on the device; a request that stops on a token of step k has computed one token
too many in step k+1, which is dropped. Steps whose inputs need the previous step's tokens on
the host (penalties, structured outputs, beam search) run synchronously.

The engine orchestrates; the work is done by its parts: ``InputProcessor`` validates and builds
requests (every input is checked before anything is queued, so a bad request leaves the engine
and the other requests untouched), ``OutputProcessor`` turns samples into ``RequestOutput``s,
``BeamSearches`` selects beams, ``plan_kv_cache`` sizes the pool. A failure in one request's own
work during a step (its sampling row or lists, its detokenizing, stop checks or output) ends that
request with finish reason "error" (``_fail``, vLLM's ``FINISHED_ERROR``) and the step goes on for
the others; a failure of the step itself (scheduling, the device) propagates, as the scheduler's
and the KV pool's state can no longer be trusted.

Sharing: the ``best_of`` samples of a request are one sequence until its prompt is computed
(once); the scheduler then forks the others, which share its blocks and draw their first
tokens from the same logits with their own seeds. Structured outputs: the runner fills a
constrained sample's row of the step's token bitmask from its grammar matcher; such a row must
not run ahead of its matcher, so its steps run synchronously and one decode step at a time (it
never joins a multi-step group).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged import host_memory, parallel
from jaxpaged.auto_dtype import resolve_auto_dtype
from jaxpaged.beam_search import BeamSearches, BeamSearchParams
from jaxpaged.config import EngineArgs, EngineConfig, keeps_quantized_blocks
from jaxpaged.data_parallel import DataParallelEngine
from jaxpaged.engine_base import EngineBase, request_id_in_use
from jaxpaged.generation_config import load_generation_defaults
from jaxpaged.input_processor import InputProcessor
from jaxpaged.kv_cache_manager import KVCacheManager, SharingStats
from jaxpaged.kv_cache_plan import plan_kv_cache
from jaxpaged.model_runner import ModelRunner
from jaxpaged.output_processor import OutputProcessor
from jaxpaged.request import CompletionOutput, Request, RequestOutput, RequestStatus
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.scheduler import Scheduler
from jaxpaged.scheduler_output import SchedulerOutput
from jaxpaged.spec_decode.draft_proposer import DraftModelProposer, draft_engine_config
from jaxpaged.spec_decode.ngram_proposer import NgramProposer
from jaxpaged.spec_decode.metrics import SpecDecodingStats
from jaxpaged.spec_decode.rejection import num_accepted
from jaxpaged.spec_decode.speculator import Speculator
from jaxpaged.step_batch import LaunchedStep, StepOutput
from jaxpaged.step_stats import StepStats
from jaxpaged.structured_outputs import GrammarCompiler
from jaxpaged.tokenizer import Tokenizer
from jaxpaged.weights import load_checkpoint
from jaxpaged.models.registry import build_model
from jaxpaged.kernels import resolve_backend, resolve_matmul_backend

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A launched step whose samples the engine has not taken in yet."""

    out: SchedulerOutput
    launched: LaunchedStep


class LLMEngine(EngineBase):
    """The synchronous engine; ``LLM`` and the async server drive it."""

    def __init__(self, config: EngineConfig, devices: Sequence[jax.Device] | None = None):
        """``devices``: the devices of this engine's tensor-parallel group (a data-parallel replica's);
        default: the first ``tensor_parallel_size`` devices."""
        tp = config.parallel.tensor_parallel_size
        mesh = parallel.engine_mesh(tp, devices)  # before loading: too few devices fails fast
        group = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
        self.config = config = resolve_auto_dtype(config, group[0].platform)
        mc, cc, sc = config.model, config.cache, config.scheduler
        matmul = resolve_matmul_backend(
            config.matmul_backend,
            dtype=mc.dtype,
            num_devices=1 if mesh is None else mesh.size,
            quantized=config.quantization == "gguf",
        )
        if config.cache_dir:
            jax.config.update("jax_compilation_cache_dir", os.path.join(config.cache_dir, "xla"))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        t0 = time.perf_counter()
        dtype = jnp.dtype(mc.dtype)
        ckpt = load_checkpoint(mc.model, dtype=dtype, revision=mc.revision, download_dir=mc.download_dir)
        self.tokenizer = Tokenizer.load(
            mc.tokenizer_source or ckpt.path, revision=mc.tokenizer_revision, download_dir=mc.download_dir
        )
        self.generation_defaults = load_generation_defaults(ckpt.path, mc.generation_config)
        """The model's generation config: defaults of the sampling parameters a request leaves unset, and
        EOS ids (``LLM.get_default_sampling_params`` and the server read it)."""
        model = build_model(
            ckpt.config,
            ckpt.tensors,
            dtype,
            resolve_backend(config.attention_backend, dtype=dtype),
            params=ckpt.params,
            matmul_backend=matmul,
            quantized=ckpt.quantized if keeps_quantized_blocks(config.quantization, mc.dtype) else None,
        )
        del ckpt
        if mesh is not None:
            model = parallel.shard_model(model, mesh)
        self.vocab_size = model.shape.vocab_size
        plan = plan_kv_cache(config, model.shape, dtype.itemsize, group)
        self.cache_info = info = plan.cache_info
        self.max_model_len = plan.max_model_len
        self.kv_cache_manager = KVCacheManager(
            info.num_blocks,
            cc.block_size,
            enable_caching=cc.enable_prefix_caching,
            num_host_blocks=plan.num_host_blocks,
        )
        self.scheduler = Scheduler(sc, self.kv_cache_manager, self.max_model_len)
        self.runner = ModelRunner(
            model,
            num_blocks=info.num_blocks,
            block_size=cc.block_size,
            dtype=dtype,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            max_num_seqs=sc.max_num_seqs,
            max_model_len=self.max_model_len,
            num_host_blocks=plan.num_host_blocks,
        )
        eos_ids = [self.tokenizer.eos_token_id, *self.generation_defaults.eos_token_ids]
        self.grammars = GrammarCompiler(
            self.tokenizer, self.vocab_size, [t for t in eos_ids if t is not None]
        )
        """Structured outputs' grammars for this model's tokenizer (EOS and the generation config's end them)."""
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.generation_defaults,
            self.grammars,
            sc,
            self.vocab_size,
            self.max_model_len,
            mc.seed,
        )
        self._beam_searches = BeamSearches(self.scheduler, self.tokenizer)
        self.output_processor = OutputProcessor(
            self.tokenizer, self.scheduler, self._beam_searches.of_beam, self._fail
        )
        self.async_scheduling = config.async_scheduling
        self.speculator = (
            None
            if config.speculative is None
            else Speculator(config.speculative, self._make_proposer(group), self.max_model_len)
        )
        """Speculative decoding's drafts and counters (``speculative_config``), else None."""
        self._in_flight: _InFlight | None = None
        self._failed: list[RequestOutput] = []
        """The last outputs of requests that failed (``_fail``), for ``step`` to return."""
        self.step_stats = StepStats()
        """What the steps so far computed, and the gaps between output tokens (``/metrics`` reads it)."""
        self._last_take_in: float | None = None
        """When the previous step's samples were taken in (``_record_step``)."""
        self.load_time = time.perf_counter() - t0
        t0 = time.perf_counter()
        num_precompiled = self.runner.precompile(num_steps=sc.num_scheduler_steps) if config.precompile else 0
        self.warmup_time = time.perf_counter() - t0
        if group[0].platform == "cpu":
            # After loading, so that the load's temporaries went back to the system.
            host_memory.keep_freed_memory()
        if num_precompiled:
            logger.info("precompiled %d step programs in %.1f s", num_precompiled, self.warmup_time)
        logger.info(
            "loaded %s in %.1f s; KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB%s%s)",
            mc.model,
            self.load_time,
            info.num_usable_blocks,
            cc.block_size,
            info.num_tokens,
            info.num_blocks * info.bytes_per_block / 2**20,
            f" per device, {tp} devices" if tp > 1 else "",
            ", sized automatically" if cc.sized_automatically else "",
        )

    def _make_proposer(self, group: Sequence[jax.Device]) -> NgramProposer | DraftModelProposer:
        """The speculative config's proposer; a draft model runs in an engine of its own on the first device."""
        spec = self.config.speculative
        if spec.method == "ngram":
            return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        draft = LLMEngine(
            draft_engine_config(self.config, self.cache_info.num_blocks, self.max_model_len),
            devices=group[:1],
        )
        return DraftModelProposer(draft, self.tokenizer, self.vocab_size)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine | DataParallelEngine:
        """The engine for ``args``: with ``data_parallel_size > 1`` a ``DataParallelEngine`` (the same
        public API over several replicas)."""
        config = args.create_engine_config()
        if config.parallel.data_parallel_size > 1:
            return DataParallelEngine(config, cls)
        return cls(config)

    # ---- requests -------------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Validate one request and build its state without queueing it (``InputProcessor.make_request``)."""
        return self.input_processor.make_request(
            request_id, prompt, sampling_params, arrival_time, cache_salt, priority
        )

    def add_prepared_requests(self, reqs: Sequence[Request]) -> None:
        """Queue requests made by ``make_request``, the prompts of one API request, with all their
        samples, or none of them; they take turns with other calls' requests (``Scheduler.add_requests``)."""
        for req in reqs:
            self._check_unused(req.request_id, [r.request_id for r in (req, *req.forks)])
        # Built first: once the scheduler holds the requests, nothing left here can fail.
        detokenizers = self.output_processor.make_detokenizers(reqs)
        # One sequence until the prompt is computed; the scheduler then forks the other samples.
        for req in reqs:
            req.pending_forks = tuple(req.forks)
            req.reserved_seqs = len(req.forks)
        try:
            self.scheduler.add_requests(reqs)
        except ValueError:
            for req in reqs:
                req.pending_forks, req.reserved_seqs = (), 0
            raise
        self.output_processor.add_requests(reqs, detokenizers)

    def _check_unused(self, request_id: str, sample_ids: Sequence[str]) -> None:
        """The engine's request-id rule: no sample's id may be a live sample's or beam search's."""
        groups, searches = self.output_processor.groups, self._beam_searches.by_id
        if any(i in groups or i in searches for i in sample_ids):
            raise request_id_in_use(request_id)

    def abort_request(self, request_id: str) -> None:
        """Abort a request (all its samples, or all its beams)."""
        if self._beam_searches.abort(request_id):
            return
        parent = self.output_processor.groups.get(request_id)
        if parent is None:
            self.scheduler.abort_request(request_id)
            return
        for r in [parent, *parent.forks]:
            if self.scheduler.abort_request(r.request_id) is None and not r.is_finished:
                r.status = RequestStatus.FINISHED_ABORTED  # a sample not forked yet
        parent.pending_forks = ()
        self.output_processor.forget(parent)

    def has_unfinished_requests(self) -> bool:
        """Requests queued or running. (A request whose last token is in flight is running until
        ``step()`` takes it in; a step in flight holding only finished or aborted requests is not
        waited for: the next ``step()`` drops its tokens.)"""
        return self.scheduler.has_unfinished_requests()

    @property
    def spec_decode_stats(self) -> SpecDecodingStats | None:
        """Speculative decoding's counters so far (None without ``speculative_config``)."""
        return None if self.speculator is None else self.speculator.stats

    def sharing_stats(self) -> SharingStats:
        """Blocks used now vs. blocks the live sequences would hold without sharing
        (``saved_fraction`` = (without - used) / without)."""
        return self.kv_cache_manager.sharing_stats()

    def add_beam_search_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: BeamSearchParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a beam search over one prompt; its one ``RequestOutput`` (when finished) holds
        the ``beam_width`` best beams, best first, as ``outputs``."""
        self._check_unused(request_id, [request_id])
        # Greedy rows asking for the top-N logprobs: the N >= 2k best continuations of each beam.
        sp = SamplingParams(
            temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True, logprobs=2 * params.beam_width
        )
        root = self.make_request(request_id, prompt, sp, arrival_time, cache_salt)
        self._beam_searches.add(root, params)
        return root

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration. With async scheduling: schedule and launch a step, then take in the
        previous one's samples (while the new one runs) and return their outputs. Otherwise, or
        when the step needs the previous step's tokens on the host: finish the step in flight,
        then schedule, run and take in a step."""
        spec = self.speculator
        if (
            self.async_scheduling
            and not self.output_processor.num_synchronous
            and not self._beam_searches.by_id
            and not (spec is not None and spec.wants_sync)
        ):
            launched = self._launch()
            outputs = self._take_in(self._in_flight)
            self._in_flight = launched
            if spec is not None:
                spec.probe(self.scheduler.running)
        else:
            outputs = self._take_in(self._in_flight)
            self._in_flight = None
            if spec is not None:  # drafts need every token on the host: the step before is taken in
                spec.propose(self.scheduler.running)
            outputs += self._take_in(self._launch())
        if self._failed:
            outputs += self._failed
            self._failed = []
        return outputs

    def _launch(self) -> _InFlight | None:
        """Schedule a step and launch it on the device (not waited for)."""
        out = self.scheduler.schedule()
        if self.speculator is not None:
            self.speculator.clear_drafts()
            self.speculator.forget_many(out.finished_request_ids)
        launched = self.runner.launch(out)  # block transfers even when nothing runs (swap-outs of idle beams)
        for request_id, error in self.runner.slots.take_failed().items():
            self._fail(request_id, error)
        return None if launched is None else _InFlight(out, launched)

    def _take_in(self, step: _InFlight | None) -> list[RequestOutput]:
        """Collect a launched step and process its samples: the outputs, then the beam searches' steps."""
        if step is None:
            return []
        res = self.runner.collect(step.launched)
        now = time.time()
        verified = self._verify(step.out, res) if step.out.spec_token_ids else {}
        processed = self.output_processor.process(step.out, res, now, verified)
        num_kept_drafts = sum(len(taken) - 1 for taken in verified.values())
        self._record_step(step.out, now, processed.num_first_or_dropped, num_kept_drafts)
        outputs = processed.outputs
        for search in processed.beam_searches:
            if search.root.request_id not in self._beam_searches.by_id:
                continue  # it failed (``_fail``) after a beam reported
            try:
                output = self._beam_searches.step(search)
            except Exception as e:
                self._fail(search.root.request_id, e)
                continue
            if output is not None:
                outputs.append(output)
        return outputs

    def _verify(self, out: SchedulerOutput, res: StepOutput) -> dict[int, list[int]]:
        """For each verifying row of ``out``, the sampled rows whose tokens it keeps: its kept drafts' and the
        one after them (``rejection``); the rest are rolled back (``Scheduler.reject_draft_tokens``) and the
        speculator counts both."""
        rows = sorted(out.spec_token_ids)
        drafts = [out.spec_token_ids[i] for i in rows]
        # The sampled row of each position: the drafts' rows (``verify_rows``), then the row's own (the bonus).
        orders = [[*range(first, first + len(d)), i] for i, d, first in zip(rows, drafts, out.verify_rows())]
        k = max(map(len, drafts))
        tokens = res.sampled.tokens
        sampled = np.full((len(rows), k + 1), -1, np.int64)
        padded_drafts = np.full((len(rows), k), -1, np.int64)
        for j, (d, order) in enumerate(zip(drafts, orders)):
            sampled[j, : len(order)] = tokens[order]
            padded_drafts[j, : len(d)] = d
        kept = num_accepted(sampled, padded_drafts).tolist()
        for i, d, a in zip(rows, drafts, kept):
            request = out.requests[i]
            self.scheduler.reject_draft_tokens(request, len(d) - a)
            self.speculator.record(request, len(d), a)
        return {i: order[: a + 1] for i, order, a in zip(rows, orders, kept)}

    def _record_step(
        self, out: SchedulerOutput, now: float, num_first_or_dropped: int, num_accepted_drafts: int = 0
    ) -> None:
        """Count the tokens the step computed, and the gap before each decode token it sampled: the time
        since the previous step's take-in, when every sample that ran in that step took its previous
        token (one that sat out steps, as after a preemption, waited longer than counted), shared
        evenly by a multi-step batch's steps."""
        stats = self.step_stats
        stats.iteration_tokens.observe(out.total_num_tokens)
        sampled = (
            out.total_num_tokens
            if out.num_steps > 1
            else out.samples.count(True) + len(out.forks) + num_accepted_drafts
        )
        num_decode = sampled - num_first_or_dropped
        if num_decode > 0 and self._last_take_in is not None:
            stats.inter_token_latency.observe((now - self._last_take_in) / out.num_steps, num_decode)
        self._last_take_in = now

    def _fail(self, request_id: str, error: Exception) -> None:
        """End the request of sample (or beam) ``request_id``, whose own processing raised ``error``, with
        finish reason "error" (vLLM's ``FINISHED_ERROR``): its blocks are freed and the others go on, as
        nothing they share was changed. Its last output goes out with the step's (``_failed``)."""
        search = self._beam_searches.of_beam.get(request_id)
        parent = search.root if search is not None else self.output_processor.groups.get(request_id)
        if parent is None:
            return  # already ended
        logger.error(
            "request %s failed (%s); it ends with an error, the others go on",
            parent.request_id,
            type(error).__name__,
            exc_info=error,
        )
        if search is not None:
            self.abort_request(parent.request_id)
            n = search.params.beam_width
        else:
            for r in [parent, *parent.forks]:
                if not r.is_finished:
                    self.scheduler.finish_request(r, RequestStatus.FINISHED_ERROR)
                    r.status = RequestStatus.FINISHED_ERROR  # also a sample not forked yet
            parent.pending_forks = ()
            self.output_processor.forget(parent)
            n = parent.sampling_params.n
        outputs = [CompletionOutput(i, "", [], None, None, "error") for i in range(n)]
        self._failed.append(
            RequestOutput(
                parent.request_id,
                parent.prompt,
                parent.prompt_token_ids,
                outputs,
                True,
                {"arrival_time": parent.arrival_time, "finished_time": time.time()},
            )
        )
