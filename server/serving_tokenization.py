"""The tokenizer endpoints (``TokenizationServing``): ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxpaged.server.errors import APIError
from jaxpaged.server.request_models import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from jaxpaged.server.response_models import TokenizerInfoResponse
from jaxpaged.server.serving_base import ServingBase, text_size


class TokenizationServing(ServingBase):
    """``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` over the shared serving logic."""

    async def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
        """The token ids of a prompt or a conversation, at most ``max_model_len`` of them (as a
        request's prompt: vLLM has no limit, but a 20 MB call took 33 s and 5.7 GB)."""
        self.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            tokens = await self._off_loop(
                text_size(body.messages),
                self.chat_prompt,
                body.messages,
                body.add_generation_prompt,
                body.chat_template_kwargs,
                body.tools,
            )
        else:
            tokens = await self._off_loop(
                len(body.prompt), self._encode, body.prompt, body.add_special_tokens, "prompt"
            )
        limit = self.engine.max_model_len
        if len(tokens) > limit:
            raise APIError(
                400,
                f"the input has {len(tokens)} tokens, but max_model_len is {limit}; shorten it.",
                param="messages" if isinstance(body, TokenizeChatRequest) else "prompt",
            )
        return tokens

    def tokenizer_info(self) -> TokenizerInfoResponse:
        """vLLM's ``/tokenizer_info``: the tokenizer's class, its settings as loaded (special tokens,
        ``model_max_length``...) and the chat template in use; file paths are left out, as they describe
        the server's disk, not the tokenizer."""
        hf = self.engine.tokenizer.hf
        info = {
            key: _jsonable(value)
            for key, value in hf.init_kwargs.items()
            if not key.endswith("_file") and key != "name_or_path"
        }
        template = self.chat_template or hf.chat_template
        if template:
            info["chat_template"] = template
        return TokenizerInfoResponse(**{**info, "tokenizer_class": type(hf).__name__})

    async def detokenize(self, body: DetokenizeRequest) -> str:
        """The text of at most ``max_model_len`` token ids of the vocabulary."""
        self.check_model(body.model)
        limit, vocab = self.engine.max_model_len, self.engine.tokenizer.vocab_size
        if len(body.tokens) > limit:
            raise APIError(
                400,
                f"tokens holds {len(body.tokens)} ids, but max_model_len is {limit}; send fewer.",
                param="tokens",
            )
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}.", param="tokens")
        return await self._off_loop(len(body.tokens), self.engine.tokenizer.decode, body.tokens)


def _jsonable(value: Any) -> Any:
    """A tokenizer setting as JSON: an ``AddedToken`` as its text (vLLM's rule), containers item by item,
    anything else not JSON as its ``str``."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value.content if hasattr(value, "content") else str(value)
