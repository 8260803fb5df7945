"""Checkpoint loading: HF safetensors directories and GGUF files (both to HF names as float32), and
jaxpaged's own orbax checkpoints (already our param tree)."""

from __future__ import annotations

from typing import Any

from jaxpaged.weights.gguf_loader import load_gguf
from jaxpaged.weights.hf import load_hf
from jaxpaged.weights.orbax_checkpoint import abstract_params, load_orbax, save_orbax
from jaxpaged.weights.resolve import (
    DEFAULT_MODEL_ALIAS,
    MODEL_CARD,
    AffineBlocks,
    Checkpoint,
    is_orbax_checkpoint,
    resolve_model_path,
)

__all__ = [
    "DEFAULT_MODEL_ALIAS",
    "MODEL_CARD",
    "AffineBlocks",
    "Checkpoint",
    "abstract_params",
    "is_orbax_checkpoint",
    "load_checkpoint",
    "load_orbax",
    "resolve_model_path",
    "save_orbax",
]


def load_checkpoint(
    model: str, dtype: Any = None, revision: str | None = None, download_dir: str | None = None
) -> Checkpoint:
    """Resolve `model` (alias, HF directory, orbax checkpoint directory, .gguf file or Hub repo id, at
    ``revision``, downloaded under ``download_dir``: see ``resolve_model_path``) and load it.

    An orbax checkpoint comes back as ready ``params`` on one device, cast to ``dtype`` if given
    (for other shardings call ``load_orbax``); the other formats as HF-named float32 ``tensors``
    (``dtype`` is applied later, by ``build_model``).
    """
    path = resolve_model_path(model, revision, download_dir)
    if is_orbax_checkpoint(path):
        return load_orbax(path, dtype=dtype)
    return load_hf(path) if path.is_dir() else load_gguf(path)
