"""Per-token (per-row) dynamic FP8 quantization of activations in one kernel.

The W8A8 path of `engine.quantization.Fp8Linear` quantizes every GEMM's input per row:
scale[r] = max(amax(|x[r, :]|) / 448, 1e-12), x_fp8[r, :] = clamp(x[r, :] / scale[r]) as e4m3.
In torch that is six passes over the activations, two of them through float32 copies (abs,
amax, float, divide, clamp, cast): on the H200 they made FP8 prefill slower than bf16. Here
one program per row reads the row twice (its amax, then the quantized write; the second read
comes from cache) and writes one byte per element.

The arithmetic is torch's (`engine.quantization.quantize_rows`): the amax of the input dtype's
values, a float32 scale, an IEEE-rounded float32 division and a round-to-nearest-even cast, so
both give the same bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_gemm import FP8

FP8_MAX = torch.finfo(FP8).max  # 448
MIN_SCALE = 1e-12  # an all-zero row (or weight channel): any scale reproduces it


@triton.jit
def _round_to_e4m3(v):
    """v (float32, |v| <= 448) rounded to its nearest e4m3 value, ties to even, still as
    float32, so that the cast that follows is exact. (Triton's interpreter rounds its fp8
    casts wrongly, the compiled cast is right: this keeps both equal to torch's.) Normal
    range: the float32 bits rounded to 3 mantissa bits; below 2^-6 the grid is 2^-9, which
    adding and subtracting 1.5 * 2^14 rounds |v| to (v's sign put back: -0.0 stays -0.0)."""
    bits = v.to(tl.uint32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    subnormal = ((tl.abs(v) + 24576.0) - 24576.0).to(tl.uint32, bitcast=True)
    subnormal = subnormal | (bits & 0x80000000)
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_quant_kernel(
    x_ptr, q_ptr, scale_ptr, n_cols, stride_x, stride_q, fp8_max, min_scale,
    BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    row = x_ptr + r * stride_x
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / fp8_max, min_scale)
    tl.store(scale_ptr + r, scale)
    out = q_ptr + r * stride_q
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -fp8_max, fp8_max))
        tl.store(out + offs, q.to(out.dtype.element_ty), mask=mask)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] (rows contiguous) -> (x_fp8 [R, C] e4m3, scale [R, 1] float32), x ~ x_fp8 *
    scale: `engine.quantization.quantize_rows` in one launch."""
    assert x.dim() == 2 and x.stride(1) == 1, "rows must be contiguous"
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    block = min(2048, triton.next_power_of_2(cols))
    _fp8_quant_kernel[(rows,)](
        x, q, scale, cols, x.stride(0), q.stride(0), FP8_MAX, MIN_SCALE, BLOCK=block, num_warps=4
    )
    return q, scale
