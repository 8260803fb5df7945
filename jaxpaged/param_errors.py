"""Errors of invalid request parameters, in a module that imports nothing of jaxpaged, so that every
module validating a parameter (sampling, structured outputs, the engine, the server) can raise them."""

from __future__ import annotations

MAX_EXCERPT = 100
"""Characters of an invalid value an error message quotes at most."""


class ParamError(ValueError):
    """An invalid parameter; ``param`` names it (the server reports it as the error's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def excerpt(value: object) -> str:
    """``repr(value)``, cut to ``MAX_EXCERPT`` characters: an error message never echoes a whole input."""
    text = repr(value)
    return text if len(text) <= MAX_EXCERPT else f"{text[:MAX_EXCERPT]}... ({len(text)} characters)"
