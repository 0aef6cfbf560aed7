"""KV-cache write vs the torch reference: strided inputs, shuffled slots, padding slots."""

from __future__ import annotations

import torch

from kernels import reference as ref
from kernels.kv_cache_write import kv_cache_write
from tests.kernels.helpers import packed_qkv, test_device


def test_matches_reference_and_skips_padding():
    dev = test_device()
    num_blocks, num_layers, block_size, num_kv_heads, head_dim = 6, 2, 4, 2, 16
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, device=dev)
    expect = cache.clone()
    _, k, v = packed_qkv(7, 4, num_kv_heads, head_dim, torch.float32, dev)
    # Slots in shuffled blocks, one at a block's last offset, and two padding rows (-1).
    slots = torch.tensor([13, 5, -1, 22, 6, -1, 23], dtype=torch.int64, device=dev)
    kv_cache_write(k, v, cache[:, 1], slots)
    ref.kv_cache_write(expect[:, 1], k, v, slots)
    assert torch.equal(cache, expect)  # nothing else touched, layer 0 included
