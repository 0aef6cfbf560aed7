"""Paged decode attention: one query token per sequence over its cached K/V (GQA, split-K).

Why this shape: decode is bandwidth-bound, every K/V byte of every context is read once per
step. One program serves all q heads that share a kv head (a GQA group, padded to BLOCK_H rows
of one `tl.dot`), so each K/V tile is read once per group, not once per q head. K/V are read
through the block table token by token (a tile of BLOCK_N tokens spans several KV blocks), so
tiles stay large even with block_size 16.

When num_seqs * num_kv_heads programs cannot fill the GPU (small batches), the context is
split into fixed-size partitions (flash-decoding): pass 1 writes each partition's running max,
sum and unnormalised accumulator, pass 2 merges them. The grid and the partition size depend
only on host-known static sizes (num_seqs, heads, a max_seq_len bound), never on device data:
the wrapper never syncs, and a CUDA graph captured with a static bound (max_model_len) replays
unchanged as seq_lens grow. Partitions are sized from that bound / MAX_SPLITS but never below
MIN_PARTITION_TOKENS, so a short context under a large bound still spreads over several
programs; partitions past a sequence's end exit at once and the merge skips them.
Padded batch rows (seq_len 0) produce zeros, not NaNs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.utils import check_kv_layer, dot_precision, num_sms

LOG2E = 1.4426950408889634
MIN_PARTITION_TOKENS = 512  # below this a partition's fixed cost outweighs the parallelism
MAX_SPLITS = 64  # bounds the workspace and the merge's tile


@dataclass(frozen=True)
class DecodeConfig:
    """Launch knobs; `None` fields take the heuristics below. Benchmarks sweep them."""

    block_n: int | None = None  # KV tokens per tile
    num_splits: int | None = None  # partitions of max_seq_len; 1 = single pass
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _kernel(
    q_ptr, kv_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    partition_size,  # KV tokens per program along axis 2 (a multiple of BLOCK_N)
    stride_qs, stride_qh,
    stride_kv_blk, stride_kv_kv, stride_kv_tok, stride_kv_h,
    stride_bt,
    stride_os, stride_oh,
    stride_ps, stride_ph,  # partials: m/l [S, Hq, P], acc [S, Hq, P, D] (contiguous)
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * partition_size
    if IS_SPLIT:
        if start >= seq_len:
            return  # past this sequence's end: the merge reads only partitions with tokens
    end = tl.minimum(start + partition_size, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + offs_h
    mask_h = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    # A finite floor, not -inf: a fully masked row must give exp2(m - m_new) = 1, never NaN.
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    kv_head_base = kv_ptr + kvh * stride_kv_h
    for start_n in range(start, end, BLOCK_N):
        tok = start_n + offs_n
        mask_n = tok < end
        blk = tl.load(block_tables_ptr + seq * stride_bt + tok // BLOCK_SIZE, mask=mask_n, other=0)
        # int64: a whole-model cache exceeds 2**31 elements.
        tok_off = blk.to(tl.int64) * stride_kv_blk + (tok % BLOCK_SIZE) * stride_kv_tok
        k = tl.load(
            kv_head_base + tok_off[None, :] + offs_d[:, None],
            mask=mask_d[:, None] & mask_n[None, :],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            kv_head_base + stride_kv_kv + tok_off[:, None] + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    mask_hd = mask_h[:, None] & mask_d[None, :]
    if IS_SPLIT:
        row = seq * stride_ps + heads * stride_ph + part
        tl.store(m_ptr + row, m_i, mask=mask_h)
        tl.store(l_ptr + row, l_i, mask=mask_h)
        tl.store(acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask_hd)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_hd)


@triton.jit
def _reduce_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, seq_lens_ptr, partition_size, num_splits,
    stride_ps, stride_ph, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Merge the partitions of one (sequence, q head) that hold tokens: rescale each by
    exp2(m_p - max m). A sequence of length 0 has none and gets zeros."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_parts = tl.minimum(tl.cdiv(tl.load(seq_lens_ptr + seq), partition_size), num_splits)
    offs_p = tl.arange(0, BLOCK_P)
    mask_p = offs_p < num_parts
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    row = seq * stride_ps + head * stride_ph + offs_p
    m = tl.load(m_ptr + row, mask=mask_p, other=-1.0e30)
    l_p = tl.load(l_ptr + row, mask=mask_p, other=0.0)
    acc = tl.load(
        acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=mask_p[:, None] & mask_d[None, :],
        other=0.0,
    )
    w = tl.exp2(m - tl.max(m, 0))
    denom = tl.sum(w * l_p, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, sms: int) -> int:
    """1 when num_seqs * num_kv_heads programs already give ~4 per SM (or the context is one
    partition); else as many partitions of >= MIN_PARTITION_TOKENS as the bound allows."""
    if num_seqs * num_kv_heads >= 4 * sms:
        return 1
    return max(1, min(triton.cdiv(max_seq_len, MIN_PARTITION_TOKENS), MAX_SPLITS))


def partition_tokens(max_seq_len: int, num_splits: int, block_n: int) -> int:
    """Tokens per partition: num_splits of them cover max_seq_len; a multiple of block_n."""
    return triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n


@dataclass
class SplitWorkspace:
    """fp32 partials of pass 1, sized from static maxima so a CUDA graph can own them."""

    row_max: torch.Tensor  # [S, Hq, P], base-2 logits
    row_sum: torch.Tensor  # [S, Hq, P]
    acc: torch.Tensor  # [S, Hq, P, D]

    @classmethod
    def allocate(cls, num_seqs: int, num_q_heads: int, num_splits: int, head_dim: int, device):
        shape = (num_seqs, num_q_heads, num_splits)
        kw = dict(dtype=torch.float32, device=device)
        return cls(torch.empty(shape, **kw), torch.empty(shape, **kw),
                   torch.empty((*shape, head_dim), **kw))  # fmt: skip


def paged_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    workspace: SplitWorkspace | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Attention of q [S, Hq, D] (the last token of each sequence) over its first seq_lens[s]
    cached tokens; returns [S, Hq, D] in q's dtype. `max_seq_len`: a host-side bound that must
    be >= every seq_len (it sizes the partitions; default: the block table's capacity). For
    CUDA graphs pass a static bound and, optionally, a preallocated `workspace`."""
    check_kv_layer(kv_layer)
    num_seqs, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, kv_head_dim = kv_layer.shape
    assert kv_head_dim == head_dim and q.stride(2) == 1, "q: [S, Hq, D], D contiguous"
    assert num_q_heads % num_kv_heads == 0, "GQA needs Hq % Hkv == 0"
    assert q.dtype == kv_layer.dtype, "q and the KV cache must share a dtype"
    assert block_tables.dtype == torch.int32 and block_tables.shape[0] == num_seqs
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (num_seqs,)
    assert seq_lens.is_contiguous()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1
    if num_seqs == 0:
        return out
    cfg = config or DecodeConfig()
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    group = num_q_heads // num_kv_heads
    block_n = cfg.block_n or (64 if head_dim <= 128 else 32)
    num_splits = cfg.num_splits or choose_num_splits(
        num_seqs, num_kv_heads, max_seq_len, num_sms(q.device)
    )
    is_split = num_splits > 1
    if is_split:
        partition_size = partition_tokens(max_seq_len, num_splits, block_n)
        ws = workspace or SplitWorkspace.allocate(
            num_seqs, num_q_heads, num_splits, head_dim, q.device
        )
        m, l_sum, acc = ws.row_max, ws.row_sum, ws.acc
        assert m.shape == l_sum.shape == acc.shape[:3] and acc.shape[3] == head_dim
        assert m.shape[0] >= num_seqs and m.shape[1] == num_q_heads and m.shape[2] >= num_splits
        assert m.is_contiguous() and l_sum.is_contiguous() and acc.is_contiguous()
    else:  # one partition covers the block table's whole capacity, whatever max_seq_len says
        partition_size = block_tables.shape[1] * block_size
        m = l_sum = acc = out  # unused by the single-pass kernel
    block_d = triton.next_power_of_2(head_dim)
    _kernel[(num_seqs, num_kv_heads, num_splits)](
        q, kv_layer, block_tables, seq_lens, out, m, l_sum, acc,
        scale * LOG2E, partition_size,
        q.stride(0), q.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        m.stride(0) if is_split else 0, m.stride(1) if is_split else 0,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        IS_SPLIT=is_split, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if is_split:
        _reduce_kernel[(num_seqs, num_q_heads)](
            m, l_sum, acc, out, seq_lens, partition_size, num_splits,
            m.stride(0), m.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_P=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )  # fmt: skip
    return out
