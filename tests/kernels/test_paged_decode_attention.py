"""Paged decode attention vs the torch reference (fp32, tiny shapes, interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference as ref
from kernels.paged_decode_attention import (
    DecodeConfig,
    DecodeRope,
    SplitWorkspace,
    choose_num_splits,
    paged_decode_attention,
    partition_tokens,
)
from tests.kernels.helpers import make_paged_kv, max_rel_err, packed_qkv, test_device

SEQ_LENS = [1, 7, 33, 20]  # ragged; 7, 33 and 20 are not multiples of the block size 4
HEAD_DIM, BLOCK_SIZE, SCALE = 16, 4, 0.3


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 2), (8, 1)])
def test_matches_reference(num_q_heads, num_kv_heads, num_splits):
    dev = test_device()
    _, kv_layer, tables = make_paged_kv(SEQ_LENS, num_kv_heads, HEAD_DIM, BLOCK_SIZE, device=dev)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=dev)
    q, _, _ = packed_qkv(len(SEQ_LENS), num_q_heads, num_kv_heads, HEAD_DIM, torch.float32, dev)
    cfg = DecodeConfig(block_n=16, num_splits=num_splits)  # 3 partitions of 16 tokens
    out = paged_decode_attention(q, kv_layer, tables, seq_lens, SCALE, max_seq_len=33, config=cfg)
    assert max_rel_err(out, ref.decode_attention(q, kv_layer, tables, seq_lens, SCALE)) <= 1e-5


def test_split_with_workspace_and_padding_rows():
    """A preallocated, oversized workspace (CUDA-graph use) and padded rows (seq_len 0 -> 0)."""
    dev = test_device()
    lens = [9, 0, 30, 0]
    _, kv_layer, tables = make_paged_kv([9, 1, 30, 1], 2, HEAD_DIM, BLOCK_SIZE, device=dev)
    tables[[1, 3]] = 0  # padding rows point at the null block
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(4, 4, HEAD_DIM, device=dev)
    ws = SplitWorkspace.allocate(6, 4, 8, HEAD_DIM, dev)
    out = torch.full_like(q, float("nan"))
    cfg = DecodeConfig(block_n=16, num_splits=4)
    paged_decode_attention(q, kv_layer, tables, seq_lens, SCALE, out=out, workspace=ws, config=cfg)
    assert torch.all(out[[1, 3]] == 0)
    live = [0, 2]
    expect = ref.decode_attention(q[live], kv_layer, tables[live], seq_lens[live], SCALE)
    assert max_rel_err(out[live], expect) <= 1e-5


def test_choose_num_splits():
    # Enough programs to cover the SMs: no split. Small batches: ~2 programs per SM, at most
    # 64 partitions and at most one per 64 tokens of the bound.
    assert choose_num_splits(32, 8, 4096, sms=132) == 1
    assert choose_num_splits(16, 8, 4096, sms=132) == 3
    assert choose_num_splits(1, 8, 40960, sms=132) == 33
    assert choose_num_splits(1, 1, 40960, sms=132) == 64
    assert choose_num_splits(1, 8, 100, sms=132) == 2
    # Each sequence splits by its own length, not by the bound: 512 tokens -> 8 x 64.
    assert partition_tokens(512, 33, block_n=64) == 64
    assert partition_tokens(40960, 64, block_n=64) == 640
    assert partition_tokens(33, 3, block_n=16) == 16
    assert partition_tokens(0, 8, block_n=64) == 64  # no partition holds a token


def test_short_context_under_large_bound_spreads():
    """Batch 1, 40 tokens under a bound of 4096: the sequence's own length sets the
    partitions (3 of 16 tokens with block_n 16), and the result still matches."""
    dev = test_device()
    _, kv_layer, tables = make_paged_kv([40], 2, HEAD_DIM, BLOCK_SIZE, device=dev)
    seq_lens = torch.tensor([40], dtype=torch.int32, device=dev)
    q = torch.randn(1, 4, HEAD_DIM, device=dev)
    ws = SplitWorkspace.allocate(1, 4, 64, HEAD_DIM, dev)
    ws.row_max.fill_(float("nan"))  # partitions past the end must never be read
    cfg = DecodeConfig(block_n=16, num_splits=64)
    out = paged_decode_attention(
        q, kv_layer, tables, seq_lens, SCALE, max_seq_len=4096, workspace=ws, config=cfg
    )
    assert torch.isfinite(ws.row_max[0, :, :3]).all()  # partitions 0..2 written
    assert torch.isnan(ws.row_max[0, :, 3:]).all()  # the rest exited at once
    assert max_rel_err(out, ref.decode_attention(q, kv_layer, tables, seq_lens, SCALE)) <= 1e-5


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_equals_rotary_then_attention(dtype, with_norm, num_splits):
    """`rope=`: q and the new K normed and rotated, K/V stored, then attention, in one kernel:
    the same output and the same cache bytes as kernels/rotary.py's kernel followed by the
    plain decode kernel. Sequences end inside a block, at its last offset and in a partition
    of their own; a padding row (length 0, slot -1) writes nothing and returns zeros."""
    from kernels.rotary import rotary_embedding

    dev, head_dim, block_size = test_device(), 32, 4
    seq_lens = [9, 8, 1, 40, 33, 0]
    kv_cache, kv_layer, tables = make_paged_kv(seq_lens, 2, head_dim, block_size, dtype, dev)
    q, k, v = packed_qkv(len(seq_lens), 8, 2, head_dim, dtype, dev, seed=3)
    positions = torch.tensor([max(n - 1, 0) for n in seq_lens], device=dev)
    slots = torch.tensor(
        [int(tables[s, (n - 1) // block_size]) * block_size + (n - 1) % block_size if n else -1
         for s, n in enumerate(seq_lens)],
        device=dev,
    )  # fmt: skip
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    cos_sin = ref.build_cos_sin_cache(inv_freq, 64, torch.float32).to(dtype).to(dev)
    gen = torch.Generator().manual_seed(1)
    qw, kw = ((torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(dev) for _ in range(2))
    norms = (qw, kw) if with_norm else (None, None)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    cfg = DecodeConfig(num_splits=num_splits, block_n=16)

    kv_ref = kv_cache.clone()
    q_ref, k_ref, v_ref = q.clone(), k.clone(), v.clone()
    rotary_embedding(positions, q_ref, k_ref, cos_sin, *norms, 1e-6, v=v_ref,
                     kv_layer=kv_ref[:, 1], slot_mapping=slots)  # fmt: skip
    expect = paged_decode_attention(q_ref, kv_ref[:, 1], tables, lens, 0.3, config=cfg)

    rope = DecodeRope(k, v, slots, positions, cos_sin, *norms, eps=1e-6)
    got = paged_decode_attention(q, kv_layer, tables, lens, 0.3, config=cfg, rope=rope)
    assert torch.equal(kv_cache, kv_ref)  # the new K/V bytes, and nothing else written
    assert torch.equal(got, expect)
    assert not got[5].any()
