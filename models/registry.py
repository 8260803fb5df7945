"""Maps Hugging Face ``architectures`` names to our Flax models and builds them.

Every family runs on the one generic decoder (``models.decoder``); a family contributes an HF
config reader and an HF weight mapper."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple

import flax.linen as nn
import numpy as np

from jaxpaged.models import gpt2, llama, opt
from jaxpaged.models.decoder import DecoderConfig, DecoderForCausalLM
from jaxpaged.models.params import pack_for_matmul_backend, runs_quantized
from jaxpaged.models.partitioning import PARALLEL_STYLE, column_sections, parallel_style

__all__ = [
    "PARALLEL_STYLE",
    "BuiltModel",
    "Family",
    "ModelShape",
    "build_model",
    "column_sections",
    "parallel_style",
    "supported_architectures",
]


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


class Family(NamedTuple):
    config_from_hf: Callable[[Any], DecoderConfig]
    params_from_hf: Callable[..., dict]
    """``(cfg, tensors, dtype, quantized=None) -> params`` (``models.hf_conversion.convert_hf``)."""


_ARCHITECTURES = {
    "LlamaForCausalLM": Family(llama.config_from_hf, llama.params_from_hf),
    "MistralForCausalLM": Family(llama.mistral_config_from_hf, llama.params_from_hf),
    "Qwen2ForCausalLM": Family(llama.qwen2_config_from_hf, llama.params_from_hf),
    "OPTForCausalLM": Family(opt.config_from_hf, opt.params_from_hf),
    "GPT2LMHeadModel": Family(gpt2.config_from_hf, gpt2.params_from_hf),
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def config_from_hf(hf_config: Any) -> tuple[str, DecoderConfig]:
    """The first supported name in ``hf_config.architectures`` and its ``DecoderConfig``."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    found = [a for a in archs if a in _ARCHITECTURES]
    if not found:
        raise ValueError(
            f"unsupported model architecture {archs or '(none given)'}; "
            f"supported: {supported_architectures()}"
        )
    return found[0], _ARCHITECTURES[found[0]].config_from_hf(hf_config)


def model_shape(cfg: DecoderConfig) -> ModelShape:
    return ModelShape(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, cfg.max_position_embeddings
    )


def build_model(
    hf_config: Any,
    tensors: Mapping[str, np.ndarray],
    dtype: Any,
    attention_backend: str,
    params: Any = None,
    matmul_backend: str = "xla",
    quantized: Mapping[str, tuple] | None = None,
) -> BuiltModel:
    """``params``, if given, is the ready param tree (an orbax checkpoint's) and ``tensors`` is unused.
    With ``matmul_backend="cpu"`` the params are packed for the native CPU matmul (not a tree to save);
    in float32 the kernels whose tensors are in ``quantized`` (HF name -> affine blocks, a GGUF's
    Q4_0 / Q4_1 / Q8_0) stay quantized."""
    arch, cfg = config_from_hf(hf_config)
    if params is None:
        # Blocks are fused only where they will run (not for XLA's dot).
        params = _ARCHITECTURES[arch].params_from_hf(
            cfg, tensors, dtype, quantized if runs_quantized(matmul_backend) else None
        )
    params = pack_for_matmul_backend(params, cfg, dtype, matmul_backend)
    module = DecoderForCausalLM(cfg, dtype, attention_backend, matmul_backend=matmul_backend)
    return BuiltModel(module, params, model_shape(cfg))
