"""Hugging Face Hub repo ids -> snapshot folders, as vLLM resolves a model that is not a local path.

``huggingface_hub.snapshot_download`` does the work, reading its own environment (``HF_HOME``,
``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``): nothing here overrides it.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import huggingface_hub
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
)
"""What a tokenizer loads (config.json names the tokenizer class when tokenizer_config.json does not)."""
MODEL_FILES = (
    "model*.safetensors",
    "model.safetensors.index.json",
    "generation_config.json",
    *TOKENIZER_FILES,
)
"""What the engine loads: ``model.safetensors`` or the shards of its index (not a repo's other copies of the
weights, such as ``consolidated.safetensors`` or ``original/``), the configs and the tokenizer."""


def is_repo_id(name: str) -> bool:
    """Whether ``name`` is a valid Hub repo id (``org/name`` or ``name``), not a path-like string."""
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def local_or_snapshot(
    name: str | pathlib.Path,
    revision: str | None,
    download_dir: str | None,
    files: Sequence[str],
    kind: str = "model",
) -> pathlib.Path:
    """``name`` as a local path if it exists or cannot be a repo id (the caller reports what is missing), else
    the snapshot of that Hub repo at ``revision`` holding ``files`` (patterns), cached under ``download_dir``
    (default: huggingface_hub's cache); ``FileNotFoundError`` naming what was tried if the Hub has none."""
    path = pathlib.Path(name).expanduser()
    if path.exists() or not is_repo_id(str(name)):
        return path
    try:
        folder = huggingface_hub.snapshot_download(
            str(name), revision=revision, cache_dir=download_dir, allow_patterns=list(files)
        )
    except (LocalEntryNotFoundError, HfHubHTTPError) as e:
        raise _not_found(kind, str(name), revision, download_dir, e) from None
    return pathlib.Path(folder)


def _not_found(
    kind: str, repo_id: str, revision: str | None, download_dir: str | None, error: Exception
) -> FileNotFoundError:
    """Names the id, the revision, the local path and the Hub cache tried, whether downloads were off,
    and huggingface_hub's own reason (its first line)."""
    cache = download_dir or constants.HF_HUB_CACHE
    mode = (
        "HF_HUB_OFFLINE=1: only the cache was searched"
        if constants.is_offline_mode()
        else "online: the Hub was asked, then the cache"
    )
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0].rstrip('.')}" if lines else type(error).__name__
    access = (
        " The repo is gated or private: accept its terms on the Hub and set HF_TOKEN."
        if isinstance(error, GatedRepoError)
        else ""
    )
    return FileNotFoundError(
        f"{kind} {repo_id!r} (revision {revision or constants.DEFAULT_REVISION!r}) was not found: no local path "
        f"{pathlib.Path(repo_id).absolute()} exists, and as a Hugging Face Hub repo id it failed with {reason} "
        f"(Hub cache {cache}; {mode}).{access} Give an existing local path, or a Hub repo id and revision that "
        "exist (private repos need HF_TOKEN; offline, download the repo into the cache first, or point "
        "HF_HUB_CACHE / download_dir at the cache that holds it)."
    )
