"""``OpenAIServing``, which the app routes to: the completion, chat and tokenizer endpoints
(``serving_completion``, ``serving_chat``, ``serving_tokenization``) over one engine (``serving_base``)."""

from __future__ import annotations

from jaxpaged.server.serving_chat import ChatServing
from jaxpaged.server.serving_completion import CompletionServing
from jaxpaged.server.serving_tokenization import TokenizationServing


class OpenAIServing(CompletionServing, ChatServing, TokenizationServing):
    """Completion and chat logic over one ``AsyncLLMEngine``; the app routes to it. Its constructor and
    what it takes are ``ServingBase``'s."""
