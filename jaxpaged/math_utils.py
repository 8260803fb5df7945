"""The small arithmetic every module repeats: ceiling division, power-of-two shape buckets, the seed width.
Pure Python: the scheduler and the block manager import it."""

from __future__ import annotations

from typing import TypeVar

N = TypeVar("N")

SEED_MASK = (1 << 64) - 1
"""Seeds are kept as 64-bit unsigned integers (vLLM takes any int; the sampler hashes 64 bits)."""


def cdiv(a: N, b: int) -> N:
    """``ceil(a / b)`` for non-negative integers or integer arrays, without floats."""
    return -(-a // b)


def pow2_bucket(n: int, cap: int = 1 << 30, floor: int = 1) -> int:
    """Smallest power of two >= max(n, floor), clipped to ``cap`` (never below ``n``): shape buckets keep the
    number of compiled programs logarithmic in the sizes seen."""
    b = 1 << (max(n, floor, 1) - 1).bit_length()
    return max(min(b, cap), n)
