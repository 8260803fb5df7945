"""The draft-model proposer: a smaller model with the target's tokenizer proposes tokens greedily.

The draft runs in an engine of its own (``draft_engine_config``: one device, its own paged KV pool of
as many blocks as the target's, prefix caching on, synchronous, multi-step decoding). A proposal for a
request is a greedy request of the draft engine over the target request's tokens with ``max_tokens`` =
k: prefix caching finds the full blocks the previous proposal computed, so the draft computes only the
tokens since its last full block (one step), then its k - 1 further tokens in one multi-step program.
Greedy drafts are point masses, which the verification rule (``rejection``) requires.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Sequence

from jaxpaged.config import EngineConfig, ParallelConfig
from jaxpaged.request import Request
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from jaxpaged.tokenizer import Tokenizer


def draft_engine_config(config: EngineConfig, num_blocks: int, max_model_len: int) -> EngineConfig:
    """The draft engine's configuration, from the target's: the draft model with its own tokenizer
    files, ``num_blocks`` KV blocks of the target's size, prefix caching, no tensor or data parallelism,
    no async scheduling, k decode steps per scheduling, no speculation of its own."""
    spec = config.speculative
    return dataclasses.replace(
        config,
        model=dataclasses.replace(
            config.model,
            model=spec.model,
            tokenizer=None,
            revision=None,
            tokenizer_revision=None,
            max_model_len=max_model_len,
            generation_config="vllm",
        ),
        cache=dataclasses.replace(
            config.cache,
            kv_cache_memory=None,
            num_blocks_override=num_blocks,
            enable_prefix_caching=True,
            swap_space=0,
            gpu_memory_utilization=None,
        ),
        scheduler=dataclasses.replace(
            config.scheduler,
            enable_chunked_prefill=True,
            preemption_mode="recompute",
            num_scheduler_steps=spec.num_speculative_tokens,
        ),
        quantization="auto",
        parallel=ParallelConfig(),
        async_scheduling=False,
        speculative=None,
    )


class DraftModelProposer:
    """Proposes with ``engine`` (an ``LLMEngine`` of the draft model), whose tokenizer must be the target's."""

    def __init__(self, engine, tokenizer: Tokenizer, vocab_size: int):
        draft_tok = engine.tokenizer
        if draft_tok.vocab_size != tokenizer.vocab_size or draft_tok.eos_token_id != tokenizer.eos_token_id:
            raise ValueError(
                f"the draft model's tokenizer ({draft_tok.vocab_size} tokens, EOS {draft_tok.eos_token_id}) is "
                f"not the target's ({tokenizer.vocab_size} tokens, EOS {tokenizer.eos_token_id}); "
                f"speculative_config 'model' needs a model with the same tokenizer."
            )
        if engine.vocab_size > vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({engine.vocab_size}) is larger than the target's "
                f"({vocab_size}); its drafts could name tokens the target does not have."
            )
        self.engine = engine
        self._ids = itertools.count()

    def propose_many(self, requests: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        """``ks[i]`` greedy draft tokens for each request, in one batch of the draft engine."""
        ids = []
        for r, k in zip(requests, ks):
            rid = f"draft-{next(self._ids)}"
            params = SamplingParams(
                temperature=0.0, max_tokens=k, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
            )
            self.engine.add_request(rid, r.prompt_token_ids + r.output_token_ids, params)
            ids.append(rid)
        drafts: dict[str, list[int]] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    drafts[out.request_id] = list(out.outputs[0].token_ids)
        return [drafts.get(rid, []) for rid in ids]

    def has_drafts(self, requests: Sequence[Request]) -> bool:
        """A draft model always has drafts to offer."""
        return bool(requests)

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request (the draft engine's prefix cache holds its KV)."""
