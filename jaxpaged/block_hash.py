"""Prefix-cache block hashes: a full block's hash is chained over (parent block's hash, the block's
token ids), rooted in a SHA-256 digest of the request's salt.

A hit is verified exactly (``BlockPool.lookup``): the cached block's token ids must equal the request's,
and its parent must be the very block (same physical id, not overwritten since) that the request
matched one step earlier, or for a first block the request's own root digest; so a hash
collision cannot hand a request another prefix's KV, and the chain's hash need not resist
collisions: it is Python's 64-bit tuple hash (cheaper per block than a SHA-256 digest, and a decode
step publishes many full blocks). A collision only costs a hit:
the first block published under a hash keeps it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

BlockHash = int
RootDigest = bytes
ParentKey = RootDigest | tuple[int, int]
"""What a cached block was computed after: the chain root's digest for a first block, else
(parent block id, parent generation)."""


def hash_block(parent: BlockHash | RootDigest, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block, after its parent's hash (the root digest for a first block).
    Not collision-resistant: a hit is verified token by token (see the module docstring)."""
    return hash((parent, *token_ids))


def root_hash(cache_salt: str | None) -> RootDigest:
    """The chain's root, compared in full on every first-block hit: requests with different salts
    never share a block."""
    return hashlib.sha256(b"jaxpaged-prefix-root" + (cache_salt or "").encode()).digest()
