"""Prompt inputs as vLLM's APIs take them: text, token ids, or a prompt dict."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PromptInput = str | Sequence[int] | dict
"""A prompt: text, token ids, or vLLM's prompt dict: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``, with an
optional ``"cache_salt"`` (only requests with the same salt share prefix-cache blocks)."""
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


@dataclass(frozen=True)
class ParsedPrompt:
    """One prompt's text or token ids, and its prefix-cache salt (checked by ``LLMEngine.make_request``)."""

    prompt: str | Sequence[int]
    cache_salt: str | None = None


def parse_prompt(prompt: PromptInput, where: str = "prompt") -> ParsedPrompt:
    """``ValueError`` (naming ``where``) for a prompt dict with a key it does not know, or with both or
    neither of text and token ids; other values are checked by ``LLMEngine.make_request``."""
    if not isinstance(prompt, dict):
        return ParsedPrompt(prompt)
    unknown = sorted(set(prompt) - PROMPT_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; a prompt dict takes {sorted(PROMPT_KEYS)}.")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError(f"{where}: give exactly one of 'prompt' (text) and 'prompt_token_ids'.")
    text_or_ids = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
    return ParsedPrompt(text_or_ids, prompt.get("cache_salt"))


def parse_prompts(prompts: PromptInput | Sequence[PromptInput]) -> list[ParsedPrompt]:
    """One prompt or a list of them (a list of ints is one prompt of token ids), parsed in order."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        prompts = [prompts]
    return [parse_prompt(p, f"prompt {i}") for i, p in enumerate(prompts)]
