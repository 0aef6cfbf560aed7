"""The gateway's one-pass block hashing (gateway/index.py) equals the engine's chain
(engine/block_hash.py) byte for byte: a different hash would route every request blind."""

from __future__ import annotations

import random

import pytest

from engine.block_hash import hash_block_tokens
from gateway.index import lookup_hashes


def engine_lookup_hashes(ids: list[int], block_size: int, salt: str | None) -> list[bytes]:
    """What the gateway looks up, computed by the engine's function: every full block before
    the last token."""
    num_blocks = (len(ids) - 1) // block_size
    return hash_block_tokens(ids[: num_blocks * block_size], block_size, salt)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("salt", [None, "", "tenant:a", "group:ü-β"])
@pytest.mark.parametrize("num_tokens", [0, 1, 15, 16, 17, 33, 1000, 8192])
def test_equal_to_the_engine_chain(block_size, salt, num_tokens):
    rng = random.Random(num_tokens * 31 + block_size)
    ids = [rng.randrange(0, 152_000) for _ in range(num_tokens)]
    assert lookup_hashes(ids, block_size, salt) == engine_lookup_hashes(ids, block_size, salt)


def test_extreme_ids_and_sequence_types():
    ids = [0, 2**63 - 1, -(2**63), 1, 2**31, 7] * 6
    expected = engine_lookup_hashes(ids, 4, "s")
    assert lookup_hashes(ids, 4, "s") == expected
    assert lookup_hashes(tuple(ids), 4, "s") == expected


def test_salt_changes_every_hash():
    ids = list(range(100))
    plain, salted = lookup_hashes(ids, 16, None), lookup_hashes(ids, 16, "tenant:a")
    assert len(plain) == len(salted) == 6
    assert all(a != b for a, b in zip(plain, salted))
