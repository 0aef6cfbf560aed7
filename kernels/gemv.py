"""Batch-1 decode GEMMs that own their whole reduction and fold in the op before them.

y = prologue(x) @ w.T (+ bias), for one or two rows of x and a weight w [N, K] in x's dtype, or
in FP8 e4m3 with per-output-channel fp32 scales (`--quantization fp8`'s weight-only decode
form: y = (prologue(x) @ w_fp8.T) * w_scale (+ bias), as kernels/fp8_gemm.py's GEMV).

Why: at batch 1 a decoder layer is eleven kernels, and on Qwen3-0.6B most of them are short
enough that their count, not their bytes, sets the step time (H200, bench/profile_step:
1.40 ms a step against a 0.30 ms memory floor). cuBLAS splits K for o_proj and down_proj and
adds a reduce kernel, and the RMSNorm before qkv_proj and gate_up_proj and the SiLU-and-mul
before down_proj are launches of their own. Here one program computes BLOCK_N whole outputs
of one row over all of K (no partial sums, no reduce), and computes its input on the fly:

  NONE      x as it is
  RMS_NORM  transformers' RMSNorm of x, or of x + residual (the residual add fused before
            it); the programs of the first column block also write x + residual to
            `residual_out`, the next layer's residual. Every program first reads the whole
            row once for its statistic: a few KiB from L2, against the tile of weight it
            streams.
  SILU_MUL  x is [M, 2K], gate then up (the packed gate_up projection): silu(gate) * up

Numerics are those of the kernels they replace (kernels/rms_norm.py, kernels/activation.py,
the same roundings to x's dtype at the same points) followed by an fp32-accumulated GEMM
rounded once, like cuBLAS's; only the summation order differs.

Whether this beats cuBLAS plus the separate kernel depends on the shape: a GEMV streams the
weight at 60-85% of the copy bandwidth (kernels/fp8_gemm.py measured the same loop), cuBLAS at
up to ~95% on large weights, so on Qwen3-8B's gate_up the saved launch may not pay for the
slower stream. `tune_gemv` (engine/models/layers.py) times the candidates on the model's own
weights, and the model uses a fused form only where it measured faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels.utils import gemm_output, has_pdl, num_sms

MAX_M = 2  # rows: each row's programs stream the whole weight again (L2 does not hold it)
NONE, RMS_NORM, SILU_MUL = 0, 1, 2


@triton.jit
def _gemv_kernel(
    x_ptr, res_ptr, res_out_ptr, gamma_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, N, K, eps,
    stride_xm, stride_rm, stride_om, stride_wn, stride_ym,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, REDUCE_EACH: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    first_block = tl.program_id(1) == 0
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    x_row = x_ptr + row * stride_xm
    r_row = res_ptr + row * stride_rm
    w_rows = w_ptr + rn[:, None] * stride_wn
    if PDL:  # the first weight tile (no kernel writes weights) while the kernel before finishes
        w_first = tl.load(w_rows + rk[None, :], mask=n_mask[:, None] & (rk < K)[None, :],
                          other=0.0)  # fmt: skip
        gdc_launch_dependents()  # the next GEMV may start its own first tile now
        gdc_wait()  # everything read after this, or written, comes after the kernel before
    inv_rms = 1.0
    if PROLOGUE == 1:  # the row's statistic first (and the residual sum, once)
        sumsq = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            k_mask = k < K
            xv = _row_input(x_row, r_row, k, k_mask, HAS_RESIDUAL)
            if HAS_RESIDUAL:
                if first_block:
                    tl.store(res_out_ptr + row * stride_om + k, xv, mask=k_mask)
            xf = xv.to(tl.float32)
            sumsq += xf * xf
        inv_rms = tl.rsqrt(tl.sum(sumsq, 0) / K + eps)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_n = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if PDL:
        xk = _gemv_input(x_row, r_row, gamma_ptr, rk, rk < K, K, inv_rms, PROLOGUE, HAS_RESIDUAL)
        if REDUCE_EACH:
            acc_n += tl.sum(w_first.to(tl.float32) * xk[None, :], axis=1)
        else:
            acc += w_first.to(tl.float32) * xk[None, :]
    for k0 in range(BLOCK_K if PDL else 0, K, BLOCK_K):
        k = k0 + rk
        k_mask = k < K
        xk = _gemv_input(x_row, r_row, gamma_ptr, k, k_mask, K, inv_rms, PROLOGUE,
                         HAS_RESIDUAL)  # fmt: skip
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if REDUCE_EACH:  # fewer registers: more programs per SM, more loads in flight
            acc_n += tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
        else:
            acc += w.to(tl.float32) * xk[None, :]
    if not REDUCE_EACH:
        acc_n = tl.sum(acc, axis=1)
    if HAS_SCALE:  # FP8 weight: its channel's scale, before the bias
        acc_n = acc_n * tl.load(scale_ptr + rn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc_n += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + rn, acc_n.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemv_input(x_row, r_row, gamma_ptr, k, k_mask, K, inv_rms, PROLOGUE: tl.constexpr,
                HAS_RESIDUAL: tl.constexpr):  # fmt: skip
    """The GEMV's input at columns k, in fp32: x, its RMSNorm, or silu(gate) * up."""
    if PROLOGUE == 2:  # silu(gate) * up, rounded as kernels/activation.py does
        gate = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + K + k, mask=k_mask, other=0.0)
        silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
        xk = (silu.to(tl.float32) * up.to(tl.float32)).to(up.dtype).to(tl.float32)
    elif PROLOGUE == 1:  # rounded as kernels/rms_norm.py does
        xv = _row_input(x_row, r_row, k, k_mask, HAS_RESIDUAL)
        normed = (xv.to(tl.float32) * inv_rms).to(xv.dtype).to(tl.float32)
        g = tl.load(gamma_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        xk = (g * normed).to(xv.dtype).to(tl.float32)
    else:
        xk = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)
    return xk


@triton.jit
def _row_input(x_row, r_row, k, k_mask, HAS_RESIDUAL: tl.constexpr):
    """x's slice, or (x + residual) rounded to x's dtype as the separate add would round it."""
    xv = tl.load(x_row + k, mask=k_mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_row + k, mask=k_mask, other=0.0)
        xv = (xv.to(tl.float32) + r.to(tl.float32)).to(xv.dtype)
    return xv


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # outputs per program
    block_k: int  # weight columns per tile
    num_warps: int = 4
    num_stages: int = 2
    reduce_each: bool = False

    @property
    def name(self) -> str:
        warps = f"/{self.num_warps}w" if self.num_warps != 4 else ""
        return f"{self.block_n}x{self.block_k}{warps}{' re' if self.reduce_each else ''}"


# What `tune_gemv` times: narrow tiles so small N still fills the GPU (Qwen3-0.6B's
# o_proj and down_proj have 1,024 outputs: 8 per program is 128 programs on 132 SMs), wide K
# tiles for many loads in flight.
CANDIDATES = (
    GemvConfig(16, 512),
    GemvConfig(8, 1024),
    GemvConfig(4, 2048),
    GemvConfig(4, 1024),
    GemvConfig(2, 2048),
    GemvConfig(8, 1024, reduce_each=True),
    GemvConfig(4, 2048, reduce_each=True),
    # (16 x 512 and 32 x 512 / 8 warps summed every tile never came within 1.3x of the best on
    # any projection of Qwen3-0.6B or 8B, H200 or H100: bench/results/fused_decode_gpu-2026-12-05-*.
    # Dropped: each candidate is compiled and timed at start-up.)
)


# Programmatic dependent launch (sm_90+): each GEMV starts as soon as the kernel before it has
# started all its programs, reads its first weight tile, and waits for that kernel's results
# only then, so a chain of short kernels overlaps its launches and its first loads with the
# tails of the kernels before. Measured on the H100 (bench/README.md, 2026-12-05): batch-1
# TPOT 1.085 -> 0.971 ms at Qwen3-0.6B, 5.775 -> 5.660 ms at 8B, tokens unchanged.
# bench/fused_decode_gpu times a layer's GEMV chain both ways, `bench.gpu_engine --variants
# bf16,no-pdl` the engine's step.
PDL = True


def use_pdl(device: torch.device) -> bool:
    return PDL and has_pdl(device)


def default_config(n: int, device: torch.device) -> GemvConfig:
    """The widest of 16/8/4/2 outputs per program that still gives two programs per SM."""
    for block_n in (16, 8, 4):
        if triton.cdiv(n, block_n) >= 2 * num_sms(device):
            return GemvConfig(block_n, 8192 // block_n)
    return GemvConfig(2, 2048)


def _launch(x, weight, bias, out, prologue, residual, residual_out, gamma, eps, config, scale):
    m = x.shape[0]
    n, k = weight.shape
    assert m <= MAX_M, f"the GEMV kernel is for at most {MAX_M} rows, got {m}"
    assert x.stride(1) == 1 and weight.stride(1) == 1
    if scale is None:
        assert weight.dtype == x.dtype, "a weight in x's dtype, or FP8 with its weight_scale"
    else:
        assert weight.dtype == torch.float8_e4m3fn, "weight_scale goes with an FP8 e4m3 weight"
        assert scale.dtype == torch.float32 and scale.numel() == n and scale.is_contiguous()
    out = gemm_output(x, n, bias, out)
    if m == 0:
        return out
    cfg = config or default_config(n, x.device)
    res = residual if residual is not None else x
    res_out = residual_out if residual_out is not None else x
    pdl = use_pdl(x.device)
    _gemv_kernel[(m, triton.cdiv(n, cfg.block_n))](
        x, res, res_out, gamma if gamma is not None else weight, weight,
        scale if scale is not None else weight, bias if bias is not None else weight, out, n, k,
        eps,
        x.stride(0), res.stride(0), res_out.stride(0), weight.stride(0), out.stride(0),
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_SCALE=scale is not None,
        HAS_BIAS=bias is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, REDUCE_EACH=cfg.reduce_each, PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return out


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= MAX_M) @ weight [N, K].T (+ bias) -> [M, N] in x's dtype.
    `weight_scale` (fp32, N): the weight is FP8 e4m3 and output n is scaled by it."""
    assert x.dim() == 2 and x.shape[1] == weight.shape[1], "x [M, K], weight [N, K]"
    return _launch(x, weight, bias, out, NONE, None, None, None, 0.0, config, weight_scale)


def rms_norm_gemv(
    x: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x [+ residual]) @ weight.T (+ bias). Returns (y, the new residual): x +
    residual in a new tensor (residual is None: x itself). The inputs are not written, so a
    CUDA graph may read them again."""
    assert x.dim() == 2 and x.shape[1] == weight.shape[1], "x [M, K], weight [N, K]"
    assert gamma.shape == (x.shape[1],) and gamma.dtype == x.dtype
    if residual is None:
        y = _launch(x, weight, bias, None, RMS_NORM, None, None, gamma, eps, config, weight_scale)
        return y, x
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
    residual_out = torch.empty_like(x)
    y = _launch(x, weight, bias, None, RMS_NORM, residual, residual_out, gamma, eps, config,
                weight_scale)  # fmt: skip
    return y, residual_out


def silu_mul_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """(silu(x[:, :K]) * x[:, K:]) @ weight [N, K].T (+ bias), x [M, 2K] -> [M, N]."""
    assert x.dim() == 2 and x.shape[1] == 2 * weight.shape[1], "x [M, 2K], weight [N, K]"
    return _launch(x, weight, bias, None, SILU_MUL, None, None, None, 0.0, config, weight_scale)
