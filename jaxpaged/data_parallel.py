"""Data parallelism: ``data_parallel_size`` engine replicas behind one front end.

Each replica is a whole ``LLMEngine`` (its own scheduler, KV pool and model copy) on its own
row of ``parallel.device_grid(tp, dp)``: ``tp`` devices, tensor-parallel within. The front end
has the engine's public API (``LLM``, ``AsyncLLMEngine`` and so the server use it unchanged)
and routes each new request to one replica:

* prefix-aware (with prefix caching on): a prompt whose first full block was seen before goes
  to the replica that computed it, which likely still has its blocks cached, unless that replica
  is more than a full batch (``max_num_seqs``) more loaded than the least loaded one;
* otherwise to the least loaded replica (running + waiting requests; ties: lowest index).

A step steps every replica that has work, in parallel threads (the jitted programs release the
GIL), and returns their outputs together.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

from jaxpaged import parallel
from jaxpaged.beam_search import BeamSearchParams
from jaxpaged.block_hash import hash_block, root_hash
from jaxpaged.config import EngineConfig
from jaxpaged.engine_base import EngineBase, request_id_in_use
from jaxpaged.kv_cache_manager import PrefixCacheStats, SharingStats
from jaxpaged.request import Request, RequestOutput
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.spec_decode.metrics import SpecDecodingStats
from jaxpaged.step_stats import StepStats

if TYPE_CHECKING:  # annotations only: ``engine`` imports this module, and builds the replicas for it
    from jaxpaged.engine import LLMEngine

logger = logging.getLogger(__name__)

_MAX_ROUTES = 1 << 16


class Router:
    """Chooses a replica for each new request: prefix-aware, else least loaded."""

    def __init__(self, num_replicas: int, block_size: int | None, slack: int):
        """``block_size=None`` turns the prefix-aware part off; ``slack``: how much more loaded than
        the least loaded replica a prefix's replica may be and still get the request."""
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.slack = slack
        self._home: OrderedDict[int, int] = OrderedDict()  # first-block hash -> replica, LRU
        self.num_routed = [0] * num_replicas
        self.num_prefix_routed = 0

    def _key(self, token_ids: Sequence[int], cache_salt: str | None) -> int | None:
        if self.block_size is None or len(token_ids) < self.block_size:
            return None
        return hash_block(root_hash(cache_salt), list(token_ids[: self.block_size]))

    def choose(self, token_ids: Sequence[int], cache_salt: str | None, loads: Sequence[int]) -> int:
        least = min(range(self.num_replicas), key=lambda i: (loads[i], i))
        choice = least
        key = self._key(token_ids, cache_salt)
        if key is not None:
            home = self._home.get(key)
            if home is not None and loads[home] <= loads[least] + self.slack:
                choice = home
                self.num_prefix_routed += 1
            self._home[key] = choice
            self._home.move_to_end(key)
            if len(self._home) > _MAX_ROUTES:
                self._home.popitem(last=False)
        self.num_routed[choice] += 1
        return choice


@dataclass(frozen=True)
class _CacheTotals:
    num_blocks: int
    num_usable_blocks: int
    num_tokens: int
    block_size: int


class _KVTotals:
    """The replicas' KV cache managers summed up (what the server's metrics read)."""

    def __init__(self, engines: Sequence[LLMEngine]):
        self._kv = [e.kv_cache_manager for e in engines]
        self._usable = sum(e.cache_info.num_usable_blocks for e in engines)

    @property
    def num_free_blocks(self) -> int:
        return sum(kv.num_free_blocks for kv in self._kv)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self._usable

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            sum(kv.stats.queries for kv in self._kv), sum(kv.stats.hits for kv in self._kv)
        )

    def sharing_stats(self) -> SharingStats:
        parts = [kv.sharing_stats() for kv in self._kv]
        return SharingStats(sum(p.blocks_used for p in parts), sum(p.blocks_without_sharing for p in parts))


class _SchedulerTotals:
    def __init__(self, engines: Sequence[LLMEngine]):
        self._schedulers = [e.scheduler for e in engines]

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self._schedulers)

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self._schedulers)

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self._schedulers)


class DataParallelEngine(EngineBase):
    """``LLMEngine``'s public API over ``data_parallel_size`` replicas (see the module doc)."""

    def __init__(self, config: EngineConfig, replica: type[LLMEngine]):
        """``replica``: the engine class of each replica (``LLMEngine.from_engine_args`` passes its own)."""
        p = config.parallel
        grid = parallel.device_grid(p.tensor_parallel_size, p.data_parallel_size)  # ValueError if too few
        first = replica(config, devices=list(grid[0]))
        self.config = config = first.config  # dtype "auto" resolved once, by the first replica
        cc = config.cache
        if cc.sized_automatically:
            # The first replica sized its pool from the memory free before it; the later ones would find less
            # (replicas on CPU devices share the host's): they take its size, so all hold the same sequences.
            config = replace(config, cache=replace(cc, num_blocks_override=first.cache_info.num_blocks))
        self.replicas = [first, *(replica(config, devices=list(row)) for row in grid[1:])]
        self.tokenizer = first.tokenizer
        self.generation_defaults = first.generation_defaults
        self.vocab_size = first.vocab_size
        self.max_model_len = first.max_model_len
        self.kv_cache_manager = _KVTotals(self.replicas)
        self.scheduler = _SchedulerTotals(self.replicas)
        self.cache_info = _CacheTotals(
            sum(e.cache_info.num_blocks for e in self.replicas),
            sum(e.cache_info.num_usable_blocks for e in self.replicas),
            sum(e.cache_info.num_tokens for e in self.replicas),
            first.cache_info.block_size,
        )
        self.router = Router(
            len(self.replicas),
            cc.block_size if cc.enable_prefix_caching else None,
            slack=config.scheduler.max_num_seqs,
        )
        self._replica_of: dict[str, int] = {}
        self._threads = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="jaxpaged-dp")
        logger.info("data parallel: %d replicas x %d devices", len(self.replicas), p.tensor_parallel_size)

    def _loads(self) -> list[int]:
        return [e.scheduler.num_running + e.scheduler.num_waiting for e in self.replicas]

    def _route(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None) -> int:
        if request_id in self._replica_of:
            raise request_id_in_use(request_id)
        return self.router.choose(token_ids, cache_salt, self._loads())

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
        return self.replicas[0].make_request(
            request_id, prompt, sampling_params, arrival_time, cache_salt, priority
        )

    def add_prepared_requests(self, reqs: Sequence[Request]) -> None:
        """Route each request, then queue each replica's share together; all of them or none."""
        shares: dict[int, list[Request]] = {}
        for req in reqs:
            shares.setdefault(self._route(req.request_id, req.prompt_token_ids, req.cache_salt), []).append(
                req
            )
        added: list[Request] = []
        try:
            for i, share in shares.items():
                self.replicas[i].add_prepared_requests(share)
                self._replica_of.update((req.request_id, i) for req in share)
                added += share
        except ValueError:
            for req in added:
                self.abort_request(req.request_id)
            raise

    def add_beam_search_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: BeamSearchParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        i = self._route(request_id, ids, cache_salt)
        req = self.replicas[i].add_beam_search_request(request_id, prompt, params, arrival_time, cache_salt)
        self._replica_of[request_id] = i
        return req

    def abort_request(self, request_id: str) -> None:
        i = self._replica_of.pop(request_id, None)
        if i is not None:
            self.replicas[i].abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.replicas)

    def sharing_stats(self) -> SharingStats:
        return self.kv_cache_manager.sharing_stats()

    @property
    def step_stats(self) -> StepStats:
        """The replicas' steps together (a new record)."""
        return sum((e.step_stats for e in self.replicas), StepStats())

    @property
    def spec_decode_stats(self) -> SpecDecodingStats | None:
        """The replicas' speculative-decoding counters together (None without ``speculative_config``)."""
        stats = [e.spec_decode_stats for e in self.replicas]
        return None if stats[0] is None else sum(stats, SpecDecodingStats())

    def memory_per_device(self) -> dict[Any, parallel.DeviceMemory]:
        """Every replica's devices (disjoint) with their parameter and KV bytes."""
        return {d: m for e in self.replicas for d, m in e.runner.memory_per_device().items()}

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        busy = [e for e in self.replicas if e.has_unfinished_requests()]
        if len(busy) == 1:
            outputs = busy[0].step()
        else:
            outputs = [o for f in [self._threads.submit(e.step) for e in busy] for o in f.result()]
        for out in outputs:
            if out.finished:
                self._replica_of.pop(out.request_id, None)
        return outputs
