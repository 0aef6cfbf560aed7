"""Paged decode attention: one query token per sequence over its cached K/V (GQA, split-K).

Why this shape: decode is bandwidth-bound, every K/V byte of every context is read once per
step. One program serves all q heads that share a kv head (a GQA group, padded to BLOCK_H rows
of one `tl.dot`), so each K/V tile is read once per group, not once per q head. K/V are read
through the block table token by token (a tile of BLOCK_N tokens spans several KV blocks), so
tiles stay large even with block_size 16.

When num_seqs * num_kv_heads programs cannot fill the GPU (small batches), each context is
split into partitions (flash-decoding): pass 1 writes each partition's running max, sum and
unnormalised accumulator, pass 2 merges them. The grid (num_splits partitions per sequence)
depends only on host-known sizes (num_seqs, heads, a max_seq_len bound), never on device data:
the wrapper never syncs, and a CUDA graph captured with a static bound (max_model_len) replays
unchanged as seq_lens grow. Each program sizes its partition from its own sequence's length on
the device: a sequence of L tokens uses min(num_splits, cdiv(L, BLOCK_N)) partitions of equal,
BLOCK_N-aligned size, so a short context under a large bound still spreads over many programs
(the earlier design sized partitions from the bound: batch 1 at 2,048 tokens under a 40,960
bound ran 8 programs, 5% of copy bandwidth). Programs past a sequence's end exit at once.
Padded batch rows (seq_len 0) produce zeros, not NaNs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels.kv_cache_write import saturate, slot_rows
from kernels.rotary import rope_rows
from kernels.utils import check_kv_layer, dot_precision, fp8_max, has_pdl, num_sms

LOG2E = 1.4426950408889634
# Programmatic dependent launch on sm_90+ for both kernels (what it is: kernels/gemv.py's PDL):
# each starts while the kernel before it finishes and waits before reading its results. Off
# until it has run on a GPU (`bench.gpu_engine --variants bf16,rope-attention,
# rope-attention-pdl` times the engine's step each way).
PDL = False
MAX_SPLITS = 64  # bounds the workspace and the merge's tile
# The merge's tile covers every split count (masked): one variant, not one per power of two.
MERGE_BLOCK_P = triton.next_power_of_2(MAX_SPLITS)
SPLIT_BLOCK_N = 64  # KV tokens per tile when splitting (partitions are multiples of it)
SINGLE_BLOCK_N = 128  # and in single-pass programs, which stream long contexts


@dataclass(frozen=True)
class DecodeConfig:
    """Launch knobs; `None` fields take the heuristics below. Benchmarks sweep them."""

    block_n: int | None = None  # KV tokens per tile
    num_splits: int | None = None  # max partitions per sequence; 1 = single pass
    num_warps: int = 4
    num_stages: int | None = None
    # FP8 cache: both dots in fp16 rather than q's dtype (None: when q is bf16). Hopper turns
    # e4m3 into fp16 in one instruction, into bf16 only through more: 0.78x the time measured.
    f16_dots: bool | None = None


# Values that change from step to step are not specialized on (Triton would otherwise compile a
# variant for each pattern of "== 1" and "divisible by 16" among its int arguments): the eager
# attention of a mixed step passes the step's split count and block-table width, and a variant
# first met while serving cost a compile of up to ~1.5 s on a cold Triton cache: the ~5 s stall
# of a fresh machine's first requests (confirmed on an H100, bench/README.md 2026-12-07).
# `TritonPagedAttention.warm_up` compiles the rest.
VARYING = ["num_splits", "stride_bt", "stride_ps", "stride_ph"]


# With ROPE, the positions and slots are slices of step buffers at the step's offsets (see
# kernels/rotary.py): their alignment is not specialized on either.
@triton.jit(
    do_not_specialize=VARYING,
    do_not_specialize_on_alignment=["slot_mapping_ptr", "positions_ptr"],
)
def _paged_decode_kernel(
    q_ptr, kv_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    num_splits,  # programs along axis 2: the most partitions a sequence may use
    stride_qs, stride_qh,
    stride_kv_blk, stride_kv_kv, stride_kv_tok, stride_kv_h,
    stride_bt,
    stride_os, stride_oh,
    stride_ps, stride_ph,  # partials: m/l [S, Hq, P], acc [S, Hq, P, D] (contiguous)
    # ROPE only: q above is un-rotated; the new K/V rows, their slots, positions, cos/sin
    k_ptr, v_ptr, slot_mapping_ptr, positions_ptr, cache_ptr, q_norm_ptr, k_norm_ptr, eps,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cache,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, F16_DOTS: tl.constexpr,
    ROPE: tl.constexpr, HAS_NORM: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if IS_SPLIT:
        psize = _partition_size(seq_len, num_splits, BLOCK_N)
        start = part * psize
        if start >= seq_len:
            return  # past this sequence's end: the merge reads only partitions with tokens
        end = tl.minimum(start + psize, seq_len)
    else:
        start = 0
        end = seq_len
    if PDL:  # launched before the kernel ahead finished: only host-written inputs above
        gdc_launch_dependents()  # the merge (or the next GEMV) may launch now
        gdc_wait()  # q, the new K/V and everything else the kernels before wrote: after this

    offs_h = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + offs_h
    mask_h = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    if ROPE:  # kernels/rotary.py's work for this group, in registers (HEAD_DIM = BLOCK_D)
        q = _rope_group(
            q_ptr + seq * stride_qs, stride_qh, heads, mask_h,
            k_ptr + seq * stride_kt + kvh * stride_kh, v_ptr + seq * stride_vt + kvh * stride_vh,
            kv_ptr, slot_mapping_ptr, positions_ptr, cache_ptr, q_norm_ptr, k_norm_ptr, eps,
            seq, kvh, stride_cache, stride_kv_blk, stride_kv_kv, stride_kv_tok, stride_kv_h,
            (seq_len - 1 >= start) & (seq_len - 1 < end),
            HEAD_DIM // 2, BLOCK_SIZE, HAS_NORM, FP8_MAX,
        )  # fmt: skip
    else:
        q = tl.load(
            q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None] & mask_d[None, :],
            other=0.0,
        )
    if F16_DOTS:  # saturate rather than overflow fp16's range
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
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
        ).to(q.dtype)  # [BLOCK_D, BLOCK_N]; an FP8 cache (scale 1.0) read as q.dtype
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
        ).to(q.dtype)  # [BLOCK_N, BLOCK_D]
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
def _rope_group(
    q_ptr, stride_qh, heads, mask_h, k_ptr, v_ptr, kv_ptr, slot_mapping_ptr, positions_ptr,
    cache_ptr, q_norm_ptr, k_norm_ptr, eps, seq, kvh, stride_cache,
    stride_kv_blk, stride_kv_kv, stride_kv_tok, stride_kv_h, holds_new_token,
    HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_NORM: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    """The group's q rows [BLOCK_H, 2 * HALF], normed (HAS_NORM) and rotated at the sequence's
    position by `rope_rows`, the arithmetic of kernels/rotary.py, so they equal what that kernel
    stores. The program whose partition holds the new token (`holds_new_token`) first rotates
    its kv head's new K and stores it and V at the token's slot, as that kernel does; the
    barrier then makes the stores visible to the program's own tile loads."""
    offs = tl.arange(0, HALF)
    pos = tl.load(positions_ptr + seq)
    cos = tl.load(cache_ptr + pos * stride_cache + offs).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs).to(tl.float32)[None, :]
    if HAS_NORM:
        w1 = tl.load(q_norm_ptr + offs).to(tl.float32)[None, :]
        w2 = tl.load(q_norm_ptr + HALF + offs).to(tl.float32)[None, :]
    else:
        w1 = 1.0
        w2 = 1.0
    rows = q_ptr + heads[:, None] * stride_qh + offs[None, :]
    mask = mask_h[:, None]
    q1, q2 = rope_rows(
        tl.load(rows, mask=mask, other=0.0), tl.load(rows + HALF, mask=mask, other=0.0),
        cos, sin, w1, w2, eps, HALF, HAS_NORM,
    )  # fmt: skip
    if holds_new_token:
        if HAS_NORM:
            kw1 = tl.load(k_norm_ptr + offs).to(tl.float32)[None, :]
            kw2 = tl.load(k_norm_ptr + HALF + offs).to(tl.float32)[None, :]
        else:
            kw1 = 1.0
            kw2 = 1.0
        k1, k2 = rope_rows(
            tl.load(k_ptr + offs)[None, :], tl.load(k_ptr + HALF + offs)[None, :],
            cos, sin, kw1, kw2, eps, HALF, HAS_NORM,
        )  # fmt: skip
        dst, smask = slot_rows(
            kv_ptr, slot_mapping_ptr, seq, tl.zeros([1], dtype=tl.int32) + kvh, offs,
            kvh + 1, HALF, stride_kv_blk, stride_kv_tok, stride_kv_h, BLOCK_SIZE,
        )  # fmt: skip
        dt = kv_ptr.dtype.element_ty
        tl.store(dst, saturate(k1, FP8_MAX).to(dt), mask=smask)
        tl.store(dst + HALF, saturate(k2, FP8_MAX).to(dt), mask=smask)
        v1 = tl.load(v_ptr + offs)[None, :]
        v2 = tl.load(v_ptr + HALF + offs)[None, :]
        tl.store(dst + stride_kv_kv, saturate(v1, FP8_MAX).to(dt), mask=smask)
        tl.store(dst + stride_kv_kv + HALF, saturate(v2, FP8_MAX).to(dt), mask=smask)
        tl.debug_barrier()
    # [BLOCK_H, HALF, 2] -> [BLOCK_H, 2, HALF] -> [BLOCK_H, 2 * HALF]: q1 then q2 per row
    return tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (q1.shape[0], 2 * HALF))


@triton.jit
def _partition_size(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Tokens per partition of one sequence: min(num_splits, cdiv(L, BLOCK_N)) equal parts,
    rounded up to BLOCK_N (never 0, so L = 0 gives no partition at all)."""
    parts = tl.maximum(tl.minimum(num_splits, tl.cdiv(seq_len, BLOCK_N)), 1)
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, parts), BLOCK_N), 1) * BLOCK_N


@triton.jit(do_not_specialize=["num_splits", "stride_ps", "stride_ph"])
def _paged_decode_reduce_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, seq_lens_ptr, num_splits,
    stride_ps, stride_ph, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Merge the partitions of one (sequence, q head) that hold tokens: rescale each by
    exp2(m_p - max m). A sequence of length 0 has none and gets zeros."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    if PDL:  # as in the decode kernel: the partials are read after the wait
        gdc_launch_dependents()
        gdc_wait()
    num_parts = tl.cdiv(seq_len, _partition_size(seq_len, num_splits, BLOCK_N))
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


def use_pdl(device: torch.device) -> bool:
    return PDL and has_pdl(device)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, sms: int) -> int:
    """1 when num_seqs * num_kv_heads programs already cover every SM (the H200 sweep: 32
    sequences x 8 kv heads of 4,096 tokens ran best unsplit, at 94% of copy bandwidth); else
    enough partitions for ~2 programs per SM, at most MAX_SPLITS and at most one per
    SPLIT_BLOCK_N tokens of the bound."""
    programs = num_seqs * num_kv_heads
    if programs >= sms:
        return 1
    wanted = triton.cdiv(2 * sms, programs)
    return max(1, min(wanted, MAX_SPLITS, triton.cdiv(max(max_seq_len, 1), SPLIT_BLOCK_N)))


def partition_tokens(seq_len: int, num_splits: int, block_n: int) -> int:
    """Host mirror of the kernel's `_partition_size` (tests and the benchmark use it)."""
    parts = max(min(num_splits, triton.cdiv(seq_len, block_n)), 1)
    return max(triton.cdiv(triton.cdiv(seq_len, parts), block_n), 1) * block_n


@dataclass(frozen=True)
class DecodeRope:
    """What kernels/rotary.py's kernel would do before decode attention, done inside it: q
    (the un-rotated q view) normed and rotated at `positions`, and the new tokens' K (normed,
    rotated) and V stored at `slot_mapping`. Fields as `rotary_embedding` takes them."""

    k: torch.Tensor  # [S, Hkv, D], the new tokens' un-rotated K (D contiguous)
    v: torch.Tensor  # [S, Hkv, D]
    slot_mapping: torch.Tensor  # [S] int64, < 0 = no store
    positions: torch.Tensor  # [S] int64
    cos_sin_cache: torch.Tensor  # [max_pos, D], q's dtype
    q_norm_weight: torch.Tensor | None = None  # [D] (Qwen3); both or neither
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6

    @staticmethod
    def supports(head_dim: int) -> bool:
        """The kernel joins q's rotated halves into one tile: head_dim a power of two."""
        return head_dim >= 16 and head_dim & (head_dim - 1) == 0


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


def _check_rope(rope: DecodeRope, q: torch.Tensor, kv_layer: torch.Tensor) -> None:
    num_seqs, _, head_dim = q.shape
    num_kv_heads = kv_layer.shape[3]
    assert DecodeRope.supports(head_dim), f"fused RoPE needs a power-of-two head_dim: {head_dim}"
    for t in (rope.k, rope.v):
        assert t.shape == (num_seqs, num_kv_heads, head_dim) and t.stride(2) == 1
    assert rope.k.dtype == rope.v.dtype == q.dtype == rope.cos_sin_cache.dtype
    assert rope.cos_sin_cache.shape[1] == head_dim and rope.cos_sin_cache.stride(1) == 1
    for t in (rope.positions, rope.slot_mapping):
        assert t.dtype == torch.int64 and t.shape == (num_seqs,) and t.is_contiguous()
    assert (rope.q_norm_weight is None) == (rope.k_norm_weight is None), "norms come together"
    for w in (rope.q_norm_weight, rope.k_norm_weight):
        assert w is None or (w.shape == (head_dim,) and w.dtype == q.dtype and w.is_contiguous())


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
    rope: DecodeRope | None = None,
) -> torch.Tensor:
    """Attention of q [S, Hq, D] (the last token of each sequence) over its first seq_lens[s]
    cached tokens; returns [S, Hq, D] in q's dtype. `max_seq_len`: a host-side bound that must
    be >= every seq_len (it sizes the partitions; default: the block table's capacity). For
    CUDA graphs pass a static bound and, optionally, a preallocated `workspace`. With `rope`,
    q is un-rotated and the new tokens' K/V not yet stored: the kernel does both first (one
    launch fewer per layer than `rotary_embedding` + this)."""
    check_kv_layer(kv_layer)
    num_seqs, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, kv_head_dim = kv_layer.shape
    assert kv_head_dim == head_dim and q.stride(2) == 1, "q: [S, Hq, D], D contiguous"
    assert num_q_heads % num_kv_heads == 0, "GQA needs Hq % Hkv == 0"
    assert kv_layer.dtype in (q.dtype, torch.float8_e4m3fn), "KV cache: q's dtype or FP8 e4m3"
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
    num_splits = cfg.num_splits or choose_num_splits(
        num_seqs, num_kv_heads, max_seq_len, num_sms(q.device)
    )
    is_split = num_splits > 1
    block_n = cfg.block_n or (SPLIT_BLOCK_N if is_split else SINGLE_BLOCK_N)
    if head_dim > 128:
        block_n = min(block_n, 32)  # keep the K and V tiles in shared memory
    num_stages = cfg.num_stages or (2 if is_split else 3)
    if is_split:
        ws = workspace or SplitWorkspace.allocate(
            num_seqs, num_q_heads, num_splits, head_dim, q.device
        )
        m, l_sum, acc = ws.row_max, ws.row_sum, ws.acc
        assert m.shape == l_sum.shape == acc.shape[:3] and acc.shape[3] == head_dim
        assert m.shape[0] >= num_seqs and m.shape[1] == num_q_heads and m.shape[2] >= num_splits
        assert m.is_contiguous() and l_sum.is_contiguous() and acc.is_contiguous()
    else:
        m = l_sum = acc = out  # unused by the single-pass kernel
    block_d = triton.next_power_of_2(head_dim)
    pdl = use_pdl(q.device)
    r = rope
    has_norm = r is not None and r.q_norm_weight is not None
    if r is not None:
        _check_rope(r, q, kv_layer)
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, kv_layer, block_tables, seq_lens, out, m, l_sum, acc,
        scale * LOG2E, num_splits,
        q.stride(0), q.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        m.stride(0) if is_split else 0, m.stride(1) if is_split else 0,
        *((r.k, r.v, r.slot_mapping, r.positions, r.cos_sin_cache) if rope else (q,) * 5),
        *((r.q_norm_weight, r.k_norm_weight) if has_norm else (q, q)), r.eps if r else 0.0,
        *((r.k.stride(0), r.k.stride(1), r.v.stride(0), r.v.stride(1)) if rope else (0,) * 4),
        r.cos_sin_cache.stride(0) if rope else 0,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        IS_SPLIT=is_split, DOT_PRECISION=dot_precision(q.dtype),
        F16_DOTS=kv_layer.dtype == torch.float8_e4m3fn
        and (cfg.f16_dots if cfg.f16_dots is not None else q.dtype == torch.bfloat16),
        ROPE=rope is not None, HAS_NORM=has_norm,
        FP8_MAX=fp8_max(kv_layer) if rope is not None else 0.0, PDL=pdl,
        num_warps=cfg.num_warps, num_stages=num_stages, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    if is_split:
        _paged_decode_reduce_kernel[(num_seqs, num_q_heads)](
            m, l_sum, acc, out, seq_lens, num_splits,
            m.stride(0), m.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_N=block_n, BLOCK_P=MERGE_BLOCK_P,
            BLOCK_D=block_d, PDL=pdl, **({"launch_pdl": True} if pdl else {}),
        )  # fmt: skip
    return out
