"""RMSNorm, alone or fused with the residual add that precedes it in every decoder layer.

Numerics are transformers' (engine/models/layers.py `RMSNorm`): statistics in fp32, the
normalised row rounded to the input dtype, then multiplied by the weight and rounded again.
The fused form also rounds `x + residual` to the input dtype before normalising, exactly as the
layer's separate `residual + x` does. So bf16 outputs equal the torch path's bit for bit up to
the fp32 summation order. One program normalises one row (hidden sizes fit one tile).

`fused_add_rms_norm` works in place (vLLM's contract): residual <- x + residual and
x <- norm(residual). No allocation, so it is free inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, hidden_size, eps,
    stride_xt, stride_rt, stride_ot,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size
    x = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + t * stride_rt + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + t * stride_rt + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / hidden_size + eps)
    normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, out, eps: float) -> None:
    num_tokens, hidden_size = x.shape
    assert x.stride(1) == 1 and out.stride(1) == 1 and weight.is_contiguous()
    assert weight.shape == (hidden_size,) and weight.dtype == x.dtype, "weight: [H], x's dtype"
    if num_tokens == 0:
        return
    block = triton.next_power_of_2(hidden_size)
    res = residual if residual is not None else x
    _rms_norm_kernel[(num_tokens,)](
        x, res, weight, out, hidden_size, eps,
        x.stride(0), res.stride(0), out.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, H] -> weight * (x / rms(x)) in x's dtype (HF order of roundings)."""
    assert x.dim() == 2
    if out is None:
        out = torch.empty_like(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    _launch(x, None, weight, out, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual, x <- rms_norm(residual). Returns (x, residual)."""
    assert x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype
    assert residual.stride(1) == 1
    _launch(x, residual, weight, x, eps)
    return x, residual
