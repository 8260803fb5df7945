"""``LLMEngine``: add requests, step the model, collect outputs.

One ``step()`` = schedule (pure Python) -> launch (jitted programs, not waited for) -> update:
append the sampled tokens, check stops, detokenize, free finished requests' blocks. With async
scheduling (the default) the update of step k runs while step k+1, already scheduled and
launched, runs on the device: ``step()`` returns the outputs of the step before the one it
launched. The scheduler counts tokens in flight as known (output placeholders) and the model
reads them on the device; a request that stops on a token of step k has computed one token
too many in step k+1, which is dropped. Steps whose inputs need the previous step's tokens on
the host (penalties, structured outputs, beam search) run synchronously.
Every input is validated in ``add_request`` before anything is queued, so a bad request
leaves the engine and the other requests untouched. A failure in one request's own work during a
step (its sampling row or lists, its detokenizing, stop checks or output) ends that request with
finish reason "error" (``_fail``, vLLM's ``FINISHED_ERROR``) and the step goes on for the others;
a failure of the step itself (scheduling, the device) propagates, as the scheduler's and the KV
pool's state can no longer be trusted.

Sharing: the ``best_of`` samples of a request are one sequence until its prompt is computed
(once); the scheduler then forks the others, which share its blocks and draw their first
tokens from the same logits with their own seeds. Beam search (``add_beam_search_request``)
keeps a ``BeamSearchState`` per prompt: each step every live beam's top-2k logprobs come
from the sampler, and once all beams of the prompt have theirs the engine selects the next
beams, forking the sequences that continue more than once and freeing those that end.

Structured outputs: each sample of a constrained request has a grammar matcher
(``Request.grammar``, compiled and cached by ``GrammarCompiler``) that takes each of its tokens
as it is appended; the runner fills the sample's row of the step's token bitmask from it. A
constrained row must not run ahead of its matcher, so its steps run synchronously and one
decode step at a time (it never joins a multi-step group). A sample whose grammar is complete
ends with "stop"; one whose grammar refuses its token, or is complete before ``min_tokens``, is
at a dead end and ends with "error" (vLLM's ``FINISHED_ERROR``).
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxpaged import host_memory, parallel
from jaxpaged.auto_dtype import resolve_auto_dtype
from jaxpaged.beam_search import BeamSearchParams, BeamSearchState
from jaxpaged.config import EngineArgs, EngineConfig, keeps_quantized_blocks
from jaxpaged.generation_config import load_generation_defaults
from jaxpaged.kv_cache_manager import KVCacheManager, SharingStats
from jaxpaged.kv_cache_size import auto_kv_cache_memory, budget_rule
from jaxpaged.model_runner import LaunchedStep, ModelRunner, StepOutput
from jaxpaged.request import CompletionOutput, Logprob, Request, RequestOutput, RequestStatus, TokenLogprobs
from jaxpaged.sampling_params import ParamError, RequestOutputKind, SamplingParams, excerpt, is_unicode
from jaxpaged.scheduler import Scheduler, SchedulerOutput
from jaxpaged.step_stats import StepStats
from jaxpaged.structured_outputs import GrammarCompiler
from jaxpaged.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxpaged.weights import load_checkpoint
from jaxpaged.models.registry import build_model
from jaxpaged.kernels import resolve_backend, resolve_matmul_backend

logger = logging.getLogger(__name__)

_SEED_MASK = (1 << 64) - 1


def _sample_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` of a request (sample 0 keeps the request's seed): a splitmix64 step,
    so samples of one request, and of requests with nearby seeds, draw unrelated streams."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _SEED_MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _SEED_MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _SEED_MASK
    return z ^ (z >> 31)


def _stop_prefix_len(text: str, stops: list[str], end: int) -> int:
    """Length of the longest tail of ``text[:end]`` that is a proper prefix of a stop string (held
    back while streaming: the next tokens may complete the stop string, and it must never be sent)."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, end), best, -1):
            if text.endswith(stop[:k], 0, end):
                best = k
                break
    return best


class _UnspacedSpecialsDetokenizer(IncrementalDetokenizer):
    """``spaces_between_special_tokens=False``: added tokens are decoded on their own and joined to
    the surrounding text with no separator, whatever spaces the tokenizer's decoder would put there."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self._added = {i: t.content for i, t in tokenizer.hf.added_tokens_decoder.items()}
        super().__init__(tokenizer, prompt_token_ids, skip_special_tokens)

    def _decode(self, token_ids: list[int]) -> str:
        pieces, run = [], []
        for t in token_ids:
            if t not in self._added:
                run.append(t)
                continue
            if run:
                pieces.append(super()._decode(run))
                run = []
            if not (self._skip_special_tokens and t in self._tokenizer.all_special_ids):
                pieces.append(self._added[t])
        if run:
            pieces.append(super()._decode(run))
        return "".join(pieces)


@dataclass
class _BeamSearch:
    """One beam search request: its HF-equivalent state and its live beams (sequences)."""

    root: Request
    params: BeamSearchParams
    state: BeamSearchState
    beams: list[Request]
    cum: dict[str, float] = field(default_factory=dict)
    pending: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    """Live beam id -> its best 2k next tokens and logprobs, once its step has run."""
    num_forks: int = 0

    def __post_init__(self) -> None:
        self.cum.setdefault(self.root.request_id, 0.0)


@dataclass
class _InFlight:
    """A launched step whose samples the engine has not taken in yet."""

    out: SchedulerOutput
    launched: LaunchedStep


@dataclass(frozen=True)
class CacheInfo:
    """How the KV-cache budget was turned into blocks (reported at start-up)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1          # block 0 is the null block

    @property
    def num_tokens(self) -> int:
        return self.num_usable_blocks * self.block_size


class LLMEngine:
    """The synchronous engine; ``LLM`` and the async server drive it."""

    def __init__(self, config: EngineConfig, devices: Sequence[jax.Device] | None = None):
        """``devices``: the devices of this engine's tensor-parallel group (a data-parallel replica's);
        default: the first ``tensor_parallel_size`` devices."""
        tp = config.parallel.tensor_parallel_size
        mesh = parallel.engine_mesh(tp, devices)    # before loading: too few devices fails fast
        group = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
        self.config = config = resolve_auto_dtype(config, group[0].platform)
        mc, cc, sc = config.model, config.cache, config.scheduler
        matmul = resolve_matmul_backend(config.matmul_backend, dtype=mc.dtype, num_devices=1 if mesh is None else mesh.size,
                                        quantized=config.quantization == "gguf")
        if config.cache_dir:
            jax.config.update("jax_compilation_cache_dir", os.path.join(config.cache_dir, "xla"))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        t0 = time.perf_counter()
        dtype = jnp.dtype(mc.dtype)
        ckpt = load_checkpoint(mc.model, dtype=dtype, revision=mc.revision, download_dir=mc.download_dir)
        self.tokenizer = Tokenizer.load(mc.tokenizer_source or ckpt.path, revision=mc.tokenizer_revision,
                                        download_dir=mc.download_dir)
        self.generation_defaults = load_generation_defaults(ckpt.path, mc.generation_config)
        """The model's generation config: defaults of the sampling parameters a request leaves unset, and
        EOS ids (``LLM.get_default_sampling_params`` and the server read it)."""
        model = build_model(ckpt.config, ckpt.tensors, dtype, resolve_backend(config.attention_backend, dtype=dtype),
                            params=ckpt.params, matmul_backend=matmul,
                            quantized=ckpt.quantized if keeps_quantized_blocks(config.quantization, mc.dtype) else None)
        del ckpt
        if mesh is not None:
            model = parallel.shard_model(model, mesh)
        self.vocab_size = model.shape.vocab_size
        s = model.shape
        # Per device: under tensor parallelism a device holds num_kv_heads / tp heads of every block.
        bytes_per_block = s.num_layers * 2 * cc.block_size * (s.num_kv_heads // tp) * s.head_dim * dtype.itemsize
        max_pos = s.max_position_embeddings
        if mc.max_model_len is not None and mc.max_model_len > max_pos:
            raise ValueError(f"max_model_len={mc.max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_pos}; use at most {max_pos}.")
        kv_memory = cc.kv_cache_memory
        if cc.sized_automatically:
            kv_memory = auto_kv_cache_memory(bytes_per_block, cc.block_size, sc.max_num_seqs,
                                             mc.max_model_len or max_pos, group, cc.gpu_memory_utilization)
        num_blocks = cc.num_blocks_override or kv_memory // bytes_per_block
        if num_blocks < 2:
            if cc.num_blocks_override:
                raise ValueError(f"num_gpu_blocks_override={num_blocks}: the pool needs at least 2 blocks "
                                 f"(block 0 is the reserved null block).")
            budget = (f"{budget_rule(cc.gpu_memory_utilization)} ({kv_memory} bytes)" if cc.sized_automatically
                      else f"kv_cache_memory={kv_memory} bytes")
            raise ValueError(f"{budget} holds {max(num_blocks, 0)} blocks of {bytes_per_block} bytes; give at least "
                             f"{2 * bytes_per_block} bytes (kv_cache_memory).")
        pool_tokens = (num_blocks - 1) * cc.block_size
        # Unless told otherwise, a sequence may grow as long as the model allows and the pool holds.
        self.max_model_len = mc.max_model_len or min(max_pos, pool_tokens)
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"with chunked prefill disabled, max_num_batched_tokens "
                             f"({sc.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len}).")
        self.cache_info = CacheInfo(num_blocks, cc.block_size, bytes_per_block)
        num_host_blocks = cc.swap_space // bytes_per_block
        self.kv_cache_manager = KVCacheManager(num_blocks, cc.block_size, enable_caching=cc.enable_prefix_caching,
                                               num_host_blocks=num_host_blocks)
        self.scheduler = Scheduler(sc, self.kv_cache_manager, self.max_model_len)
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=cc.block_size, dtype=dtype,
                                  max_num_batched_tokens=sc.max_num_batched_tokens,
                                  max_num_seqs=sc.max_num_seqs, max_model_len=self.max_model_len,
                                  num_host_blocks=num_host_blocks)
        self._seed_rng = random.Random(mc.seed)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._groups: dict[str, Request] = {}
        """Every live sample's request id -> the request it belongs to (the first sample)."""
        self._beam_searches: dict[str, _BeamSearch] = {}
        """Beam search request id -> its state; ``_beam_of`` maps each live beam's id to it."""
        self._beam_of: dict[str, _BeamSearch] = {}
        self._token_text: dict[int, str] = {}
        eos_ids = [self.tokenizer.eos_token_id, *self.generation_defaults.eos_token_ids]
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, [t for t in eos_ids if t is not None])
        """Structured outputs' grammars for this model's tokenizer (EOS and the generation config's end them)."""
        self.async_scheduling = config.async_scheduling
        self._in_flight: _InFlight | None = None
        self._failed: list[RequestOutput] = []
        """The last outputs of requests that failed (``_fail``), for ``step`` to return."""
        self._num_synchronous = 0
        """Live requests whose steps need the previous step's tokens on the host (penalties)."""
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
        logger.info("loaded %s in %.1f s; KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB%s%s)",
                    mc.model, self.load_time, self.cache_info.num_usable_blocks, cc.block_size,
                    self.cache_info.num_tokens, num_blocks * bytes_per_block / 2**20,
                    f" per device, {tp} devices" if tp > 1 else "",
                    ", sized automatically" if cc.sized_automatically else "")

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        """The engine for ``args``: with ``data_parallel_size > 1`` a ``DataParallelEngine`` (the same
        public API over several replicas)."""
        config = args.create_engine_config()
        if config.parallel.data_parallel_size > 1:
            from jaxpaged.data_parallel import DataParallelEngine
            return DataParallelEngine(config)
        return cls(config)

    # ---- requests -------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt: str | Sequence[int],
                     sampling_params: SamplingParams | None = None,
                     arrival_time: float | None = None, cache_salt: str | None = None,
                     priority: int = 0) -> Request:
        """Validate one request and build its state without queueing it (raises ``ValueError``).
        ``priority``: lower runs sooner, under the ``priority`` scheduling policy (vLLM's); else 0."""
        sp = sampling_params or self.generation_defaults.sampling_params()
        self._check_priority(priority)
        if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt and is_unicode(cache_salt)):
            raise ParamError("cache_salt", f"cache_salt must be a non-empty string of valid Unicode, "
                                           f"got {excerpt(cache_salt)}.")
        # Before building ``best_of`` samples: a huge ``n`` is refused at once, not after allocating them.
        if sp.best_of > self.scheduler.config.max_num_seqs:
            raise ParamError("best_of" if sp.best_of > sp.n else "n",
                             f"n and best_of ({sp.best_of}) must be at most max_num_seqs "
                             f"({self.scheduler.config.max_num_seqs}): a request's samples run at once.")
        if isinstance(prompt, str):
            if not is_unicode(prompt):
                raise ParamError("prompt", "prompt is not valid Unicode (it holds a lone surrogate); send UTF-8 text.")
            at_least = self.tokenizer.min_num_tokens(prompt)
            if at_least >= self.max_model_len:            # refused without spending seconds tokenizing it
                raise ValueError(f"the prompt has at least {at_least} tokens, but max_model_len is {self.max_model_len}; "
                                 f"shorten the prompt to at most {self.max_model_len - 1} tokens.")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}.")
        if not ids:
            raise ValueError("the prompt is empty; give at least one token.")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}; "
                             f"shorten the prompt to at most {self.max_model_len - 1} tokens.")
        max_tokens = sp.max_tokens if sp.max_tokens is not None else room
        if max_tokens > room:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                             f"({self.max_model_len}); lower max_tokens to at most {room}.")
        too_big = [t for t in [*sp.stop_token_ids, *sp.logit_bias] if t >= self.vocab_size]
        if too_big:
            raise ValueError(f"stop_token_ids and logit_bias keys must be token ids in [0, {self.vocab_size}); "
                             f"got {too_big[:5]}.")
        so = sp.structured_outputs
        # One matcher per sample; an invalid grammar raises here, before anything is queued.
        grammars = [None] * sp.best_of if so is None else [self.grammars.matcher(so) for _ in range(sp.best_of)]
        seed = (sp.seed if sp.seed is not None else self._seed_rng.getrandbits(63)) & _SEED_MASK
        arrival = arrival_time if arrival_time is not None else time.time()
        eos = self.tokenizer.eos_token_id
        sp = self._with_model_eos(sp, eos)
        # Stop strings and grammars read every token: no fast path passes over it.
        stop_ids = None if sp.stop or so else frozenset([*sp.stop_token_ids, *([] if eos is None else [eos])])
        final = sp.output_kind is RequestOutputKind.FINAL_ONLY
        samples = [Request(request_id=request_id if i == 0 else f"{i}_{request_id}", prompt_token_ids=ids,
                           sampling_params=sp, max_tokens=max_tokens, seed=_sample_seed(seed, i),
                           eos_token_id=eos, final_stop_ids=stop_ids if final else None,
                           stream_stop_ids=None if final else stop_ids, multi_step=not sp.needs_step_lists,
                           cache_salt=cache_salt, prompt=text,
                           arrival_time=arrival,
                           sample_index=i, priority=priority,
                           output_top_logprobs=[] if sp.logprobs is not None else None, grammar=grammars[i],
                           prompt_logprobs=[None] if i == 0 and sp.prompt_logprobs is not None else None)
                   for i in range(sp.best_of)]
        samples[0].forks = samples[1:]
        return samples[0]

    def _check_priority(self, priority: int) -> None:
        """vLLM's rule: a priority other than 0 needs the ``priority`` scheduling policy (under ``fcfs``
        it would silently mean nothing)."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ParamError("priority", f"priority must be an integer, got {excerpt(priority)}.")
        if priority and self.scheduler.config.scheduling_policy != "priority":
            raise ParamError("priority", f"priority must be 0 unless the scheduling policy is priority "
                                         f"(--scheduling-policy priority); got {priority}.")

    def _with_model_eos(self, sp: SamplingParams, eos: int | None) -> SamplingParams:
        """``sp`` with the generation config's other EOS ids added to its stop token ids, unless it ignores
        EOS (vLLM's ``update_from_generation_config``: they stop generation as stop ids do, and min_tokens
        holds them back). A copy: the caller's ``sp`` may serve other requests."""
        extra = [t for t in self.generation_defaults.eos_token_ids if t != eos and t not in sp.stop_token_ids]
        if not extra or sp.ignore_eos:
            return sp
        return replace(sp, stop_token_ids=[*sp.stop_token_ids, *extra])

    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    sampling_params: SamplingParams | None = None, arrival_time: float | None = None,
                    cache_salt: str | None = None, priority: int = 0) -> Request:
        req = self.make_request(request_id, prompt, sampling_params, arrival_time, cache_salt, priority)
        self.add_prepared_request(req)
        return req

    def add_prepared_request(self, req: Request) -> None:
        """Queue a request made by ``make_request`` with all its samples, or none of them."""
        self.add_prepared_requests([req])

    def add_prepared_requests(self, reqs: Sequence[Request]) -> None:
        """Queue requests made by ``make_request``, the prompts of one API request, with all their
        samples, or none of them; they take turns with other calls' requests (``Scheduler.add_requests``)."""
        members = [(req, r) for req in reqs for r in (req, *req.forks)]
        taken = [req.request_id for req, r in members
                 if r.request_id in self._groups or r.request_id in self._beam_searches]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use; give each request a unique id.")
        # Built first: once the scheduler holds the requests, nothing left here can fail.
        detokenizers = [self._detokenizer(req.sampling_params, r) for req, r in members]
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
        self._num_synchronous += sum(req.sampling_params.needs_host_tokens for req in reqs)
        for (req, r), d in zip(members, detokenizers):
            self._detokenizers[r.request_id] = d
            self._groups[r.request_id] = req

    def _detokenizer(self, sp: SamplingParams, r: Request) -> IncrementalDetokenizer:
        kind = IncrementalDetokenizer if sp.spaces_between_special_tokens else _UnspacedSpecialsDetokenizer
        return kind(self.tokenizer, r.prompt_token_ids, sp.skip_special_tokens)

    def abort_request(self, request_id: str) -> None:
        """Abort a request (all its samples, or all its beams)."""
        search = self._beam_searches.pop(request_id, None)
        if search is not None:
            for beam in search.beams:
                self.scheduler.abort_request(beam.request_id)
                self._beam_of.pop(beam.request_id, None)
            search.beams = []
            return
        parent = self._groups.get(request_id)
        if parent is None:
            self.scheduler.abort_request(request_id)
            return
        for r in [parent, *parent.forks]:
            if self.scheduler.abort_request(r.request_id) is None and not r.is_finished:
                r.status = RequestStatus.FINISHED_ABORTED      # a sample not forked yet
        parent.pending_forks = ()
        self._forget(parent)

    def _forget(self, parent: Request) -> None:
        """Drop the per-sample state of a request that finished or was aborted."""
        if parent.request_id in self._groups:
            self._num_synchronous -= parent.sampling_params.needs_host_tokens
        for r in [parent, *parent.forks]:
            self._detokenizers.pop(r.request_id, None)
            self._groups.pop(r.request_id, None)

    def has_unfinished_requests(self) -> bool:
        """Requests queued or running. (A request whose last token is in flight is running until
        ``step()`` takes it in; a step in flight holding only finished or aborted requests is not
        waited for: the next ``step()`` drops its tokens.)"""
        return self.scheduler.has_unfinished_requests()

    def sharing_stats(self) -> SharingStats:
        """Blocks used now vs. blocks the live sequences would hold without sharing
        (``saved_fraction`` = (without - used) / without)."""
        return self.kv_cache_manager.sharing_stats()

    # ---- beam search ----------------------------------------------------------------------

    def add_beam_search_request(self, request_id: str, prompt: str | Sequence[int], params: BeamSearchParams,
                                arrival_time: float | None = None, cache_salt: str | None = None) -> Request:
        """Queue a beam search over one prompt; its one ``RequestOutput`` (when finished) holds
        the ``beam_width`` best beams, best first, as ``outputs``."""
        if request_id in self._groups or request_id in self._beam_searches:
            raise ValueError(f"request id {request_id!r} is already in use; give each request a unique id.")
        k = params.beam_width
        # Greedy rows asking for the top-N logprobs: the N >= 2k best continuations of each beam.
        sp = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True, logprobs=2 * k)
        root = self.make_request(request_id, prompt, sp, arrival_time, cache_salt)
        root.reserved_seqs, root.multi_step = k - 1, False
        self.scheduler.add_request(root)
        search = _BeamSearch(root, params, BeamSearchState(params, self.tokenizer.eos_token_id), [root])
        self._beam_searches[request_id] = search
        self._beam_of[request_id] = search
        return root

    def _beam_step(self, search: "_BeamSearch") -> RequestOutput | None:
        """Select the next beams once every live beam has its candidates; the output when done."""
        if any(b.request_id not in search.pending for b in search.beams):
            return None
        beams = search.beams
        conts = search.state.step([(search.cum[b.request_id], b.output_token_ids, b.output_logprobs) for b in beams],
                                  [search.pending[b.request_id] for b in beams])
        search.pending.clear()
        search.root.reserved_seqs = 0
        for b in beams:
            b.waiting_for_group = False
        children: dict[int, list] = {}
        for c in conts:
            children.setdefault(c.beam, []).append(c)
        # Beams that do not continue free their blocks first (making room), then the rest fork.
        for i, b in enumerate(beams):
            if i not in children:
                self.scheduler.finish_request(b, RequestStatus.FINISHED_STOPPED)
                self._beam_of.pop(b.request_id, None)
        new_beams = []
        for i, b in enumerate(beams):
            for c in children.get(i, [])[1:]:
                search.num_forks += 1
                child = Request(request_id=f"beam{search.num_forks}_{search.root.request_id}",
                                prompt_token_ids=b.prompt_token_ids, sampling_params=b.sampling_params,
                                max_tokens=b.max_tokens, seed=b.seed, eos_token_id=b.eos_token_id,
                                cache_salt=b.cache_salt, arrival_time=b.arrival_time, priority=b.priority,
                                output_token_ids=b.output_token_ids + [c.token],
                                output_logprobs=b.output_logprobs + [c.logprob], output_top_logprobs=[])
                self.scheduler.fork_request(b, child)
                self._beam_of[child.request_id] = search
                search.cum[child.request_id] = c.cum_logprob
                new_beams.append(child)
            if i in children:
                c = children[i][0]
                b.output_token_ids.append(c.token)
                b.output_logprobs.append(c.logprob)
                search.cum[b.request_id] = c.cum_logprob
                new_beams.append(b)
        search.beams = new_beams
        if not search.state.done:
            return None
        del self._beam_searches[search.root.request_id]
        return self._beam_output(search)

    def _beam_output(self, search: "_BeamSearch") -> RequestOutput:
        root = search.root
        outs = [CompletionOutput(index=rank, text=self.tokenizer.decode(h.token_ids, skip_special_tokens=True),
                                 token_ids=list(h.token_ids), cumulative_logprob=h.cum_logprob,
                                 logprobs=[{t: Logprob(l)} for t, l in zip(h.token_ids, h.logprobs)],
                                 finish_reason="stop" if h.eos else "length")
                for rank, h in enumerate(search.state.finished)]
        return RequestOutput(root.request_id, root.prompt, root.prompt_token_ids, outs, finished=True,
                             metrics={"arrival_time": root.arrival_time, "finished_time": time.time()})

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration. With async scheduling: schedule and launch a step, then take in the
        previous one's samples (while the new one runs) and return their outputs. Otherwise, or
        when the step needs the previous step's tokens on the host: finish the step in flight,
        then schedule, run and take in a step."""
        if self.async_scheduling and not self._num_synchronous and not self._beam_searches:
            launched = self._launch()
            outputs = self._take_in(self._in_flight)
            self._in_flight = launched
        else:
            outputs = self._take_in(self._in_flight)
            self._in_flight = None
            outputs += self._take_in(self._launch())
        if self._failed:
            outputs += self._failed
            self._failed = []
        return outputs

    def _launch(self) -> _InFlight | None:
        out = self.scheduler.schedule()
        launched = self.runner.launch(out)          # block transfers even when nothing runs (swap-outs of idle beams)
        for request_id, error in self.runner.slots.take_failed().items():
            self._fail(request_id, error)
        return None if launched is None else _InFlight(out, launched)

    def _fail(self, request_id: str, error: Exception) -> None:
        """End the request of sample (or beam) ``request_id``, whose own processing raised ``error``, with
        finish reason "error" (vLLM's ``FINISHED_ERROR``): its blocks are freed and the others go on, as
        nothing they share was changed. Its last output goes out with the step's (``_failed``)."""
        search = self._beam_of.get(request_id)
        parent = search.root if search is not None else self._groups.get(request_id)
        if parent is None:
            return                                  # already ended
        logger.error("request %s failed (%s); it ends with an error, the others go on", parent.request_id,
                     type(error).__name__, exc_info=error)
        if search is not None:
            self.abort_request(parent.request_id)
            n = search.params.beam_width
        else:
            for r in [parent, *parent.forks]:
                if not r.is_finished:
                    self.scheduler.finish_request(r, RequestStatus.FINISHED_ERROR)
                    r.status = RequestStatus.FINISHED_ERROR     # also a sample not forked yet
            parent.pending_forks = ()
            self._forget(parent)
            n = parent.sampling_params.n
        outputs = [CompletionOutput(i, "", [], None, None, "error") for i in range(n)]
        self._failed.append(RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, True,
                                          {"arrival_time": parent.arrival_time, "finished_time": time.time()}))

    def _take_in(self, step: _InFlight | None) -> list[RequestOutput]:
        """Wait for a launched step and process its samples: append tokens, check stops, build outputs."""
        if step is None:
            return []
        out, res = step.out, self.runner.collect(step.launched)
        now = time.time()
        self._record_prompt_logprobs(out.requests, res)
        touched: dict[str, Request] = {}
        searches: dict[str, _BeamSearch] = {}
        if out.num_steps > 1:
            num_first_or_dropped = self._append_steps(out, res.sampled, now, touched, searches)
        else:
            # Rows that sample: requests whose step reached their last known token, then the forks.
            R = len(out.requests)
            rows = itertools.compress(enumerate(out.requests), out.samples)
            if out.forks:
                rows = itertools.chain(rows, ((R + j, child) for j, (_, child) in enumerate(out.forks)))
            num_first_or_dropped = self._append_samples(rows, res.sampled, now, touched, searches)
        self._record_step(out, now, num_first_or_dropped)
        outputs = []
        for parent in touched.values():
            if parent.request_id not in self._groups:
                continue                            # one of its samples failed (``_fail``) after it reported
            try:
                output = self._make_output(parent)
            except Exception as e:
                self._fail(parent.request_id, e)
                continue
            if output is not None:
                outputs.append(output)
            if output is not None and output.finished:
                self._forget(parent)
        for search in searches.values():
            if search.root.request_id not in self._beam_searches:
                continue                            # it failed (``_fail``) after a beam reported
            try:
                output = self._beam_step(search)
            except Exception as e:
                self._fail(search.root.request_id, e)
                continue
            if output is not None:
                outputs.append(output)
        return outputs

    def _append_steps(self, out: SchedulerOutput, sampled, now: float, touched: dict[str, Request],
                      searches: dict[str, "_BeamSearch"]) -> int:
        """A multi-step batch's samples (``[num_steps, rows]`` arrays), row by row. A row with no stop
        strings (``final_stop_ids`` or ``stream_stop_ids``) and no logprobs in the batch, none of whose
        tokens ends it, takes them all at once (a streamed one: detokenized at once, as one delta);
        the others go token by token through ``_append_samples``. Returns how many tokens were a
        sample's first, or were dropped (as ``_append_samples``)."""
        k = out.num_steps
        num_first = 0
        plain = sampled.logprobs.size == 0
        columns = sampled.tokens.T.tolist()
        rest = []
        running = RequestStatus.RUNNING
        for j, (req, n) in enumerate(zip(out.requests, out.num_new_tokens)):
            ids, stream = req.output_token_ids, req.stream_stop_ids
            stops = req.final_stop_ids if stream is None else stream
            if plain and stops is not None and (req.status is running or not req.is_finished):
                new = columns[j][:n] if n < k else columns[j]
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
                            self._fail(req.request_id, e)
                    continue
            rest.extend(range(j * k, j * k + n))
        if rest:
            # Row-major: entry j * k + t is row j's sample of step t.
            flat = jax.tree_util.tree_map(lambda a: a.swapaxes(0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:]), sampled)
            return num_first + self._append_samples(((i, out.requests[i // k]) for i in rest), flat, now, touched,
                                                    searches)
        return num_first

    def _append_samples(self, rows, sampled, now: float, touched: dict[str, Request],
                        searches: dict[str, "_BeamSearch"]) -> int:
        """Append one step's sampled token to each ``(row, request)`` of ``rows`` and check its stops;
        the groups with something to report go to ``touched``, the beam searches to ``searches``.
        Returns how many of the tokens were a sample's first or were dropped (counted in these rare
        branches, so that ``_record_step`` knows the decode tokens without a count per row)."""
        tokens, logprobs = sampled.tokens.tolist(), sampled.logprobs.tolist()
        beam_of, running = self._beam_of, RequestStatus.RUNNING
        num_first_or_dropped = 0
        for i, req in rows:
            req.num_output_placeholders -= 1
            # Aborted (or stopped) while this step ran: its token is dropped. The identity test first:
            # a property call per row costs ~0.2 us, 50 us a step at 256 rows (measured).
            if req.status is not running and req.is_finished:
                num_first_or_dropped += 1
                continue
            try:                            # one request's failure is its own (``_fail``), not the step's
                if beam_of:
                    search = beam_of.get(req.request_id)
                    if search is not None:
                        k2 = 2 * search.params.beam_width
                        search.pending[req.request_id] = (sampled.top_ids[i, :k2].tolist(),
                                                          sampled.top_logprobs[i, :k2].tolist())
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
                    req.grammar.accept(token)           # its verdict is read by ``_stop_status``
                if logprobs and sp.needs_logprobs:
                    req.output_logprobs.append(logprobs[i])
                if req.output_top_logprobs is not None:
                    req.output_top_logprobs.append(self._token_logprobs(
                        token, logprobs[i], int(sampled.ranks[i]), sampled.top_ids[i, :sp.logprobs],
                        sampled.top_logprobs[i, :sp.logprobs]))
                # The common decode step: with no stop strings only EOS, a stop id or the length limit can
                # end a sample, and none does here.
                stops = req.final_stop_ids
                if stops is not None and len(ids) < req.max_tokens and token not in stops:
                    continue                    # detokenized when it ends (``_check_stop``)
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
                parent = self._groups[req.request_id]
                touched[parent.request_id] = parent
            except Exception as e:
                self._fail(req.request_id, e)
        return num_first_or_dropped

    def _record_step(self, out: SchedulerOutput, now: float, num_first_or_dropped: int) -> None:
        """Count the tokens the step computed, and the gap before each decode token it sampled: the time
        since the previous step's take-in, when every sample that ran in that step took its previous
        token (one that sat out steps, as after a preemption, waited longer than counted), shared
        evenly by a multi-step batch's steps."""
        stats = self.step_stats
        stats.iteration_tokens.observe(out.total_num_tokens)
        sampled = out.total_num_tokens if out.num_steps > 1 else out.samples.count(True) + len(out.forks)
        num_decode = sampled - num_first_or_dropped
        if num_decode > 0 and self._last_take_in is not None:
            stats.inter_token_latency.observe((now - self._last_take_in) / out.num_steps, num_decode)
        self._last_take_in = now

    def _passed(self, req: Request, new: Sequence[int], touched: dict[str, Request]) -> None:
        """Take in ``new``, tokens just appended to a streamed sample with no stop strings
        (``stream_stop_ids``) that end nothing: their text is added and the sample's group reports."""
        self._detokenizers[req.request_id].step(new)
        parent = self._groups[req.request_id]
        touched[parent.request_id] = parent

    def _record_prompt_logprobs(self, reqs: list[Request], res: StepOutput) -> None:
        """Append this step's scored prompt positions (consecutive, in order, per row)."""
        if res.prompt is None:
            return
        p = res.prompt
        for j, row in enumerate(res.prompt_rows.tolist()):
            req = reqs[row]
            k = req.sampling_params.prompt_logprobs
            try:
                req.prompt_logprobs.append(self._token_logprobs(
                    int(p.tokens[j]), float(p.logprobs[j]), int(p.ranks[j]), p.top_ids[j, :k], p.top_logprobs[j, :k]))
            except Exception as e:
                self._fail(req.request_id, e)

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
        elif self._stop_status(req, "", 0) is None:     # its stops do not read the text
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
        if grammar is not None and (grammar.error is not None or (grammar.complete and num_outputs < sp.min_tokens)):
            return RequestStatus.FINISHED_ERROR
        if num_outputs < sp.min_tokens:
            return None
        eos = token == req.eos_token_id and not sp.ignore_eos
        if eos or token in sp.stop_token_ids:
            req.stop_reason = None if eos else token
            if not sp.include_stop_str_in_output:
                req.output_text_end = before        # the stop token's own text is not output
            return RequestStatus.FINISHED_STOPPED
        hits = sp.stop and [(at, stop) for stop in sp.stop
                            if (at := text.find(stop, max(0, before - len(stop) + 1))) >= 0]
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
        delta_text, req.num_text_sent = full[req.num_text_sent:end], end
        ids, sent = req.output_token_ids, req.num_tokens_sent
        req.num_tokens_sent = len(ids)
        delta_ids = ids[sent:]
        top = req.output_top_logprobs
        if sp.output_kind is RequestOutputKind.DELTA:       # O(new tokens): nothing old is copied
            text, token_ids, top = delta_text, delta_ids, None if top is None else top[sent:]
        else:
            text, token_ids, top = full[:end], list(ids), None if top is None else list(top)
        # Positional: a dataclass's keyword call costs twice as much, per sample per step.
        return CompletionOutput(req.sample_index, text, token_ids,
                                req.cumulative_logprob if sp.needs_logprobs else None, top,
                                req.status.finish_reason, req.stop_reason, delta_text, delta_ids)

    def _make_output(self, parent: Request) -> RequestOutput | None:
        """The request's output, or None while ``best_of > n`` samples run (the best are only known at
        the end) or while a ``FINAL_ONLY`` request runs."""
        sp, forks = parent.sampling_params, parent.forks
        samples = [parent, *forks]
        finished = parent.is_finished and (not forks or all(r.is_finished for r in forks))
        if not finished and (sp.best_of > sp.n or sp.output_kind is RequestOutputKind.FINAL_ONLY):
            return None
        if sp.best_of > sp.n:
            samples = sorted(samples, key=lambda r: r.cumulative_logprob, reverse=True)[:sp.n]
        metrics = {"arrival_time": parent.arrival_time, "first_scheduled_time": parent.first_scheduled_time}
        first = (parent.first_token_time if not forks else
                 min((t for r in samples if (t := r.first_token_time) is not None), default=None))
        if first is not None:
            metrics["first_token_time"] = first
        if finished:
            metrics["finished_time"] = max(r.finished_time or 0.0 for r in samples)
        prompt_logprobs = parent.prompt_logprobs
        if prompt_logprobs is not None:
            if sp.output_kind is not RequestOutputKind.DELTA:
                prompt_logprobs = list(prompt_logprobs)
            elif any(r.num_tokens_sent for r in samples):
                prompt_logprobs = None              # sent with the first output
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             [self._completion(r) for r in samples], finished, metrics,
                             prompt_logprobs)
