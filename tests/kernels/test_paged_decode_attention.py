"""Paged decode attention vs the torch reference (fp32, tiny shapes, interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference as ref
from kernels.paged_decode_attention import (
    DecodeConfig,
    SplitWorkspace,
    choose_num_splits,
    paged_decode_attention,
    partition_tokens,
)
from tests.kernels.helpers import make_paged_kv, max_rel_err, packed_qkv, test_device

SEQ_LENS = [1, 7, 33, 20]  # ragged; 7, 33 and 20 are not multiples of the block size 4
HEAD_DIM, BLOCK_SIZE, SCALE = 16, 4, 0.3


@pytest.mark.parametrize("fold_merge", [True, False])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 2), (8, 1)])
def test_matches_reference(num_q_heads, num_kv_heads, num_splits, fold_merge):
    dev = test_device()
    _, kv_layer, tables = make_paged_kv(SEQ_LENS, num_kv_heads, HEAD_DIM, BLOCK_SIZE, device=dev)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=dev)
    q, _, _ = packed_qkv(len(SEQ_LENS), num_q_heads, num_kv_heads, HEAD_DIM, torch.float32, dev)
    # 3 partitions of 16 tokens; the merge in the last partition's program or a second kernel
    cfg = DecodeConfig(block_n=16, num_splits=num_splits, fold_merge=fold_merge)
    out = paged_decode_attention(q, kv_layer, tables, seq_lens, SCALE, max_seq_len=33, config=cfg)
    assert max_rel_err(out, ref.decode_attention(q, kv_layer, tables, seq_lens, SCALE)) <= 1e-5


def test_folded_merge_leaves_its_counts_at_zero_for_the_next_launch():
    """A CUDA graph replays the kernel on the same workspace: each launch must leave every
    count at 0, or the next one merges early (or never). Three launches, one result; then a
    count left at 1 on purpose: the second of three partitions to finish merges and the third
    leaves the count at 1 again, which the check sees. (Which partials that early merge reads
    depends on timing on a GPU; the interpreter runs the programs in order, so there it reads
    the last launch's stale ones and the output is wrong too.)"""
    dev = test_device()
    _, kv_layer, tables = make_paged_kv(SEQ_LENS, 2, HEAD_DIM, BLOCK_SIZE, device=dev)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=dev)
    q = torch.randn(len(SEQ_LENS), 4, HEAD_DIM, device=dev)
    expect = ref.decode_attention(q, kv_layer, tables, seq_lens, SCALE)
    ws = SplitWorkspace.allocate(len(SEQ_LENS), 4, 3, HEAD_DIM, dev)
    cfg = DecodeConfig(block_n=16, num_splits=3, fold_merge=True)
    for _ in range(3):
        out = paged_decode_attention(q, kv_layer, tables, seq_lens, SCALE, workspace=ws, config=cfg)
        assert max_rel_err(out, expect) <= 1e-5
        assert torch.count_nonzero(ws.count) == 0
    ws.count[2 * 2] = 1  # sequence 2 (3 partitions), kv head 0: one partition "already done"
    q = torch.randn_like(q)  # so the last launch's partials differ from this one's
    out = paged_decode_attention(q, kv_layer, tables, seq_lens, SCALE, workspace=ws, config=cfg)
    assert ws.count.tolist() == [0] * 4 + [1] + [0] * (ws.count.numel() - 5)
    if dev.type == "cpu":
        expect = ref.decode_attention(q, kv_layer, tables, seq_lens, SCALE)
        assert max_rel_err(out[2], expect[2]) > 1e-3


@pytest.mark.parametrize("fold_merge", [True, False])
def test_split_with_workspace_and_padding_rows(fold_merge):
    """A preallocated, oversized workspace (CUDA-graph use) and padded rows (seq_len 0 -> 0)."""
    dev = test_device()
    lens = [9, 0, 30, 0]
    _, kv_layer, tables = make_paged_kv([9, 1, 30, 1], 2, HEAD_DIM, BLOCK_SIZE, device=dev)
    tables[[1, 3]] = 0  # padding rows point at the null block
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(4, 4, HEAD_DIM, device=dev)
    ws = SplitWorkspace.allocate(6, 4, 8, HEAD_DIM, dev)
    out = torch.full_like(q, float("nan"))
    cfg = DecodeConfig(block_n=16, num_splits=4, fold_merge=fold_merge)
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
