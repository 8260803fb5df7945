"""``dtype="auto"``: the dtype an engine runs in when the user leaves it to the engine, resolved once, at
engine build, because it depends on the devices' platform:

- GPU: vLLM's rule ("auto will use FP16 precision for FP32 and FP16 models, and BF16 precision for
  BF16 models"): a checkpoint stored in bfloat16 runs in bfloat16, any other (float32, float16, a GGUF
  whose blocks dequantize to float32, no declared dtype) in float16;
- TPU: bfloat16; TPUs have no fast float16 path (vLLM's TPU backend turns float16 into bfloat16 too);
- CPU: the faster of what the native kernels run: bfloat16 where the native matmul runs the model and
  the CPU multiplies bfloat16 pairs in hardware (AMX tiles or AVX512-BF16's ``vdpbf16ps``, faster than
  float32 there: docs/performance.md), else float32 (XLA's CPU dot and the native
  matmul's portable loops are no faster in bfloat16, which only loses precision).
"""

from __future__ import annotations

import dataclasses
import json
import logging

import jax.numpy as jnp

from jaxpaged.config import EngineConfig, ModelConfig

logger = logging.getLogger(__name__)


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (``/proc/cpuinfo``); empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def native_bf16_hardware() -> bool:
    """Whether the native matmul multiplies bfloat16 in hardware: on AMX tiles (``use_amx``), or with
    AVX512-BF16, which the kernel uses when the CPU has it (``setup.py`` builds it for the installing
    machine's CPU, ``-march=native``, so the CPU's flag tells)."""
    from jaxpaged.kernels.cpu_matmul import native_matmul_vectorized, use_amx

    return native_matmul_vectorized() and (use_amx() or "avx512_bf16" in cpu_flags())


def checkpoint_dtype(model: ModelConfig) -> str | None:
    """The dtype ``model``'s checkpoint declares: a jaxpaged orbax checkpoint's model card, an HF
    directory's ``config.json`` (``torch_dtype``, or ``dtype`` in newer transformers); None for a GGUF
    file or a config without one. A Hub model is downloaded here, once: loading finds it cached."""
    from jaxpaged.weights import is_orbax_checkpoint, resolve_model_path
    from jaxpaged.weights.orbax_checkpoint import read_model_card

    path = resolve_model_path(model.model, model.revision, model.download_dir)
    if is_orbax_checkpoint(path):
        return read_model_card(path)["dtype"]
    if path.is_dir():
        config = json.loads((path / "config.json").read_text())
        return config.get("torch_dtype") or config.get("dtype")
    return None


def cpu_dtype(matmul_backend: str, num_devices: int) -> str:
    """bfloat16 where the native matmul would run a bfloat16 model here and has bfloat16 hardware, else float32."""
    from jaxpaged.kernels.dispatch import resolve_matmul_backend

    native = resolve_matmul_backend(matmul_backend, "cpu", jnp.bfloat16, num_devices) == "cpu"
    return "bfloat16" if native and native_bf16_hardware() else "float32"


def auto_dtype(config: EngineConfig, platform: str) -> str:
    """The dtype ``auto`` stands for on ``platform`` (see the module's docstring)."""
    if platform == "cpu":
        return cpu_dtype(config.matmul_backend, config.parallel.tensor_parallel_size)
    if platform == "tpu":
        return "bfloat16"
    return "bfloat16" if checkpoint_dtype(config.model) == "bfloat16" else "float16"


def resolve_auto_dtype(config: EngineConfig, platform: str) -> EngineConfig:
    """``config`` with ``dtype="auto"`` replaced by the dtype it stands for on ``platform`` (logged);
    any other ``config`` as it is."""
    if config.model.dtype != "auto":
        return config
    dtype = auto_dtype(config, platform)
    logger.info("dtype auto: %s on %s", dtype, platform)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=dtype))
