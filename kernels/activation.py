"""SiLU-and-mul: the gated MLP's `silu(gate) * up` on the packed gate_up projection.

x [T, 2I] holds gate in its first half and up in its second (`MLP.gate_up_proj` in
engine/models/layers.py); the output is [T, I]. Fusing the two elementwise ops halves the
memory traffic of doing them in torch. Rounding follows torch's: silu computed in fp32 and
rounded to x's dtype, then the product rounded again, so bf16 results match the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, inter_size, stride_xt, stride_ot,
    BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter_size
    row = x_ptr + t * stride_xt
    gate = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + inter_size + offs, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2I] (rows contiguous) -> silu(x[:, :I]) * x[:, I:] as [T, I] in x's dtype."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1
    num_tokens, inter_size = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((num_tokens, inter_size), dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, inter_size) and out.stride(1) == 1
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter_size))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter_size, block))](
        x, out, inter_size, x.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out
