"""Structured outputs: grammars compiled by llguidance, a matcher per constrained sample, and the
packed token bitmask of a batch's constrained rows.

llguidance rather than xgrammar (vLLM's default): xgrammar requires torch, which jaxpaged runs
without; ``benchmarks/grammar_backends.py`` times both. A ``GrammarCompiler`` turns a request's
``StructuredOutputsParams`` into a grammar for the engine's tokenizer, once per spec (an LRU cache
of compiled matchers, each request getting a copy); every sample of the request gets its own
``GrammarMatcher``, which the engine advances with each token the sample takes in. The runner
then fills the rows of the constrained samples of a step (``fill_bitmask``), and the sampler masks
the logits with it on the device.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import llguidance.numpy
import numpy as np

from jaxpaged.math_utils import cdiv
from jaxpaged.param_errors import ParamError, excerpt
from jaxpaged.structured_outputs_params import StructuredOutputsParams
from jaxpaged.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one packed bitmask row over ``vocab_size`` tokens."""
    return cdiv(vocab_size, 32)


@dataclass(eq=False)
class GrammarMatcher:
    """One sample's place in its grammar: advanced by each output token the sample takes in."""

    matcher: llguidance.LLMatcher
    words: int
    """Words of its bitmask row (its tokenizer's vocabulary, at least the model's)."""
    error: str | None = None
    """Why the grammar refused a token (a dead end), or None."""

    def accept(self, token: int) -> None:
        """Advance past ``token``; a token the grammar refuses sets ``error`` (the sample cannot go on)."""
        if self.error is None and not self.matcher.consume_token(token):
            self.error = self.matcher.get_error().partition("\n")[0] or f"token {token} is not allowed"
            logger.warning("the grammar refused token %d: %s", token, self.error)

    def num_valid(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar would take from here (its state unchanged): 0 after an error."""
        return 0 if self.error is not None else self.matcher.validate_tokens(list(tokens))

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and allows nothing more but EOS."""
        return self.error is None and self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer and vocabulary; compiled grammars are
    cached by spec (``StructuredOutputsParams.key``). llguidance's view of the tokenizer, slow to build
    for a large vocabulary, is built on the first compile: an engine that never sees a constrained
    request does not pay for it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        """``vocab_size``: the model's (logits width); ``eos_token_ids``: the tokens a complete grammar allows."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self._compiled = functools.lru_cache(GRAMMAR_CACHE_SIZE)(self._compile)

    @functools.cached_property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        backend = self._tokenizer.backend
        if backend is None:
            raise ParamError(
                "structured_outputs",
                "structured outputs need a fast (Rust) tokenizer; this model's tokenizer is a slow one.",
            )
        # At least the model's vocabulary: the mask covers every logit (a token the tokenizer lacks is never allowed).
        return llguidance.LLTokenizer(
            backend.to_str(),
            n_vocab=max(self._vocab_size, self._tokenizer.vocab_size),
            eos_token=self._eos_token_ids or None,
        )

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A matcher at the start of ``params``'s grammar; ``ParamError`` (a ``ValueError``) naming the
        problem if the backend rejects the grammar."""
        return GrammarMatcher(
            self._compiled(params.key).deep_copy(), bitmask_words(self.ll_tokenizer.vocab_size)
        )

    def _compile(self, key: tuple) -> llguidance.LLMatcher:
        kind, text, disable_any_whitespace, whitespace_pattern = key
        try:
            grammar = _grammar(kind, text, disable_any_whitespace, whitespace_pattern)
        except ValueError as e:
            raise ParamError("structured_outputs", f"invalid structured_outputs.{kind}: {e}") from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ParamError(
                "structured_outputs",
                f"invalid structured_outputs.{kind} {excerpt(text)}: {matcher.get_error().strip()}",
            )
        return matcher


def _grammar(kind: str, text: str, disable_any_whitespace: bool, whitespace_pattern: str | None) -> str:
    """llguidance's grammar for one constraint (``StructuredOutputsParams.key``'s fields)."""
    options = {"whitespace_flexible": not disable_any_whitespace}
    if whitespace_pattern is not None:
        options["whitespace_pattern"] = whitespace_pattern

    def schema(s: str | dict) -> str:
        return llguidance.LLMatcher.grammar_from_json_schema(s, defaults=options)

    if kind == "json":
        return schema(text)
    if kind == "json_object":
        return schema('{"type": "object"}')
    if kind == "structural_tag":
        tag = json.loads(text)
        tags = [
            llguidance.StructTag(
                trigger=next(t for t in tag["triggers"] if s["begin"].startswith(t)),
                begin=s["begin"],
                grammar=schema(s["schema"]),
                end=s["end"],
            )
            for s in tag["structures"]
        ]
        return llguidance.StructTag.to_grammar(tags)
    return llguidance.grammar_from(kind, text)  # a choice's text is its JSON list


def fill_bitmask(
    rows: Sequence[tuple[GrammarMatcher, int]],
    num_rows: int,
    vocab_size: int,
    drafted: Sequence[tuple[GrammarMatcher, Sequence[int], Sequence[int]]] = (),
) -> np.ndarray:
    """The packed bitmask ([num_rows, ceil(vocab_size / 32)] int32, the sampler's ``allowed``) of a batch:
    each listed ``(matcher, row)`` gets the tokens its grammar allows next, every other row all tokens.
    ``drafted`` (speculative decoding): ``(matcher, rows, drafts)``, ``rows[j]`` getting what the grammar
    allows after ``drafts[:j]`` (one row more than drafts), the matcher's state unchanged."""
    words = (rows[0] if rows else drafted[0])[0].words
    mask = np.full((num_rows, words), -1, np.int32)
    if rows:
        llguidance.numpy.fill_next_token_bitmask_par(_executor(), [(g.matcher, i) for g, i in rows], mask)
    if drafted:
        # llguidance fills a drafted matcher's rows consecutively: fill a scratch array, then place them.
        scratch = np.full((sum(len(r) for _, r, _ in drafted), words), -1, np.int32)
        starts = np.cumsum([0] + [len(r) for _, r, _ in drafted[:-1]]).tolist()
        entries = [(g.matcher, start, list(d)) for (g, _, d), start in zip(drafted, starts)]
        llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(_executor(), entries, scratch)
        mask[np.concatenate([np.asarray(r, np.int64) for _, r, _ in drafted])] = scratch
    mask = np.ascontiguousarray(mask[:, : bitmask_words(vocab_size)])
    if vocab_size % 32:
        mask[:, -1] &= (1 << vocab_size % 32) - 1  # no bit past the model's vocabulary (the sampler's rule)
    return mask


@functools.cache
def _executor() -> llguidance.LLExecutor:
    """llguidance's thread pool, which fills a batch's rows in parallel (made on first use)."""
    return llguidance.LLExecutor()
