"""``LLMEngine``: add requests, step the model, collect outputs.

One ``step()`` = schedule (pure Python) -> run (one jitted program) -> update: append the
sampled tokens, check stops, detokenize incrementally, free finished requests' blocks.
Every input is validated in ``add_request`` before anything is queued, so a bad request
leaves the engine and the other requests untouched.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxpaged.config import EngineArgs, EngineConfig
from jaxpaged.kv_cache_manager import KVCacheManager
from jaxpaged.model_runner import ModelRunner
from jaxpaged.request import CompletionOutput, Request, RequestOutput, RequestStatus
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.scheduler import Scheduler
from jaxpaged.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxpaged.weights import load_checkpoint
from models.registry import build_model
from pallas_kernels import resolve_backend

logger = logging.getLogger(__name__)


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

    def __init__(self, config: EngineConfig):
        self.config = config
        mc, cc, sc = config.model, config.cache, config.scheduler
        if config.compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        t0 = time.perf_counter()
        ckpt = load_checkpoint(mc.model)
        self.tokenizer = Tokenizer.load(mc.tokenizer or ckpt.path)
        dtype = jnp.dtype(mc.dtype)
        model = build_model(ckpt.config, ckpt.tensors, dtype, resolve_backend(config.attention_backend))
        del ckpt
        self.vocab_size = model.shape.vocab_size
        s = model.shape
        bytes_per_block = s.num_layers * 2 * cc.block_size * s.num_kv_heads * s.head_dim * dtype.itemsize
        num_blocks = cc.num_blocks_override or cc.kv_cache_memory // bytes_per_block
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory={cc.kv_cache_memory} bytes holds {num_blocks} blocks of "
                             f"{bytes_per_block} bytes; give at least {2 * bytes_per_block} bytes.")
        pool_tokens = (num_blocks - 1) * cc.block_size
        max_pos = s.max_position_embeddings
        if mc.max_model_len is not None and mc.max_model_len > max_pos:
            raise ValueError(f"max_model_len={mc.max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_pos}; use at most {max_pos}.")
        # Unless told otherwise, a sequence may grow as long as the model allows and the pool holds.
        self.max_model_len = mc.max_model_len or min(max_pos, pool_tokens)
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"with chunked prefill disabled, max_num_batched_tokens "
                             f"({sc.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len}).")
        self.cache_info = CacheInfo(num_blocks, cc.block_size, bytes_per_block)
        self.kv_cache_manager = KVCacheManager(num_blocks, cc.block_size, enable_caching=cc.enable_prefix_caching)
        self.scheduler = Scheduler(sc, self.kv_cache_manager, self.max_model_len)
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=cc.block_size, dtype=dtype,
                                  max_num_batched_tokens=sc.max_num_batched_tokens,
                                  max_num_seqs=sc.max_num_seqs, max_model_len=self.max_model_len)
        self._seed_rng = random.Random(mc.seed)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.load_time = time.perf_counter() - t0
        logger.info("loaded %s in %.1f s; KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB)",
                    mc.model, self.load_time, self.cache_info.num_usable_blocks, cc.block_size,
                    self.cache_info.num_tokens, num_blocks * bytes_per_block / 2**20)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    # ---- requests -------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt: str | Sequence[int],
                     sampling_params: SamplingParams | None = None,
                     arrival_time: float | None = None, cache_salt: str | None = None) -> Request:
        """Validate one request and build its state without queueing it (raises ``ValueError``)."""
        sp = sampling_params or SamplingParams()
        if isinstance(prompt, str):
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
        seed = sp.seed if sp.seed is not None else self._seed_rng.getrandbits(63)
        return Request(request_id=request_id, prompt_token_ids=ids, sampling_params=sp, max_tokens=max_tokens,
                       seed=seed, eos_token_id=self.tokenizer.eos_token_id, cache_salt=cache_salt, prompt=text,
                       arrival_time=arrival_time if arrival_time is not None else time.time())

    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    sampling_params: SamplingParams | None = None, arrival_time: float | None = None,
                    cache_salt: str | None = None) -> Request:
        req = self.make_request(request_id, prompt, sampling_params, arrival_time, cache_salt)
        self.add_prepared_request(req)
        return req

    def add_prepared_request(self, req: Request) -> None:
        self.scheduler.add_request(req)
        self._detokenizers[req.request_id] = IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids, req.sampling_params.skip_special_tokens)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)
        self._detokenizers.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        tokens, logprobs = self.runner.execute(out)
        now = time.time()
        outputs = []
        for i, req in enumerate(out.requests):
            if out.start_positions[i] + out.num_new_tokens[i] < req.num_tokens:
                continue                            # a prefill chunk that is not the prompt's last
            if not req.output_token_ids:
                req.first_token_time = now
            req.output_token_ids.append(int(tokens[i]))
            req.output_logprobs.append(float(logprobs[i]))
            status = self._check_stop(req)
            if status is not None:
                req.finished_time = now
                self.scheduler.finish_request(req, status)
            outputs.append(self._make_output(req))
            if status is not None:
                del self._detokenizers[req.request_id]
        return outputs

    def _check_stop(self, req: Request) -> RequestStatus | None:
        sp = req.sampling_params
        token = req.output_token_ids[-1]
        detok = self._detokenizers[req.request_id]
        delta = detok.step([token])
        if token == req.eos_token_id and not sp.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token in sp.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        for stop in sp.stop:
            at = detok.text.find(stop, max(0, len(detok.text) - len(delta) - len(stop) + 1))
            if at >= 0:
                req.stop_reason = stop
                req.output_text_end = at + len(stop) if sp.include_stop_str_in_output else at
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _make_output(self, req: Request) -> RequestOutput:
        text = self._detokenizers[req.request_id].text
        if req.output_text_end is not None:
            text = text[:req.output_text_end]
        want_logprobs = req.sampling_params.logprobs is not None
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(req.output_token_ids),
            cumulative_logprob=float(sum(req.output_logprobs)),
            logprobs=[{t: lp} for t, lp in zip(req.output_token_ids, req.output_logprobs)] if want_logprobs else None,
            finish_reason=req.status.finish_reason, stop_reason=req.stop_reason)
        metrics = {"arrival_time": req.arrival_time}
        if req.first_token_time is not None:
            metrics["first_token_time"] = req.first_token_time
        if req.finished_time is not None:
            metrics["finished_time"] = req.finished_time
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion],
                             finished=req.is_finished, metrics=metrics)
