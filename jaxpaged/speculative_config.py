"""Speculative decoding's configuration: vLLM's ``speculative_config`` dict (or its JSON on the CLI),
validated once into a ``SpeculativeConfig``."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
"""Drafts per step at most: each one is a query token of the verifying step."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine proposes the tokens each verifying step checks.

    ``ngram`` (prompt lookup): the longest suffix of a request's tokens, ``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens long, found earlier in its prompt or output proposes the tokens that
    followed it there. ``draft_model``: ``model`` (the same tokenizer as the target) proposes them
    greedily, on a KV pool of its own indexed by the target's block tables.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    model: str | None = None
    """The draft model (``draft_model``): a path, a .gguf or a Hub repo id, as ``EngineArgs.model``."""
    disable_by_batch_size: int | None = None
    """No proposals while this many requests or more run (vLLM's name): a large batch keeps the device
    busy, and verifying drafts then costs more than it saves."""
    min_acceptance_rate: float = 0.1
    """A request whose drafts were accepted less often than this, over its last ``ACCEPTANCE_WINDOW``
    proposed tokens, proposes again only after as many steps without proposals (its text is not
    predictable this way; each verified draft costs a query token and the step its overlap with the host)."""

    @classmethod
    def parse(cls, value: dict[str, Any] | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """``value`` as given to ``LLM(speculative_config=...)`` (a dict) or ``--speculative-config`` (its
        JSON), checked; None for None or an empty dict."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object, got {value!r} ({e}).") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (a JSON object), got {value!r}.")
        if not value:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known keys: {sorted(known)}.")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config needs {key!r} (method: one of {SPECULATIVE_METHODS}).")
        config = cls(**value)
        config._check()
        return config

    def _check(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method must be one of {SPECULATIVE_METHODS}, got {self.method!r}."
            )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min, 64)
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1, 2**31 - 1)
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ValueError(f"speculative_config min_acceptance_rate must be in [0, 1], got {rate!r}.")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(
                    "speculative_config method 'draft_model' needs 'model' (the draft's path or id)."
                )
        elif self.model is not None:
            raise ValueError(f"speculative_config 'model' is for method 'draft_model', not {self.method!r}.")


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative_config {name} must be an integer from {low} to {high}, got {value!r}.")
