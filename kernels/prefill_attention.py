"""Prefill attention over a paged prefix: varlen new-token queries, causal, flash-attention tiles.

Each sequence's new tokens (q rows query_start_loc[s]..query_start_loc[s+1]) are the last
q_len positions of a context of seq_lens[s] tokens, whose K/V (prefix and new tokens alike) are
already in the paged cache: the KV-write kernel runs first. So chunked prefill, prefix-cache
hits and decode rows mixed into a prefill batch are all the same case. Decode rows are correct
here but wasteful (one live row per BLOCK_M-row tile): `TritonPagedAttention` gives the leading
ones of a mixed batch to the paged decode kernel instead.

Why this shape: one program owns BLOCK_M query rows of one q head and streams the context in
BLOCK_N-token tiles with an online softmax (fp32 running max/sum in base 2). The loop is split
in two, as in Triton's fused-attention tutorial: tiles entirely below the diagonal skip the
causal mask, only the last few tiles pay for it. Programs of one GQA group run side by side
(q head is the fastest grid axis) so the K/V they share is served from L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.utils import check_kv_layer, dot_precision, is_interpreting

LOG2E = 1.4426950408889634


def _configs() -> list[triton.Config]:
    """Few configs: (BLOCK_M, BLOCK_N, warps, stages). One under the interpreter (no tuning)."""
    if is_interpreting():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    shapes = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in shapes
    ]


@triton.jit
def _attn_tiles(
    acc, l_i, m_i, q, kv_head_base, bt_row_ptr, q_pos, lo, hi, seq_len, qk_scale,
    stride_kv_blk, stride_kv_kv, stride_kv_tok, offs_d, mask_d,
    CAUSAL: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax over KV tokens [lo, hi); CAUSAL masks kv_pos > q_pos and kv_pos >= len."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        tok = start_n + offs_n
        mask_n = tok < seq_len
        blk = tl.load(bt_row_ptr + tok // BLOCK_SIZE, mask=mask_n, other=0)
        tok_off = blk.to(tl.int64) * stride_kv_blk + (tok % BLOCK_SIZE) * stride_kv_tok
        k = tl.load(
            kv_head_base + tok_off[None, :] + offs_d[:, None],
            mask=mask_d[:, None] & mask_n[None, :],
            other=0.0,
        ).to(q.dtype)  # an FP8 cache (scale 1.0) is read as the queries' dtype
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if CAUSAL:
            keep = (tok[None, :] <= q_pos[:, None]) & mask_n[None, :]
            qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            kv_head_base + stride_kv_kv + tok_off[:, None] + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        ).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Not specialized on what changes from step to step (see paged_decode_attention.VARYING): the
# block table's width, and the alignment of the per-sequence arrays, which a mixed step passes
# from its first prefill row on (seq_lens[d:] is 16-byte aligned only when d % 4 == 0).
@triton.autotune(configs=_configs(), key=["HEAD_DIM", "GROUP", "BLOCK_SIZE"])
@triton.jit(
    do_not_specialize=["stride_bt"],
    do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"],
)
def _prefill_attention_kernel(
    q_ptr, kv_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh,
    stride_kv_blk, stride_kv_kv, stride_kv_tok, stride_kv_h,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    q_pos = prefix_len + offs_m  # absolute position of each query row
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_ptrs = q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kv_head_base = kv_ptr + (head // GROUP) * stride_kv_h
    bt_row_ptr = block_tables_ptr + seq * stride_bt
    # Every row of this tile sits at or after position diag_lo: tiles before it need no mask.
    diag_lo = (prefix_len + tile * BLOCK_M) // BLOCK_N * BLOCK_N
    hi = tl.minimum(seq_len, prefix_len + (tile + 1) * BLOCK_M)
    acc, l_i, m_i = _attn_tiles(
        acc, l_i, m_i, q, kv_head_base, bt_row_ptr, q_pos, 0, diag_lo, seq_len, qk_scale,
        stride_kv_blk, stride_kv_kv, stride_kv_tok, offs_d, mask_d,
        False, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _attn_tiles(
        acc, l_i, m_i, q, kv_head_base, bt_row_ptr, q_pos, diag_lo, hi, seq_len, qk_scale,
        stride_kv_blk, stride_kv_kv, stride_kv_tok, offs_d, mask_d,
        True, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip
    out = acc / l_i[:, None]
    out_ptrs = out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh
    out_ptrs += offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def prefill_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] (each sequence's new tokens, concatenated) over the
    sequence's first seq_lens[s] cached tokens; returns [T, Hq, D] in q's dtype.
    `max_query_len` (host int, >= every q_len) sizes the grid; programs past a sequence's
    q_len exit at once."""
    check_kv_layer(kv_layer)
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, kv_head_dim = kv_layer.shape
    num_seqs = seq_lens.shape[0]
    assert kv_head_dim == head_dim and q.stride(2) == 1, "q: [T, Hq, D], D contiguous"
    assert num_q_heads % num_kv_heads == 0, "GQA needs Hq % Hkv == 0"
    assert kv_layer.dtype in (q.dtype, torch.float8_e4m3fn), "KV cache: q's dtype or FP8 e4m3"
    assert block_tables.dtype == torch.int32 and block_tables.shape[0] == num_seqs
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    assert query_start_loc.dtype == torch.int32 and query_start_loc.shape == (num_seqs + 1,)
    assert query_start_loc.is_contiguous()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out

    def grid(meta: dict) -> tuple[int, int, int]:
        return (num_q_heads, triton.cdiv(max_query_len, meta["BLOCK_M"]), num_seqs)

    _prefill_attention_kernel[grid](
        q, kv_layer, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_D=triton.next_power_of_2(head_dim), DOT_PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    return out
