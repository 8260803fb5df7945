"""Checkpoint loading: HF safetensors directories and GGUF files, both to HF names as float32."""

from __future__ import annotations

from jaxpaged.weights.gguf_loader import load_gguf
from jaxpaged.weights.hf import load_hf
from jaxpaged.weights.resolve import DEFAULT_MODEL_ALIAS, Checkpoint, resolve_model_path

__all__ = ["DEFAULT_MODEL_ALIAS", "Checkpoint", "load_checkpoint", "resolve_model_path"]


def load_checkpoint(model: str) -> Checkpoint:
    """Resolve `model` (alias, HF directory or .gguf file) and load it."""
    path = resolve_model_path(model)
    return load_hf(path) if path.is_dir() else load_gguf(path)
