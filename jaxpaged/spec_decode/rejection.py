"""Verification of drafted tokens: which of them a step keeps, and the token it adds.

A verifying row samples every one of its positions with the request's own sampling parameters, seed
and position (the sampler's per-row arithmetic, nothing speculative in it), then keeps drafts while
each equals the token sampled at its position; the first sample that differs (or the one after the
last draft: the bonus token) is the step's last token.

This is the standard rejection sampler for deterministic drafts. Our proposers (n-gram lookup, a
greedy draft model) put all of a position's draft mass q on one token d. The standard rule accepts
d with probability min(1, p(d) / q(d)) = p(d) and on rejection samples norm(max(0, p - q)), which is p
without d, renormalized. Drawing y ~ p and keeping d when y = d realizes exactly that: P(keep) = p(d),
and given y != d, y is distributed as p restricted to the other tokens. So every emitted token has the
target's distribution, and since y is the draw the plain engine makes at that position (the seed folded
with the position), a seeded or greedy request emits the same tokens with and without speculation, as far
as the logits are the same (a row of k + 1 query tokens may round differently in the last bits).
"""

from __future__ import annotations

import numpy as np


def num_accepted(sampled: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """Per row, how many leading drafts were kept: ``sampled[r, j] == drafts[r, j]`` for each of
    them. ``sampled`` is ``[rows, k + 1]`` (the tokens sampled after each draft position and at the
    bonus one), ``drafts`` ``[rows, k]`` (padded with -1, which no sample equals)."""
    return np.cumprod(sampled[:, : drafts.shape[1]] == drafts, axis=1).sum(axis=1)
