"""Tensor-parallel rules of the decoder's param tree (rules only): how each module splits across
devices; ``jaxpaged.parallel`` applies them."""

from __future__ import annotations

from jaxpaged.models.decoder import DecoderConfig

PARALLEL_STYLE = {
    "embed_tokens": "vocab",  # split the vocabulary rows
    "lm_head": "column",  # split the vocabulary (output) columns
    "qkv_proj": "column",  # fused: split each of the q, k, v sections by heads (column_sections)
    "gate_up_proj": "column",  # fused: split each of the gate, up sections (column_sections)
    "up_proj": "column",
    "o_proj": "row",  # split the input rows; its bias is added once, after the all-reduce
    "down_proj": "row",
}
"""Tensor-parallel style of each module by name; any other module (norms, ``embed_positions``,
``project_in``/``project_out``) is replicated. A column module's bias splits like its output."""


def parallel_style(path: tuple[str, ...]) -> str:
    """``"column"``, ``"row"``, ``"vocab"`` or ``"replicated"`` for a param path such as
    ``("layers_0", "qkv_proj", "kernel")``."""
    return next((PARALLEL_STYLE[p] for p in path if p in PARALLEL_STYLE), "replicated")


def column_sections(cfg: DecoderConfig, module: str) -> tuple[int, ...]:
    """Widths of the fused sections of a column-parallel module's output axis, each to be split
    evenly across devices (``(q, k, v)`` for ``qkv_proj``, ``(gate, up)`` for ``gate_up_proj``)."""
    if module == "qkv_proj":
        return (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        )
    if module == "gate_up_proj":
        return (cfg.intermediate_size, cfg.intermediate_size)
    if module == "up_proj":
        return (cfg.intermediate_size,)
    if module == "lm_head":
        return (cfg.vocab_size,)
    raise ValueError(
        f"{module!r} is not a column-parallel module; those are "
        f"{[m for m, s in PARALLEL_STYLE.items() if s == 'column']}"
    )
