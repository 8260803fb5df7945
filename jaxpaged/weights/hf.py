"""Loading a Hugging Face model directory: config.json + safetensors (single file or sharded)."""

from __future__ import annotations

import json
import pathlib

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors can return bf16 arrays)
import numpy as np
import transformers
from safetensors import safe_open

from jaxpaged.weights.resolve import Checkpoint

_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def _weight_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files holding the weights, from the shard index if there is one."""
    if (model_dir / _SINGLE).is_file():
        return [model_dir / _SINGLE]
    index = model_dir / _INDEX
    if not index.is_file():
        raise FileNotFoundError(
            f"{model_dir} has neither {_SINGLE} nor {_INDEX}: only safetensors weights are supported."
        )
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    missing = [s for s in shards if not (model_dir / s).is_file()]
    if missing:
        raise FileNotFoundError(f"{model_dir} is missing shard(s) listed in {_INDEX}: {missing}.")
    return [model_dir / s for s in shards]


def _read_float32(file: pathlib.Path) -> dict[str, np.ndarray]:
    tensors = {}
    with safe_open(file, framework="np") as f:
        for name in f.keys():
            dtype = f.get_slice(name).get_dtype()
            if dtype not in _FLOAT_DTYPES:
                raise ValueError(
                    f"{file}: tensor {name} has dtype {dtype}; supported dtypes are {', '.join(_FLOAT_DTYPES)}."
                )
            tensors[name] = f.get_tensor(name).astype(np.float32, copy=False)
    return tensors


def load_hf(model_dir: pathlib.Path) -> Checkpoint:
    """Read config.json with transformers and every safetensors weight as float32."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    tensors: dict[str, np.ndarray] = {}
    for file in _weight_files(model_dir):
        tensors.update(_read_float32(file))
    return Checkpoint(config=config, tensors=tensors, path=model_dir, format="hf")
