"""A model's ``generation_config.json`` applied as vLLM applies it: the sampling defaults its creator
recommends, and the extra token ids that end generation.

``generation_config`` (an engine argument, vLLM's ``--generation-config``) picks the file: ``auto`` = the
model's own, ``vllm`` = none for sampling (vLLM's defaults; the model's ``eos_token_id`` still applies,
as in vLLM), or a folder holding one. A GGUF file or the alias has no such file: nothing changes.
"""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_CONFIG_MODES = ("auto", "vllm")
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""The generation config's keys vLLM takes as sampling defaults -> the ``SamplingParams`` field each sets."""


@dataclass(frozen=True)
class GenerationDefaults:
    """What the model's generation config sets for requests.

    ``sampling`` (``SamplingParams`` field -> value) holds the defaults of parameters a request leaves
    unset (vLLM's ``get_diff_sampling_param``); ``eos_token_ids`` end generation beside the tokenizer's EOS
    (vLLM's ``update_from_generation_config``)."""

    sampling: Mapping[str, float | int] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()

    def sampling_params(self) -> SamplingParams:
        """vLLM's ``LLM.get_default_sampling_params()``: ``SamplingParams`` with the model's defaults."""
        return SamplingParams(**self.sampling)


def load_generation_defaults(model_path: pathlib.Path, generation_config: str) -> GenerationDefaults:
    """The defaults for the model at ``model_path`` under ``generation_config`` (see the module doc);
    none if the chosen folder has no generation_config.json (a GGUF file, an orbax checkpoint)."""
    folder = model_path if generation_config in GENERATION_CONFIG_MODES else pathlib.Path(generation_config)
    file = folder / GENERATION_CONFIG_FILE
    if not file.is_file():
        return GenerationDefaults()
    raw = json.loads(file.read_text())
    eos = _eos_token_ids(raw.get("eos_token_id"), file)
    if generation_config == "vllm":
        return GenerationDefaults(eos_token_ids=eos)
    sampling = {name: raw[key] for key, name in _SAMPLING_KEYS.items() if raw.get(key) is not None}
    if sampling.get("top_k") == 0:  # transformers' "no top-k"
        sampling["top_k"] = -1
    try:
        SamplingParams(**sampling)
    except ValueError as e:
        raise ValueError(
            f"{file}: {e} Fix the file, or pass generation_config='vllm' to ignore its sampling defaults."
        ) from None
    if sampling:
        logger.info(
            "default sampling parameters from %s: %s (requests that set them override them; "
            "generation_config='vllm' ignores them)",
            file,
            sampling,
        )
    return GenerationDefaults(sampling, eos)


def _eos_token_ids(value: object, file: pathlib.Path) -> tuple[int, ...]:
    """``eos_token_id``: absent, one token id or a list of them."""
    ids = [] if value is None else [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
    ):
        raise ValueError(
            f"{file}: eos_token_id must be a token id or a list of them, got {value!r}. Fix the file."
        )
    return tuple(ids)
