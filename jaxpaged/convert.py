"""``jaxpaged convert``: any model argument -> jaxpaged's own orbax checkpoint (params, model card,
tokenizer). It sits above both the weights package and the tokenizer, which the weights package does not import."""

from __future__ import annotations

import pathlib
import shutil

import jax.numpy as jnp

from jaxpaged.models.registry import build_model
from jaxpaged.tokenizer import Tokenizer
from jaxpaged.weights import load_checkpoint
from jaxpaged.weights.orbax_checkpoint import save_orbax

# Files of an HF tokenizer directory (the weights and config.json are not copied).
_TOKENIZER_GLOBS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "chat_template.*",
    "generation_config.json",
)


def save_tokenizer(source: pathlib.Path, output: pathlib.Path) -> list[str]:
    """Put the source's tokenizer into ``output`` as HF tokenizer files; returns the file names."""
    if source.is_dir():
        files = sorted({f for pattern in _TOKENIZER_GLOBS for f in source.glob(pattern) if f.is_file()})
        for f in files:
            shutil.copy2(f, output / f.name)
        return [f.name for f in files]
    # A GGUF's embedded tokenizer, built from its metadata.
    return [pathlib.Path(f).name for f in Tokenizer.load(source).hf.save_pretrained(output)]


def convert_checkpoint(model: str, output: str | pathlib.Path, dtype: str = "float32") -> pathlib.Path:
    """``jaxpaged convert``: any model argument (alias, HF dir, GGUF, orbax dir) -> an orbax checkpoint.

    Loads through the format's loader, maps to our param tree with ``build_model`` (cast to
    ``dtype``), and writes params, model card and tokenizer. Removes ``output`` again on failure.
    """
    output = pathlib.Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ValueError(f"output {output} already exists and is not an empty directory; choose a new one.")
    target = jnp.dtype(dtype)
    ckpt = load_checkpoint(model, dtype=target)
    params = ckpt.params
    if params is None:
        params = build_model(ckpt.config, ckpt.tensors, target, "xla").params
        ckpt.tensors.clear()
    try:
        output.mkdir(parents=True, exist_ok=True)
        if not save_tokenizer(ckpt.path, output):
            raise ValueError(
                f"{ckpt.path} has no tokenizer files; jaxpaged checkpoints carry their tokenizer."
            )
        save_orbax(output, params, ckpt.config, source=str(ckpt.path))
    except BaseException:
        shutil.rmtree(output, ignore_errors=True)
        raise
    return output
