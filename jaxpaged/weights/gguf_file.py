"""A lean reader of GGUF files: metadata and the tensor table, tensors as views of a memory map.

gguf-py's ``GGUFReader`` builds a numpy view for every element of every metadata array (the
tokenizer's ~100k vocabulary strings and merges), which took 3-4 s per file here; this reader
walks the header once, skips arrays nobody asked for, and maps tensor data lazily. The format
(little-endian, version 2 or 3): magic ``GGUF``, version u32, tensor count u64, key/value count
u64, the key/values (string key, u32 value type, value), then per tensor its name, dimension
count u32, dimensions u64 (innermost first), ggml type u32 and data offset u64; tensor data starts
at the next multiple of ``general.alignment`` (default 32).
"""

from __future__ import annotations

import mmap
import pathlib
import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from jaxpaged.math_utils import cdiv

_MAGIC = b"GGUF"
_SCALARS = {  # GGUF value type -> struct format
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in numpy order (outermost first), ``data`` the raw bytes as GGUF stores
    them (float arrays as such; quantized types as ``uint8[rows, bytes per row]``), a view of the map."""

    name: str
    shape: tuple[int, ...]
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray


class GGUFFile:
    """``fields``: metadata key -> value (int, float, bool, str, or a list of them); ``tensors`` in
    file order. Arrays of strings are read only for the keys in ``string_arrays``."""

    def __init__(self, path: str | pathlib.Path, string_arrays: tuple[str, ...] = ()) -> None:
        self.path = pathlib.Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._read(4) != _MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic).")
        version = self._scalar("I")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3).")
        num_tensors, num_fields = self._scalar("Q"), self._scalar("Q")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar("I"), keep_strings=key in string_arrays)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            dims = [self._scalar("Q") for _ in range(self._scalar("I"))]
            infos.append(
                (name, tuple(reversed(dims)), gguf.GGMLQuantizationType(self._scalar("I")), self._scalar("Q"))
            )
        alignment = int(self.fields.get("general.alignment", 32))
        start = cdiv(self._pos, alignment) * alignment
        self.tensors = [
            GGUFTensor(name, shape, qtype, self._tensor_data(start + offset, shape, qtype))
            for name, shape, qtype, offset in infos
        ]

    def _read(self, n: int) -> bytes:
        data = self._map[self._pos : self._pos + n]
        if len(data) != n:
            raise ValueError(f"{self.path}: the GGUF file is truncated.")
        self._pos += n
        return data

    def _scalar(self, fmt: str):
        return struct.unpack("<" + fmt, self._read(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._read(self._scalar("Q")).decode("utf-8", errors="replace")

    def _value(self, vtype: int, keep_strings: bool) -> Any:
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF metadata type {vtype}.")
        etype, count = self._scalar("I"), self._scalar("Q")
        if etype in _SCALARS:
            fmt = _SCALARS[etype]
            return list(struct.unpack(f"<{count}{fmt}", self._read(count * struct.calcsize(fmt))))
        if etype == _STRING:
            if keep_strings:
                return [self._string() for _ in range(count)]
            for _ in range(count):  # skipped: only the lengths are read
                self._pos += 8 + struct.unpack_from("<Q", self._map, self._pos)[0]
            return None
        return [self._value(etype, keep_strings) for _ in range(count)]

    def _tensor_data(
        self, offset: int, shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType
    ) -> np.ndarray:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        plain = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        row_bytes = shape[-1] // block * type_size
        if offset + rows * row_bytes > len(self._map):
            raise ValueError(f"{self.path}: tensor data runs past the end of the file (truncated GGUF?).")
        raw = np.frombuffer(self._map, np.uint8, rows * row_bytes, offset)
        if qtype in plain:
            return raw.view(plain[qtype]).reshape(shape)
        return raw.reshape(*shape[:-1], row_bytes)
