"""numpy helpers of the host batch: padding an array to its bucket shape."""

from __future__ import annotations

import numpy as np


def padded(values: np.ndarray, size: int, fill) -> np.ndarray:
    """``values`` followed by ``fill`` up to ``size`` (a padding row index is out of range: dropped)."""
    a = np.full(size, fill, values.dtype)
    a[: len(values)] = values
    return a
