"""``StructuredOutputsParams``: which grammar a request's output must follow (vLLM's names).

Validated once, when made: exactly one kind of constraint, each of the right type. Nothing here
compiles a grammar (``jaxpaged.structured_outputs`` does, in ``LLMEngine.make_request``, which
raises ``ValueError`` for a grammar the backend rejects), so this module needs no backend.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jaxpaged.param_errors import ParamError, excerpt

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""The kinds of constraint, in the order ``StructuredOutputsParams`` lists them."""


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's ``StructuredOutputsParams``).

    ``json``: a JSON schema, as a dict or a JSON string. ``regex``: a regular expression (Rust
    ``regex`` syntax) the whole output matches. ``choice``: the output is one of these strings.
    ``grammar``: a Lark or GBNF (llama.cpp) grammar. ``json_object``: any JSON object.
    ``structural_tag``: a JSON string ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``:
    free text in which each ``begin`` (starting with one of the triggers) is followed by JSON of its
    schema and ``end``. ``disable_any_whitespace`` and ``whitespace_pattern`` shape the whitespace JSON
    may hold between its tokens (default: any).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ParamError(
                "structured_outputs",
                f"structured_outputs must give exactly one of {', '.join(KINDS)}; "
                f"got {', '.join(given) if given else 'none'}.",
            )
        if isinstance(self.json, str):
            self.json = _parsed("json", self.json)
        if self.json is not None and not isinstance(self.json, dict):
            raise ParamError(
                "structured_outputs",
                f"structured_outputs.json must be a JSON schema (a dict or a JSON "
                f"object as a string), got {excerpt(self.json)}.",
            )
        for name in ("regex", "grammar", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, str) and v):
                raise ParamError(
                    "structured_outputs",
                    f"structured_outputs.{name} must be a non-empty string, got {excerpt(v)}.",
                )
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not all(isinstance(c, str) for c in self.choice):
                raise ParamError(
                    "structured_outputs",
                    f"structured_outputs.choice must be a list of strings, got {excerpt(self.choice)}.",
                )
            self.choice = list(self.choice)
            if not self.choice:
                raise ParamError(
                    "structured_outputs", "structured_outputs.choice must hold at least one string."
                )
        if self.json_object is not None and self.json_object is not True:
            raise ParamError(
                "structured_outputs",
                f"structured_outputs.json_object must be True when given, got {excerpt(self.json_object)}.",
            )
        if self.structural_tag is not None:
            self._check_structural_tag(_parsed("structural_tag", self.structural_tag))
        if not isinstance(self.disable_any_whitespace, bool):
            raise ParamError(
                "structured_outputs",
                f"structured_outputs.disable_any_whitespace must be a bool, "
                f"got {excerpt(self.disable_any_whitespace)}.",
            )

    @staticmethod
    def _check_structural_tag(tag: object) -> None:
        ok = (
            isinstance(tag, dict)
            and isinstance(tag.get("triggers"), list)
            and tag["triggers"]
            and all(isinstance(t, str) and t for t in tag["triggers"])
            and isinstance(tag.get("structures"), list)
            and tag["structures"]
            and all(
                isinstance(s, dict)
                and isinstance(s.get("begin"), str)
                and isinstance(s.get("end"), str)
                and isinstance(s.get("schema"), dict)
                and any(s["begin"].startswith(t) for t in tag["triggers"])
                for s in tag["structures"]
            )
        )
        if not ok:
            raise ParamError(
                "structured_outputs",
                "structured_outputs.structural_tag must be a JSON object "
                '{"structures": [{"begin": str, "schema": {...}, "end": str}, ...], '
                '"triggers": [str, ...]} in which every begin starts with a '
                f"trigger, got {excerpt(tag)}.",
            )

    @property
    def kind(self) -> str:
        """Which of ``KINDS`` this constraint is."""
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar: equal keys compile to the same grammar. (A schema's keys
        keep their order: the output's properties follow it.)"""
        spec = getattr(self, self.kind)
        text = spec if isinstance(spec, str) else json.dumps(spec)
        return self.kind, text, self.disable_any_whitespace, self.whitespace_pattern


def _parsed(name: str, text: str) -> object:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ParamError(
            "structured_outputs", f"structured_outputs.{name} is not valid JSON ({e}): {excerpt(text)}."
        ) from None
