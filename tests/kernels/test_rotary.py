"""Fused (q/k-norm +) RoPE vs the torch reference, and the reference vs engine/models/layers."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from engine.models.layers import RMSNorm, RotaryEmbedding, apply_rope
from kernels import reference as ref
from kernels.rotary import rotary_embedding
from tests.kernels.helpers import max_rel_err, packed_qkv, test_device

HEAD_DIM, EPS = 16, 1e-6


def _rope(head_dim: int = HEAD_DIM) -> RotaryEmbedding:
    config = Qwen3Config(head_dim=head_dim, rope_theta=10000.0, num_attention_heads=4)
    return RotaryEmbedding(config, head_dim)


def test_reference_equals_engine_layers():
    """The cos/sin cache layout and the reference reproduce layers.py bit for bit."""
    rope = _rope()
    positions = torch.tensor([0, 5, 63, 17])
    cache = ref.build_cos_sin_cache(rope.inv_freq, 64, torch.float32, rope.attention_scaling)
    q, k, _ = packed_qkv(4, 4, 2, HEAD_DIM, torch.float32, "cpu")
    qn, kn = RMSNorm(HEAD_DIM, EPS), RMSNorm(HEAD_DIM, EPS)
    with torch.no_grad():
        qn.weight.uniform_(0.5, 1.5)
        kn.weight.uniform_(0.5, 1.5)
        cos, sin = rope.cos_sin(positions, torch.float32)
        got = ref.rotary(q, k, positions, cache, qn.weight, kn.weight, EPS)
        assert torch.equal(got[0], apply_rope(qn(q), cos, sin))
        assert torch.equal(got[1], apply_rope(kn(k), cos, sin))


@pytest.mark.parametrize("with_norm", [False, True])
def test_matches_reference_in_place(with_norm):
    dev = test_device()
    rope = _rope()
    cache = ref.build_cos_sin_cache(rope.inv_freq, 64, torch.float32).to(dev)
    positions = torch.tensor([3, 0, 63, 17, 17], device=dev)
    q, k, _ = packed_qkv(5, 8, 2, HEAD_DIM, torch.float32, dev)  # strided views, GQA 4
    qw = torch.rand(HEAD_DIM, device=dev) + 0.5 if with_norm else None
    kw = torch.rand(HEAD_DIM, device=dev) + 0.5 if with_norm else None
    expect_q, expect_k = ref.rotary(q, k, positions, cache, qw, kw, EPS)
    rotary_embedding(positions, q, k, cache, qw, kw, EPS)
    assert max_rel_err(q, expect_q) <= 1e-5
    assert max_rel_err(k, expect_k) <= 1e-5


@pytest.mark.parametrize("with_norm", [False, True])
def test_fused_kv_write_matches_rope_then_write(with_norm):
    """With a cache and slots, the kernel also stores the rotated k and v exactly as
    kv_cache_write would after RoPE: shuffled slots, a block's last offset, padding (-1)."""
    dev = test_device()
    rope = _rope()
    cache = ref.build_cos_sin_cache(rope.inv_freq, 64, torch.float32).to(dev)
    positions = torch.tensor([3, 0, 63, 17, 17, 9], device=dev)
    q, k, v = packed_qkv(6, 8, 2, HEAD_DIM, torch.float32, dev)
    qw = torch.rand(HEAD_DIM, device=dev) + 0.5 if with_norm else None
    kw = torch.rand(HEAD_DIM, device=dev) + 0.5 if with_norm else None
    kv = torch.randn(6, 3, 2, 4, 2, HEAD_DIM, device=dev)  # [blocks, layers, 2, bs, Hkv, D]
    expect_kv = kv.clone()
    slots = torch.tensor([13, 5, -1, 22, 7, 23], dtype=torch.int64, device=dev)
    expect_q, expect_k = ref.rotary(q, k, positions, cache, qw, kw, EPS)
    ref.kv_cache_write(expect_kv[:, 1], expect_k, v, slots)
    rotary_embedding(
        positions, q, k, cache, qw, kw, EPS, v=v, kv_layer=kv[:, 1], slot_mapping=slots
    )
    assert max_rel_err(q, expect_q) <= 1e-5
    assert max_rel_err(k, expect_k) <= 1e-5
    assert max_rel_err(kv, expect_kv) <= 1e-5
    assert torch.equal(kv[:, [0, 2]], expect_kv[:, [0, 2]])  # other layers untouched
    assert torch.equal(kv[2, 1], expect_kv[2, 1])  # the padding row wrote nothing
