"""RoPE (neox / rotate_half style) applied in place to q and k, optionally after Qwen3's
per-head q/k RMSNorm: one kernel replaces up to six torch ops and their round trips.

cos_sin_cache [max_pos, D] holds, per position, cos of the D/2 frequencies then their sin,
already in the model dtype (`reference.build_cos_sin_cache` builds it bit-identical to
`RotaryEmbedding.cos_sin` in engine/models/layers.py). Every product and sum is rounded to the
model dtype where transformers' `x * cos + rotate_half(x) * sin` rounds it, so bf16 results
match the torch path. One program handles all heads of one token (q and k share its cos/sin).

With `kv_layer` and `slot_mapping` it also stores the rotated K and the token's V into the paged
KV cache (what `kv_cache.kv_cache_write` does): one kernel fewer per layer in decode, where the
step is a few hundred tiny launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_cache_write import saturate, slot_rows
from kernels.utils import check_kv_layer, fp8_max


@triton.jit
def _rope_heads(
    x_ptr, stride_h, num_heads, cos, sin, norm_w1, norm_w2, eps,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """Rotate the [num_heads, 2 * HALF] rows at x_ptr in place (norm first if HAS_NORM)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    ptrs = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    out1, out2 = rope_rows(x1, x2, cos, sin, norm_w1, norm_w2, eps, HALF, HAS_NORM)
    tl.store(ptrs, out1, mask=mask)
    tl.store(ptrs + HALF, out2, mask=mask)
    return out1, out2


@triton.jit
def rope_rows(x1, x2, cos, sin, norm_w1, norm_w2, eps, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """The halves [H, HALF] of H head rows, normed first if HAS_NORM, rotated, in x1's dtype.
    Shared with the decode attention kernel, which rotates q and the new K in registers."""
    dtype = x1.dtype
    if HAS_NORM:  # HF RMSNorm over the whole head: fp32 stats, round, times weight, round
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv_rms = tl.rsqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * HALF) + eps)
        x1 = (norm_w1 * (f1 * inv_rms[:, None]).to(dtype).to(tl.float32)).to(dtype)
        x2 = (norm_w2 * (f2 * inv_rms[:, None]).to(dtype).to(tl.float32)).to(dtype)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    out1 = (f1 * cos).to(dtype).to(tl.float32) - (f2 * sin).to(dtype).to(tl.float32)
    out2 = (f2 * cos).to(dtype).to(tl.float32) + (f1 * sin).to(dtype).to(tl.float32)
    return out1.to(dtype), out2.to(dtype)


# A step's positions are a slice of one device buffer at an offset of its (padded) token count,
# 16-byte aligned only when that count is even: not specialized on (an eager step of the other
# parity compiled a variant while serving; see paged_decode_attention.VARYING). Each program
# loads one position.
@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cache_ptr, q_norm_ptr, k_norm_ptr, eps,
    num_q_heads, num_kv_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    v_ptr, kv_ptr, slot_mapping_ptr, stride_vt, stride_vh,
    stride_kv_blk, stride_kv_kv, stride_kv_tok, stride_kv_h,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr, WRITE_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + offs_d, mask=mask_d, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_d, mask=mask_d, other=0.0)
    cos = cos.to(tl.float32)[None, :]
    sin = sin.to(tl.float32)[None, :]
    if HAS_NORM:  # a static branch: without norm no weight is loaded
        qw1 = tl.load(q_norm_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        qw2 = tl.load(q_norm_ptr + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        kw1 = tl.load(k_norm_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        kw2 = tl.load(k_norm_ptr + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    else:
        qw1 = 1.0
        qw2 = 1.0
        kw1 = 1.0
        kw2 = 1.0
    _rope_heads(
        q_ptr + t * stride_qt, stride_qh, num_q_heads, cos, sin, qw1, qw2, eps,
        HALF, BLOCK_HQ, BLOCK_HALF, HAS_NORM,
    )  # fmt: skip
    k1, k2 = _rope_heads(
        k_ptr + t * stride_kt, stride_kh, num_kv_heads, cos, sin, kw1, kw2, eps,
        HALF, BLOCK_HKV, BLOCK_HALF, HAS_NORM,
    )  # fmt: skip
    if WRITE_KV:  # the paged store of kv_cache_write, from registers (each half of D)
        offs_h = tl.arange(0, BLOCK_HKV)
        dst, mask = slot_rows(
            kv_ptr, slot_mapping_ptr, t, offs_h, offs_d, num_kv_heads, HALF,
            stride_kv_blk, stride_kv_tok, stride_kv_h, BLOCK_SIZE,
        )  # fmt: skip
        dt = kv_ptr.dtype.element_ty
        tl.store(dst, saturate(k1, FP8_MAX).to(dt), mask=mask)
        tl.store(dst + HALF, saturate(k2, FP8_MAX).to(dt), mask=mask)
        src = v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
        v1 = tl.load(src, mask=mask)
        v2 = tl.load(src + HALF, mask=mask)
        tl.store(dst + stride_kv_kv, saturate(v1, FP8_MAX).to(dt), mask=mask)
        tl.store(dst + stride_kv_kv + HALF, saturate(v2, FP8_MAX).to(dt), mask=mask)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    v: torch.Tensor | None = None,
    kv_layer: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q [T, Hq, D] and k [T, Hkv, D] (D contiguous; strided rows welcome, e.g.
    views of a packed qkv): optional per-head RMSNorm (Qwen3), then RoPE at positions [T]
    (int64) from cos_sin_cache [max_pos, D]. Returns (q, k).

    With v [T, Hkv, D], kv_layer [num_blocks, 2, block_size, Hkv, D] and slot_mapping [T]
    (int64, < 0 = skip) it also writes the rotated k and v into the cache, as
    `kv_cache_write` would."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and head_dim % 2 == 0
    assert q.stride(2) == 1 and k.stride(2) == 1, "head_dim must be contiguous"
    assert q.dtype == k.dtype == cos_sin_cache.dtype, "q, k and the cos/sin cache share a dtype"
    assert cos_sin_cache.shape[1] == head_dim and cos_sin_cache.stride(1) == 1
    assert positions.dtype == torch.int64 and positions.shape == (num_tokens,)
    assert positions.is_contiguous()
    has_norm = q_norm_weight is not None
    assert has_norm == (k_norm_weight is not None), "q and k norms come together"
    if has_norm:
        for w in (q_norm_weight, k_norm_weight):
            assert w.shape == (head_dim,) and w.dtype == q.dtype and w.is_contiguous()
    write_kv = kv_layer is not None
    assert write_kv == (v is not None) == (slot_mapping is not None), "v, cache, slots together"
    if write_kv:
        check_kv_layer(kv_layer)
        assert v.shape == k.shape and v.stride(2) == 1, "v: [T, Hkv, D], D contiguous"
        assert kv_layer.shape[3:] == (num_kv_heads, head_dim)
        assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (num_tokens,)
        assert slot_mapping.is_contiguous()
    else:
        v, kv_layer, slot_mapping = k, k.new_empty(0, 2, 1, 1, 1), positions
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache,
        q_norm_weight if has_norm else q, k_norm_weight if has_norm else k, eps,
        num_q_heads, num_kv_heads, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos_sin_cache.stride(0),
        v, kv_layer, slot_mapping, v.stride(0), v.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        HALF=half, BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half), HAS_NORM=has_norm, WRITE_KV=write_kv,
        BLOCK_SIZE=kv_layer.shape[2], FP8_MAX=fp8_max(kv_layer) if write_kv else 0.0,
        num_warps=4,
    )  # fmt: skip
    return q, k
