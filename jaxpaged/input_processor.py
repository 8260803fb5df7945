"""Request intake: validate a request's inputs, tokenize its prompt, and build its ``Request``
(with one sample per ``best_of``) without queueing it.

Every input is checked here, before anything is queued, so a bad request raises ``ValueError``
(``ParamError`` naming the parameter) and leaves the engine and the other requests untouched.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from typing import Sequence

from jaxpaged.config import SchedulerConfig
from jaxpaged.generation_config import GenerationDefaults
from jaxpaged.math_utils import SEED_MASK
from jaxpaged.param_errors import ParamError, excerpt
from jaxpaged.request import Request
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams, is_unicode
from jaxpaged.structured_outputs import GrammarCompiler
from jaxpaged.tokenizer import Tokenizer


def _sample_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` of a request (sample 0 keeps the request's seed): a splitmix64 step,
    so samples of one request, and of requests with nearby seeds, draw unrelated streams."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & SEED_MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & SEED_MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & SEED_MASK
    return z ^ (z >> 31)


class InputProcessor:
    """Turns ``(request_id, prompt, sampling_params, ...)`` into a validated ``Request``."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        generation_defaults: GenerationDefaults,
        grammars: GrammarCompiler,
        scheduler_config: SchedulerConfig,
        vocab_size: int,
        max_model_len: int,
        seed: int | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.generation_defaults = generation_defaults
        self.grammars = grammars
        self.scheduler_config = scheduler_config
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._seed_rng = random.Random(seed)

    def make_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Validate one request and build its state without queueing it (raises ``ValueError``).
        ``priority``: lower runs sooner, under the ``priority`` scheduling policy (vLLM's); else 0."""
        sp = sampling_params or self.generation_defaults.sampling_params()
        self._check_priority(priority)
        if cache_salt is not None and not (
            isinstance(cache_salt, str) and cache_salt and is_unicode(cache_salt)
        ):
            raise ParamError(
                "cache_salt",
                f"cache_salt must be a non-empty string of valid Unicode, got {excerpt(cache_salt)}.",
            )
        max_num_seqs = self.scheduler_config.max_num_seqs
        # Before building ``best_of`` samples: a huge ``n`` is refused at once, not after allocating them.
        if sp.best_of > max_num_seqs:
            raise ParamError(
                "best_of" if sp.best_of > sp.n else "n",
                f"n and best_of ({sp.best_of}) must be at most max_num_seqs "
                f"({max_num_seqs}): a request's samples run at once.",
            )
        text, ids = self._tokenize(prompt)
        max_tokens = self._check_length(len(ids), sp.max_tokens)
        too_big = [t for t in [*sp.stop_token_ids, *sp.logit_bias] if t >= self.vocab_size]
        if too_big:
            param = "stop_token_ids" if any(t >= self.vocab_size for t in sp.stop_token_ids) else "logit_bias"
            raise ParamError(
                param,
                f"stop_token_ids and logit_bias keys must be token ids in "
                f"[0, {self.vocab_size}); got {too_big[:5]}.",
            )
        so = sp.structured_outputs
        # One matcher per sample; an invalid grammar raises here, before anything is queued.
        grammars = (
            [None] * sp.best_of if so is None else [self.grammars.matcher(so) for _ in range(sp.best_of)]
        )
        seed = (sp.seed if sp.seed is not None else self._seed_rng.getrandbits(63)) & SEED_MASK
        arrival = arrival_time if arrival_time is not None else time.time()
        eos = self.tokenizer.eos_token_id
        sp = self._with_model_eos(sp, eos)
        # Stop strings and grammars read every token: no fast path passes over it.
        stop_ids = None if sp.stop or so else frozenset([*sp.stop_token_ids, *([] if eos is None else [eos])])
        final = sp.output_kind is RequestOutputKind.FINAL_ONLY
        samples = [
            Request(
                request_id=request_id if i == 0 else f"{i}_{request_id}",
                prompt_token_ids=ids,
                sampling_params=sp,
                max_tokens=max_tokens,
                seed=_sample_seed(seed, i),
                eos_token_id=eos,
                final_stop_ids=stop_ids if final else None,
                stream_stop_ids=None if final else stop_ids,
                multi_step=not sp.needs_step_lists,
                cache_salt=cache_salt,
                prompt=text,
                arrival_time=arrival,
                sample_index=i,
                priority=priority,
                output_top_logprobs=[] if sp.logprobs is not None else None,
                grammar=grammars[i],
                prompt_logprobs=[None] if i == 0 and sp.prompt_logprobs is not None else None,
            )
            for i in range(sp.best_of)
        ]
        samples[0].forks = samples[1:]
        return samples[0]

    def _tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and token ids, checked against the vocabulary."""
        if isinstance(prompt, str):
            if not is_unicode(prompt):
                raise ParamError(
                    "prompt", "prompt is not valid Unicode (it holds a lone surrogate); send UTF-8 text."
                )
            at_least = self.tokenizer.min_num_tokens(prompt)
            if at_least >= self.max_model_len:  # refused without spending seconds tokenizing it
                raise ParamError(
                    "prompt",
                    f"the prompt has at least {at_least} tokens, but max_model_len is "
                    f"{self.max_model_len}; shorten the prompt to at most "
                    f"{self.max_model_len - 1} tokens.",
                )
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ParamError("prompt", f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}.")
        return None, ids

    def _check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The admission check: the prompt and its outputs fit ``max_model_len``; returns the resolved
        ``max_tokens`` (what fits, when unset)."""
        if not num_prompt_tokens:
            raise ParamError("prompt", "the prompt is empty; give at least one token.")
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ParamError(
                "prompt",
                f"the prompt has {num_prompt_tokens} tokens, but max_model_len is "
                f"{self.max_model_len}; shorten the prompt to at most "
                f"{self.max_model_len - 1} tokens.",
            )
        max_tokens = max_tokens if max_tokens is not None else room
        if max_tokens > room:
            raise ParamError(
                "prompt",
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len}); lower max_tokens to at most {room}.",
            )
        return max_tokens

    def _check_priority(self, priority: int) -> None:
        """vLLM's rule: a priority other than 0 needs the ``priority`` scheduling policy (under ``fcfs``
        it would silently mean nothing)."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ParamError("priority", f"priority must be an integer, got {excerpt(priority)}.")
        if priority and self.scheduler_config.scheduling_policy != "priority":
            raise ParamError(
                "priority",
                f"priority must be 0 unless the scheduling policy is priority "
                f"(--scheduling-policy priority); got {priority}.",
            )

    def _with_model_eos(self, sp: SamplingParams, eos: int | None) -> SamplingParams:
        """``sp`` with the generation config's other EOS ids added to its stop token ids, unless it ignores
        EOS (vLLM's ``update_from_generation_config``: they stop generation as stop ids do, and min_tokens
        holds them back). A copy: the caller's ``sp`` may serve other requests."""
        extra = [t for t in self.generation_defaults.eos_token_ids if t != eos and t not in sp.stop_token_ids]
        if not extra or sp.ignore_eos:
            return sp
        return replace(sp, stop_token_ids=[*sp.stop_token_ids, *extra])
