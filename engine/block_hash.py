"""Chained block hashes for prefix caching.

This is the one implementation: the engine hashes requests with it and the gateway imports it
to compute the same hashes for routing. Changing it changes every hash in the fleet.

hash(block) = sha256(parent_hash || token ids as little-endian int64 || extras), where extras
holds the cache salt (first block only: the chain carries it to every later block) and, later,
adapter ids. Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

# Fixed root so that every process (engine, gateway) computes identical chains.
ROOT_HASH: BlockHash = hashlib.sha256(b"tandem.block_hash.root.v1").digest()


def hash_block(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra: bytes = b""
) -> BlockHash:
    h = hashlib.sha256()
    h.update(parent_hash if parent_hash is not None else ROOT_HASH)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    return h.digest()


def _first_block_extra(cache_salt: str | None) -> bytes:
    return b"salt:" + cache_salt.encode() if cache_salt else b""


def hash_block_tokens(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    parent_hashes: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, continuing after `parent_hashes`.

    Pass the hashes already computed for the leading blocks to extend a chain incrementally
    (the engine does this as a request grows by one token per step).
    """
    hashes = list(parent_hashes)
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[-1] if hashes else None
        extra = _first_block_extra(cache_salt) if i == 0 else b""
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
    return hashes
