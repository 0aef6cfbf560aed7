"""FP8 weights at decode batch sizes: y = x @ (w_fp8 * w_scale).T (+ bias), x in 16 bits.

`--quantization fp8` keeps every decoder projection's weight in e4m3 with one scale per output
channel (engine/quantization.py). At prefill sizes `torch._scaled_mm` runs it on the FP8 tensor
cores, after quantizing the activations per token. At decode sizes (a few rows) that path is
slower than bf16 (H200, Qwen3-8B batch 1: 7.6 vs 4.8 ms a step): per layer it adds the
activation quantization's launches (abs, amax, divide, clamp, cast) to a GEMM that the
tensor cores cannot fill at M=1. This kernel is the weight-only form for those sizes: it streams
the FP8 weight (half of bf16's bytes, which is what a decode step is bound by), converts it to
x's dtype in registers (exact: every e4m3 number is a bf16 number), multiplies by x in 16 bits
with fp32 accumulation, and applies the channel scale and bias in fp32 before the one rounding
to x's dtype. The activations stay unquantized, so the result is closer to the unquantized
layer than the W8A8 path, not further.

Two kernels:
- up to GEMV_MAX_M rows, kernels/gemv.py's GEMV (its FP8 form, no prologue): one program per
  (row, BLOCK_N outputs), elementwise products of the weight tile and x's slice accumulated in
  fp32 registers and summed once at the end, or across K at every tile (`reduce_each`: fewer
  registers, more programs per SM); no tensor cores, so no shared-memory staging of a 1-row
  operand. (H200: the tensor-core tile at one row reached ~40% of the copy bandwidth, about
  bf16 cuBLAS's time for half the bytes; the GEMV 60-85%.)
- `_fp8_gemm_kernel` (tensor cores, one [BLOCK_M, BLOCK_N] tile) above that, up to MAX_M rows: each
  weight byte is read once. Over the whole of K (SPLIT_K 1) the grid is N / BLOCK_N programs,
  so BLOCK_N must be small to cover the GPU, and then every program re-reads all of x: at 32
  rows x's reads outweigh the weight's (H200, down_proj 12288 -> 4096: 46 us against a 12 us
  floor). With SPLIT_K > 1 the programs also split K, each writing an fp32 partial sum, and
  `_fp8_gemm_reduce_kernel` adds the partials, applies scale and bias, and rounds once: wide tiles
  (few reads of x) and a full grid, for one more launch.
`Fp8GemmConfig` holds a tensor-core tile choice, kernels/gemv.py's `GemvConfig` a GEMV one;
`choose_tiles` times the candidates of both kernels on the GPU once per weight shape and M tile
(engine/quantization.py `tune_fp8_small_m`, bench/fp8_gpu.py), and `default_config` /
`default_gemv_config` are the heuristics used before or without that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.gemv import GemvConfig, gemv
from kernels.utils import gemm_output, graph_time_us, num_sms

FP8 = torch.float8_e4m3fn
MAX_M = 32  # the most rows these kernels are for: decode batches (x's tile fits shared memory)
# Up to this many rows, the GEMV (kernels/gemv.py). H200, Qwen3-8B's four projections
# (bench/fp8_gpu.py): 59 us a layer at 1 row (bf16 cuBLAS: 102), 94 at 2, 162 at 4, where the
# tensor-core kernel took ~98 at 8 rows: each further row re-reads the weight (L2 does not
# catch it).
GEMV_MAX_M = 2


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, part_ptr, M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + rn[None, :] * stride_wn  # w is [N, K]: the tile is read as [BLOCK_K, BLOCK_N]
    k_span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K  # whole K tiles per split
    k_begin = pid_k * k_span
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, tl.minimum(k_begin + k_span, K), BLOCK_K):
        k = k0 + rk
        k_mask = k < K
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    mn_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:  # an fp32 partial [SPLIT_K, M, N]; _fp8_gemm_reduce_kernel finishes
        part = part_ptr + (pid_k * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
        tl.store(part, acc, mask=mn_mask)
    else:
        scale = tl.load(scale_ptr + rn, mask=n_mask, other=0.0)
        acc = acc * scale[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mn_mask)


@triton.jit
def _fp8_gemm_reduce_kernel(
    part_ptr, scale_ptr, bias_ptr, y_ptr, M, N, stride_ym,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(1).to(tl.int64)
    rn = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    n_mask = rn < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + row) * N + rn, mask=n_mask, other=0.0)
    y = acc * tl.load(scale_ptr + rn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # the tensor-core kernel's programs along K (1: no partials, no reduce)


# What `choose_config` times on the GPU. GEMV: BLOCK_N x BLOCK_K fp32 accumulators per program
# (16 x 512 over 128 threads: 64 registers each); wide K tiles for many loads in flight.
GEMV_CANDIDATES = (
    GemvConfig(16, 512, 4, 2),
    GemvConfig(8, 1024, 4, 2),
    GemvConfig(32, 256, 4, 2),
    GemvConfig(16, 1024, 8, 2),
    GemvConfig(4, 2048, 4, 2),
    # (8-warp tiles summed once at the end, (32, 512), (8, 2048), (64, 256) and (4, 4096), never
    # won on the H200: gate_up 31.8 against 31.7 us at best. Dropped from start-up tuning.)
    # Summed every tile: registers for more programs per SM.
    GemvConfig(16, 512, 4, 2, reduce_each=True),
    GemvConfig(8, 1024, 4, 2, reduce_each=True),
    GemvConfig(32, 512, 8, 2, reduce_each=True),
    GemvConfig(16, 1024, 8, 2, reduce_each=True),
    GemvConfig(4, 2048, 4, 2, reduce_each=True),
)
# Tensor cores: narrow tiles for small N (a full grid), wider ones and deeper K tiles where N
# alone fills the GPU, and wide tiles split along K (fewer reads of x, a full grid anyway).
CANDIDATES = (
    Fp8GemmConfig(16, 256, 4, 4),
    Fp8GemmConfig(16, 512, 4, 3),
    Fp8GemmConfig(32, 256, 4, 4),
    Fp8GemmConfig(32, 512, 4, 3),
    Fp8GemmConfig(64, 256, 4, 3),
    Fp8GemmConfig(64, 128, 4, 4),
    Fp8GemmConfig(64, 256, 4, 3, split_k=4),
    Fp8GemmConfig(64, 256, 4, 3, split_k=8),
    Fp8GemmConfig(128, 128, 4, 3, split_k=4),
    Fp8GemmConfig(128, 128, 8, 3, split_k=8),
    Fp8GemmConfig(32, 256, 4, 4, split_k=4),
)
REDUCE_BLOCK = 512  # outputs per program of `_fp8_gemm_reduce_kernel`
Tile = Fp8GemmConfig | GemvConfig  # a tile of either kernel


def default_gemv_config(n: int, device: torch.device) -> GemvConfig:
    """16 outputs per program, or 8 where that leaves fewer than two programs per SM."""
    block_n = 16 if triton.cdiv(n, 16) >= 2 * num_sms(device) else 8
    return GemvConfig(block_n, 512 if block_n == 16 else 1024, 4, 2)


def default_config(n: int, device: torch.device) -> Fp8GemmConfig:
    """The widest tile whose grid still has two programs per SM (weights are read once either
    way; a wider tile only saves loads of x), else the narrowest."""
    for block_n in (64, 32):
        if triton.cdiv(n, block_n) >= 2 * num_sms(device):
            return Fp8GemmConfig(block_n, 256, 4, 3 if block_n == 64 else 4)
    return Fp8GemmConfig(16, 512, 4, 3)


def fp8_weight_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: Fp8GemmConfig | None = None,
    gemv_config: GemvConfig | None = None,
    config_m32: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32, M <= MAX_M) times e4m3 `weight` [N, K] with fp32
    `weight_scale` (N values, per output channel) -> [M, N] in x's dtype. `gemv_config` tiles
    kernels/gemv.py's GEMV (M <= GEMV_MAX_M), `config` the tensor-core kernel up to 16 rows (one
    M tile of 16), `config_m32` above that (one M tile of 32; `config` when not given)."""
    assert x.dim() == 2 and weight.dim() == 2 and weight.dtype == FP8
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k, f"x has {k} columns, the weight {weight.shape[1]}"
    assert m <= MAX_M, f"fp8_weight_gemm is for at most {MAX_M} rows, got {m}"
    assert x.stride(1) == 1 and weight.stride(1) == 1
    scale = weight_scale.reshape(-1)
    assert scale.numel() == n and scale.dtype == torch.float32 and scale.is_contiguous()
    out = gemm_output(x, n, bias, out)
    if m == 0:
        return out
    key = tile_keyword(m)
    if key == "gemv_config":
        cfg = gemv_config or default_gemv_config(n, x.device)
        return gemv(x, weight, bias, out=out, config=cfg, weight_scale=scale)
    block_m = 16 if key == "config" else MAX_M
    cfg = (config_m32 if key == "config_m32" else None) or config or default_config(n, x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32: unused by 16-bit dots
    split_k = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    # The partials (graph-safe: a captured allocation is the graph's own memory).
    part = (
        torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    )
    b = bias if bias is not None else scale
    _fp8_gemm_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m), split_k)](
        x, weight, scale, b, out, part, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SPLIT_K=split_k, DOT_PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split_k > 1:
        _fp8_gemm_reduce_kernel[(triton.cdiv(n, REDUCE_BLOCK), m)](
            part, scale, b, out, m, n, out.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK=REDUCE_BLOCK,
        )  # fmt: skip
    return out


def tile_keyword(m: int) -> str:
    """The `fp8_weight_gemm` argument whose tile runs m rows: the GEMV's up to GEMV_MAX_M, then
    the tensor-core kernel's 16-row M tile up to 16 rows, its 32-row tile above."""
    return "gemv_config" if m <= GEMV_MAX_M else "config" if m <= 16 else "config_m32"


def choose_config(
    weight: torch.Tensor, weight_scale: torch.Tensor, rows: int = 1
) -> tuple[Tile, dict[Tile, float]]:
    """CUDA: the fastest candidate tile for this weight at `rows` rows (bf16 input): of
    `GEMV_CANDIDATES` up to GEMV_MAX_M rows, else of `CANDIDATES`, in GPU time
    (`graph_time_us`). Returns (it, {config: microseconds})."""
    x = torch.randn(rows, weight.shape[1], device=weight.device, dtype=torch.bfloat16)
    out = torch.empty(rows, weight.shape[0], device=weight.device, dtype=torch.bfloat16)
    key = tile_keyword(rows)
    times = {}
    for cfg in GEMV_CANDIDATES if key == "gemv_config" else CANDIDATES:
        kwargs = {key: cfg}
        times[cfg] = graph_time_us(
            lambda kw=kwargs: fp8_weight_gemm(x, weight, weight_scale, out=out, **kw)
        )
    return min(times, key=times.get), times


def choose_tiles(
    weight: torch.Tensor, weight_scale: torch.Tensor
) -> tuple[dict[str, Tile], dict[str, dict[Tile, float]]]:
    """CUDA: both kernels' fastest tiles for this weight, as `fp8_weight_gemm`'s keyword
    arguments: the GEMV timed at one row, the tensor-core kernel at 16 and at 32 rows (its two
    M tiles). Returns (those arguments, {argument: {config: microseconds}})."""
    tiles, times = {}, {}
    for key, rows in (("gemv_config", 1), ("config", 16), ("config_m32", MAX_M)):
        tiles[key], times[key] = choose_config(weight, weight_scale, rows)
    return tiles, times
