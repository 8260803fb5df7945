"""Tokenizer loading (HF directory or GGUF), chat templates and incremental detokenization."""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import shutil
from collections.abc import Sequence

import tokenizers
import tokenizers.decoders
import transformers

from jaxpaged.weights.resolve import DEFAULT_MODEL_ALIAS, resolve_model_path

# Tokens of context decoded before the first new token (vLLM uses the same number): enough for
# decoders whose output depends on the previous token (sentencepiece's leading "▁").
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"

logger = logging.getLogger(__name__)


def _gguf_tokenizer(path: pathlib.Path, cache_dir: str | None) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer embedded in a GGUF. transformers builds it from the file's vocabulary in
    seconds; with ``cache_dir`` a copy saved there (keyed by the file's path, size and modification
    time) loads in a fraction of that on later starts."""
    def build() -> transformers.PreTrainedTokenizerBase:
        return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)

    if not cache_dir:
        return build()
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = pathlib.Path(cache_dir) / f"{path.stem}-{key}"
    if cached.is_dir():
        try:
            return transformers.AutoTokenizer.from_pretrained(cached)
        except Exception as e:  # noqa: BLE001 -- whatever is wrong with a cached copy, it is rebuilt below
            logger.warning("ignoring the cached tokenizer %s (%s); rebuilding it from %s", cached, e, path)
            shutil.rmtree(cached, ignore_errors=True)
    tokenizer = build()
    partial = cached.with_name(f"{cached.name}.partial-{os.getpid()}")
    try:
        tokenizer.save_pretrained(partial)
        partial.rename(cached)                      # complete or absent: never half written
    except OSError as e:                            # read-only cache, or another process won the race
        logger.debug("tokenizer not cached at %s: %s", cached, e)
        shutil.rmtree(partial, ignore_errors=True)
    return tokenizer


class Tokenizer:
    """A transformers tokenizer with the few operations the engine needs."""

    def __init__(self, hf: transformers.PreTrainedTokenizerBase) -> None:
        self.hf = hf
        self.eos_token_id: int | None = hf.eos_token_id
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size: int = len(hf)
        self.all_special_ids: set[int] = set(hf.all_special_ids)
        # The Rust tokenizer of a fast tokenizer, called directly: half the cost of ``hf.decode``
        # (whose Python wrapper dominates a short window's decode), and the same text.
        self.backend: tokenizers.Tokenizer | None = hf.backend_tokenizer if getattr(hf, "is_fast", False) else None

    @classmethod
    def load(cls, path: str | pathlib.Path, cache_dir: str | None = None) -> Tokenizer:
        """From an HF tokenizer directory, a .gguf file (its embedded tokenizer, cached as an HF
        tokenizer under ``cache_dir`` if given) or the model alias."""
        path = resolve_model_path(DEFAULT_MODEL_ALIAS) if str(path) == DEFAULT_MODEL_ALIAS else pathlib.Path(path)
        if path.is_file() and path.suffix == ".gguf":
            return cls(_gguf_tokenizer(path, cache_dir))
        if path.is_dir():
            return cls(transformers.AutoTokenizer.from_pretrained(path))
        raise FileNotFoundError(
            f"tokenizer {str(path)!r} is neither a tokenizer directory, a .gguf file nor {DEFAULT_MODEL_ALIAS!r}."
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decode without "clean up tokenization spaces", which rewrites text across token
        boundaries and so could not be matched by incremental detokenization."""
        if self.backend is not None:
            return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(
            list(token_ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def decode_stream(self, context: list[int], skip_special_tokens: bool) -> tokenizers.decoders.DecodeStream | None:
        """A Rust incremental decoder starting after ``context`` (fast tokenizers), else None."""
        if self.backend is None:
            return None
        try:
            return tokenizers.decoders.DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        except TypeError:           # a tokenizers release whose DecodeStream takes no context
            return None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not self.hf.chat_template:
            raise ValueError(
                f"tokenizer {self.hf.name_or_path!r} has no chat template; send a plain prompt instead."
            )
        return list(
            self.hf.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
            )
        )


class IncrementalDetokenizer:
    """Text deltas for a growing output, decoding only a short window of tokens each step.

    vLLM's rule: the window is the last emitted chunk's tokens (at first the prompt's last tokens)
    followed by the tokens since; a step decodes it and emits what lies beyond the window's own
    decode, unless that ends in U+FFFD (a multi-byte character still incomplete). After emitting,
    the new tokens become the window, so the work per step does not grow with the output. With a
    fast tokenizer the rule runs in Rust (``tokenizers``' DecodeStream, the same algorithm, ~6x
    less time per token); otherwise, or if the stream rejects a step, in Python.

    Starting from the prompt's last tokens makes the first output token decode as it does in
    context: with byte-level BPE `text` is `decode(output_ids)`; with sentencepiece (whose decode
    drops the leading space of the first token) it is the continuation,
    `decode(prompt + output)[len(decode(prompt)):]`, as in vLLM.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window = self._context(list(prompt_token_ids))
        """The last emitted chunk's tokens (at first the prompt's context)."""
        self._pending: list[int] = []
        """Tokens since, whose text is held back."""
        # A subclass that decodes its own way keeps to the Python path.
        own_decode = type(self)._decode is IncrementalDetokenizer._decode
        self._stream = tokenizer.decode_stream(self._window, skip_special_tokens) if own_decode else None
        self._window_text = None if self._stream is not None else self._decode(self._window)
        """The window's decode (Python path only: the stream keeps its own)."""
        self.text = ""

    def _context(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt's last tokens, from a start whose decoding does not end in a broken
        character. Stepping back up to 3 more tokens gets past a character split over byte
        tokens (a byte-fallback decoder turns a whole run with a stray byte into U+FFFD); a
        prompt that itself ends mid-character gives no context."""
        first = max(len(prompt_token_ids) - _CONTEXT_TOKENS, 0)
        for start in range(first, max(first - 4, -1), -1):
            context = prompt_token_ids[start:]
            if not self._decode(context).endswith(_REPLACEMENT):
                return context
        return []

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly completed text ("" while a character is incomplete)."""
        new = list(new_token_ids)
        self._pending += new
        delta = None
        if self._stream is not None:
            try:
                delta = self._stream.step(self._tokenizer.backend, new)
            except Exception:  # noqa: BLE001 -- e.g. a decode that rewrote the window's text: go on in Python
                self._stream, self._window_text = None, self._decode(self._window)
        if self._stream is None:
            delta = self._python_step()
        if delta is None:
            return ""
        self._window, self._pending = self._pending, []
        self.text += delta
        return delta

    def _python_step(self) -> str | None:
        """The rule in Python: the new chunk, or None while the text is held back."""
        text = self._decode(self._window + self._pending)
        if len(text) <= len(self._window_text) or text.endswith(_REPLACEMENT):
            return None
        delta = text[len(self._window_text):]
        self._window_text = self._decode(self._pending)
        return delta

    def flush(self) -> str:
        """Call once, when the output is finished: emit what is held back, even an incomplete
        character (as U+FFFD, like a full decode), so the final text equals the full decode."""
        delta = self._decode(self._window + self._pending)[len(self._decode(self._window)):] if self._pending else ""
        self.text += delta
        return delta
