"""Maps Hugging Face ``architectures`` names to our Flax model classes and builds them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import flax.linen as nn
import numpy as np

from models import llama


@dataclass(frozen=True)
class ModelShape:
    """What the runner needs to know about a model to size its KV cache and inputs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int


@dataclass
class BuiltModel:
    module: nn.Module
    params: Any
    shape: ModelShape


_ARCHITECTURES = {
    "LlamaForCausalLM": (llama.LlamaArchConfig, llama.LlamaForCausalLM, llama.params_from_hf),
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def build_model(hf_config: Any, tensors: Mapping[str, np.ndarray], dtype: Any,
                attention_backend: str) -> BuiltModel:
    archs = list(getattr(hf_config, "architectures", None) or [])
    found = [a for a in archs if a in _ARCHITECTURES]
    if not found:
        raise ValueError(f"unsupported model architecture {archs or '(none given)'}; "
                         f"supported: {supported_architectures()}")
    config_cls, module_cls, convert = _ARCHITECTURES[found[0]]
    cfg = config_cls.from_hf(hf_config)
    params = convert(cfg, tensors, dtype)
    shape = ModelShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size,
                       cfg.max_position_embeddings)
    return BuiltModel(module_cls(cfg, dtype, attention_backend), params, shape)
