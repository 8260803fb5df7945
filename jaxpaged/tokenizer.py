"""Tokenizer loading (HF directory or GGUF), chat templates and incremental detokenization."""

from __future__ import annotations

import codecs
import inspect
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import tokenizers
import tokenizers.decoders
import transformers

from jaxpaged.gguf_tokenizer import load_gguf_tokenizer
from jaxpaged.math_utils import cdiv
from jaxpaged.weights.hub import TOKENIZER_FILES, local_or_snapshot
from jaxpaged.weights.resolve import DEFAULT_MODEL_ALIAS, resolve_model_path

# Tokens of context decoded before the first new token (vLLM uses the same number): enough for
# decoders whose output depends on the previous token (sentencepiece's leading "▁").
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"
GIL_HELD_CHARS = 512
"""Texts up to this long are encoded holding the GIL (``Tokenizer.encode``): encoding them takes less than
the switch interval another thread would wait for the GIL anyway."""


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins: the character each byte is spelled with in a token."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    spelled, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelled[chr(b)] = b
        else:
            spelled[chr(256 + extra)] = b
            extra += 1
    return spelled


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
        self.backend: tokenizers.Tokenizer | None = (
            hf.backend_tokenizer if getattr(hf, "is_fast", False) else None
        )
        if self.backend is not None:  # as transformers' ``encode`` sets them before each call
            self.backend.no_truncation()
            self.backend.no_padding()
        self._byte_tables = self._build_byte_tables()
        self._token_bound = self._bounding_token_bytes()

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))``, known without tokenizing: a prompt surely too long is
        refused at once, not after seconds of tokenizing. With a byte-level
        BPE each token stands for at most the longest token's bytes, so tokens >= the
        UTF-8 bytes it keeps / that; for other tokenizers 0 (characters bound nothing there: a normalizer
        may shrink the text, one unknown-character token may stand for a whole run)."""
        if self._token_bound is None:
            return 0
        longest, dropped = self._token_bound
        data = text.encode("utf-8", "surrogatepass")
        return cdiv(len(data.translate(None, dropped) if dropped else data), longest)

    def _bounding_token_bytes(self) -> tuple[int, bytes] | None:
        """(the most input bytes one token stands for, the bytes encoding drops) where they bound the
        token count: a byte-level BPE (each token is the bytes it decodes to, ``byte_table``) with no
        normalizer (which could shrink the text first), no added token that strips the whitespace
        around it, and no unknown token (a byte missing from the vocabulary is dropped). Else None."""
        backend = self.backend
        if (
            self._byte_tables is None
            or backend.normalizer is not None
            or not isinstance(backend.model, tokenizers.models.BPE)
            or any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values())
        ):
            return None
        vocab = backend.get_vocab(with_added_tokens=False)
        dropped = bytes(b for c, b in _byte_level_alphabet().items() if c not in vocab)
        longest = max(map(len, self._byte_tables[False]), default=0)
        if not longest or (dropped and backend.model.unk_token is not None):
            return None
        return longest, dropped

    def byte_table(self, skip_special_tokens: bool) -> list[bytes] | None:
        """Each token id's bytes, such that decoding ids is decoding their bytes' concatenation as
        UTF-8 (invalid sequences as U+FFFD); None unless the tokenizer decodes that way (a fast
        tokenizer with a byte-level decoder). Ids past the table decode to nothing."""
        return None if self._byte_tables is None else self._byte_tables[skip_special_tokens]

    def _build_byte_tables(self) -> dict[bool, list[bytes]] | None:
        """A token whose decode alone is whole characters is their UTF-8; one that decodes to U+FFFD
        (part of a character) is spelled in byte-level BPE's alphabet (a character outside it stands
        for its own UTF-8, as the decoder has it). Up to the largest id, added tokens included. Kept
        only if every token decodes alone as its bytes do, with and without special tokens (~0.1 s
        for 49k tokens)."""
        backend = self.backend
        if backend is None or not isinstance(backend.decoder, tokenizers.decoders.ByteLevel):
            return None
        alphabet = _byte_level_alphabet()

        def spelled(token: str | None) -> bytes:
            if token is None:
                return b""
            return bytes(alphabet[c] for c in token) if alphabet.keys() >= set(token) else token.encode()

        ids = [[i] for i in range(max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1)]
        tables = {}
        for skip in (False, True):
            alone = backend.decode_batch(ids, skip_special_tokens=skip)
            table = [
                text.encode() if _REPLACEMENT not in text else spelled(backend.id_to_token(i))
                for i, text in enumerate(alone)
            ]
            if any(
                table[i].decode("utf-8", "replace") != text
                for i, text in enumerate(alone)
                if _REPLACEMENT in text
            ):
                return None
            tables[skip] = table
        return tables

    @classmethod
    def load(
        cls, path: str | pathlib.Path, revision: str | None = None, download_dir: str | None = None
    ) -> Tokenizer:
        """From an HF tokenizer directory, a .gguf file (its embedded tokenizer, built from the file's
        metadata), the model alias or a Hugging Face Hub repo id (its
        tokenizer files at ``revision``, downloaded under ``download_dir``)."""
        path = (
            resolve_model_path(DEFAULT_MODEL_ALIAS)
            if str(path) == DEFAULT_MODEL_ALIAS
            else local_or_snapshot(path, revision, download_dir, TOKENIZER_FILES, kind="tokenizer")
        )
        if path.is_file() and path.suffix == ".gguf":
            return cls(load_gguf_tokenizer(path))
        if path.is_dir():
            return cls(transformers.AutoTokenizer.from_pretrained(path))
        raise FileNotFoundError(
            f"tokenizer {str(path)!r} is neither a tokenizer directory, a .gguf file, a Hugging Face Hub repo id "
            f"(org/name) nor {DEFAULT_MODEL_ALIAS!r}."
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The same ids as transformers' ``encode``. A short text is encoded by the Rust tokenizer
        holding the GIL: transformers' call releases it, and taking it back from a busy engine thread
        costs the event loop far more than the encoding. A long one releases it, so that other threads
        run meanwhile."""
        if self.backend is not None and len(text) <= GIL_HELD_CHARS:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decode without "clean up tokenization spaces", which rewrites text across token
        boundaries and so could not be matched by incremental detokenization."""
        if self.backend is not None:
            return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(
            list(token_ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def decode_stream(
        self, context: list[int], skip_special_tokens: bool
    ) -> tokenizers.decoders.DecodeStream | None:
        """A Rust incremental decoder starting after ``context`` (fast tokenizers), else None."""
        if self.backend is None:
            return None
        try:
            return tokenizers.decoders.DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        except TypeError:  # a tokenizers release whose DecodeStream takes no context
            return None

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The token ids of ``messages`` rendered by ``chat_template`` (Jinja text, as vLLM's
        ``--chat-template`` gives it) or, without one, by the tokenizer's own template;
        ``chat_template_kwargs``: extra template variables (``enable_thinking``...), as vLLM's."""
        text = self.render_chat(messages, add_generation_prompt, chat_template, chat_template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """``messages`` rendered as text (``apply_chat_template`` before tokenizing: the template writes
        the special tokens, so the text is encoded without adding any), with ``tools`` (OpenAI's tool
        definitions) for templates that declare them. ``chat_template_kwargs`` may not name
        ``apply_chat_template``'s own parameters: they are template variables only. ``ValueError`` for
        those, and for a template that fails on these messages (it raised, or met a value it cannot use)."""
        if not (chat_template or self.hf.chat_template):
            raise ValueError(
                f"tokenizer {self.hf.name_or_path!r} has no chat template; send a plain prompt instead, "
                "or give one (chat_template, --chat-template)."
            )
        variables = dict(chat_template_kwargs or {})
        reserved = sorted(variables.keys() & inspect.signature(self.hf.apply_chat_template).parameters.keys())
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved}: they are not template variables.")
        try:
            return self.hf.apply_chat_template(
                messages,
                chat_template=chat_template,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **variables,
            )
        except (jinja2.TemplateError, TypeError) as e:
            raise ValueError(f"the chat template cannot render these messages: {e}") from None


class IncrementalDetokenizer:
    """Text deltas for a growing output, decoding only a short window of tokens each step.

    vLLM's rule: the window is the last emitted chunk's tokens (at first the prompt's last tokens)
    followed by the tokens since; a step decodes it and emits what lies beyond the window's own
    decode, unless that ends in U+FFFD (a multi-byte character still incomplete). After emitting,
    the new tokens become the window, so the work per step does not grow with the output. With a
    byte-level tokenizer (``Tokenizer.byte_table``) the rule needs no decoder call: the window's
    text ends with a whole character, so the new text is the new tokens' bytes decoded on their own,
    as they come, an unfinished character's bytes kept for the next step (cheaper than DecodeStream).
    Otherwise, with a fast tokenizer, the rule runs in Rust (``tokenizers``' DecodeStream, the same
    algorithm, several times faster than Python); otherwise, or if the stream rejects a step,
    in Python.

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
        self.text = ""
        # A subclass that decodes its own way keeps to the Python path.
        own_decode = type(self)._decode is IncrementalDetokenizer._decode
        self._bytes = tokenizer.byte_table(skip_special_tokens) if own_decode else None
        if self._bytes is not None:
            self._partial = b""
            """An unfinished character's bytes, not decoded yet."""
            self._held = ""
            """Text of the tokens since the last emitted chunk, held back while it is empty, ends in
            U+FFFD or a character is unfinished."""
            return
        self._window = self._context(list(prompt_token_ids))
        """The last emitted chunk's tokens (at first the prompt's context)."""
        self._pending: list[int] = []
        """Tokens since, whose text is held back."""
        self._stream = tokenizer.decode_stream(self._window, skip_special_tokens) if own_decode else None
        self._window_text = None if self._stream is not None else self._decode(self._window)
        """The window's decode (Python path only: the stream keeps its own)."""

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
        if self._bytes is not None:
            return self._bytes_step(new_token_ids)
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

    def _bytes_step(self, new_token_ids: Sequence[int]) -> str:
        """The rule on the byte-level path: the held text grows by the new tokens' bytes, and is
        emitted unless it ends in U+FFFD, as decoded or for an unfinished character's bytes."""
        table, data = self._bytes, self._partial
        for t in new_token_ids:
            data += table[t] if t < len(table) else b""
        text, used = codecs.utf_8_decode(data, "replace", False)
        held, self._partial = self._held + text, data[used:]
        if not held or held[-1] == _REPLACEMENT or self._partial:
            self._held = held
            return ""
        self._held = ""
        self.text += held
        return held

    def _python_step(self) -> str | None:
        """The rule in Python: the new chunk, or None while the text is held back."""
        text = self._decode(self._window + self._pending)
        if len(text) <= len(self._window_text) or text.endswith(_REPLACEMENT):
            return None
        delta = text[len(self._window_text) :]
        self._window_text = self._decode(self._pending)
        return delta

    def flush(self) -> str:
        """Call once, when the output is finished: emit what is held back, even an incomplete
        character (as U+FFFD, like a full decode), so the final text equals the full decode."""
        if self._bytes is not None:
            delta = self._held + codecs.utf_8_decode(self._partial, "replace", True)[0]
            self._held, self._partial = "", b""
            self.text += delta
            return delta
        delta = (
            self._decode(self._window + self._pending)[len(self._decode(self._window)) :]
            if self._pending
            else ""
        )
        self.text += delta
        return delta
