"""KV-cache write: store each new token's K and V into its paged slot.

slot_mapping[t] = block_id * block_size + offset, filled by the model runner; a negative slot
skips the token (padding rows of a CUDA-graph batch). One program per token copies its
[Hkv, D] K and V rows (already in the [block_size, Hkv, D] tile's layout) into the layer view
of the one model-wide cache, casting to the cache dtype (an FP8 cache, scale 1.0, saturates at
its largest finite value, as `engine.attention.to_cache_dtype` does). Runs before the attention
kernels, which then read new and cached tokens alike through the block table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.utils import check_kv_layer, fp8_max


@triton.jit
def slot_rows(
    kv_ptr, slot_mapping_ptr, t, offs_h, offs_d, num_heads, head_dim,
    stride_kv_blk, stride_kv_tok, stride_kv_h, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """(K-row pointers [H, D] of token t's slot in one layer's paged cache, store mask). A
    negative slot masks everything; its addresses stay in range. The V rows are at
    + stride_kv_kv. Shared with the RoPE kernel, which stores K/V from registers."""
    slot = tl.load(slot_mapping_ptr + t)  # int64
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < head_dim) & (slot >= 0)
    safe_slot = tl.maximum(slot, 0)
    dst = (
        kv_ptr
        + (safe_slot // BLOCK_SIZE) * stride_kv_blk
        + (safe_slot % BLOCK_SIZE) * stride_kv_tok
        + offs_h[:, None] * stride_kv_h
        + offs_d[None, :]
    )
    return dst, mask


@triton.jit
def saturate(x, FP8_MAX: tl.constexpr):
    """x clamped to an FP8 cache's finite range before the cast (FP8_MAX 0: unchanged)."""
    if FP8_MAX > 0:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -FP8_MAX), FP8_MAX)
    return x


@triton.jit
def _kv_cache_write_kernel(
    k_ptr, v_ptr, kv_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kv_blk, stride_kv_kv, stride_kv_tok, stride_kv_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    dst, mask = slot_rows(
        kv_ptr, slot_mapping_ptr, t, offs_h, offs_d, NUM_KV_HEADS, HEAD_DIM,
        stride_kv_blk, stride_kv_tok, stride_kv_h, BLOCK_SIZE,
    )  # fmt: skip
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(dst, saturate(k, FP8_MAX).to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv_kv, saturate(v, FP8_MAX).to(kv_ptr.dtype.element_ty), mask=mask)


def kv_cache_write(
    k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [T, Hkv, D] (D contiguous; rows may be strided views of a packed qkv) into
    kv_layer [num_blocks, 2, block_size, Hkv, D] at slot_mapping [T] (int64, < 0 = skip)."""
    check_kv_layer(kv_layer)
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and kv_layer.shape[3:] == (num_kv_heads, head_dim)
    assert k.stride(2) == 1 and v.stride(2) == 1, "head_dim must be contiguous"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (num_tokens,)
    assert slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    _kv_cache_write_kernel[(num_tokens,)](
        k, v, kv_layer, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=kv_layer.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_MAX=fp8_max(kv_layer), num_warps=4,
    )  # fmt: skip
