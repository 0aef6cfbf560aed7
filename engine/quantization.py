"""FP8 weights (`--quantization fp8`): a bf16/fp16 checkpoint quantized when it loads.

As vLLM's online FP8 does, every linear layer of the decoder (qkv, o, gate_up, down) keeps its
weight in float8 e4m3 and the embeddings, norms and LM head stay in the model's dtype. Scales:

- weights per output channel: w[n, :] ~ w_fp8[n, :] * w_scale[n], w_scale = amax(|w[n, :]|) / 448
  (one channel's outlier costs only that channel);
- activations per token, computed at run time: x[m, :] ~ x_fp8[m, :] * x_scale[m] (dynamic, so
  there is no calibration step, and one token with large activations does not flatten the
  resolution of the others in its batch).

y = (x_fp8 @ w_fp8.T) * x_scale * w_scale^T (+ bias). On CUDA that is one `torch._scaled_mm`
with row-wise scales (cuBLASLt/CUTLASS FP8 GEMM, Hopper and later); elsewhere the same
arithmetic runs dequantized in float32, which is the reference the GPU path is tested against.

Decode sizes (at most `kernels.fp8_gemm.MAX_M` rows) take the weight-only form instead:
y = x @ (w_fp8 * w_scale).T with x unquantized, on CUDA by the Triton kernel of
kernels/fp8_gemm.py, elsewhere dequantized in float32. Half the weight bytes of bf16: batch-1
decode, which streams every weight per token, is bound by exactly those bytes, and quantizing a
few rows of activations costs more launches than their GEMM (the W8A8 path at batch 1 was 1.57 x
slower than bf16 on the H200).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.fp8_gemm import MAX_M as WEIGHT_ONLY_MAX_M
from kernels.fp8_gemm import Tile, choose_tiles, fp8_weight_gemm
from kernels.fp8_quant import FP8, FP8_MAX, MIN_SCALE, quantize_rows_fp8

QUANTIZATION_METHODS = ("fp8",)


def check_quantization(method: str | None, dtype: torch.dtype) -> None:
    """vLLM's wording for an unknown method; FP8 needs a 16-bit model dtype to quantize from."""
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"Unknown quantization method: {method}. Must be one of {list(QUANTIZATION_METHODS)}."
        )
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quantization={method!r} quantizes a float model; got dtype {dtype}.")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3: (x_fp8 [R, C], scale [R, 1] float32) with x ~ x_fp8 * scale."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


class Fp8Linear(nn.Module):
    """A linear layer with an e4m3 weight, per-output-channel weight scales and per-token
    dynamic activation scales (weight-only at decode sizes); output in the input's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_rows(weight)
        # _scaled_mm wants the weight column-major ([K, N] as a transposed [N, K]) and the
        # scales as fp32 [1, N]: stored that way once, not per call.
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", scale.reshape(1, -1).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # The weight-only kernels' tiles as fp8_weight_gemm's arguments (`tune_fp8_small_m`
        # on CUDA at start-up; empty: their defaults).
        self.tiles: dict[str, Tile] = {}
        # Up to GEMV_ROWS rows, kernels/gemv.py with this tile and the op before it folded in,
        # as for a 16-bit `Linear` (`tune_gemv`, `--fused-decode`).
        self.gemv_config = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv_config is not None and x.dim() == 2:
            from engine.models.layers import GEMV_ROWS  # (engine.models imports this module)
            from kernels.gemv import gemv

            if 0 < x.shape[0] <= GEMV_ROWS:
                return gemv(x, self.weight, self.bias, config=self.gemv_config,
                            weight_scale=self.weight_scale)  # fmt: skip
        if x.dim() == 2 and x.shape[0] <= WEIGHT_ONLY_MAX_M:
            if x.is_cuda:
                x = x if x.stride(1) == 1 else x.contiguous()
                return fp8_weight_gemm(x, self.weight, self.weight_scale, self.bias, **self.tiles)
            return fp8_weight_only_reference(x, self.weight, self.weight_scale, self.bias).to(
                x.dtype
            )
        return self.w8a8(x)

    def w8a8(self, x: torch.Tensor) -> torch.Tensor:
        """The prefill-size path at any size: activations quantized per token (on CUDA in
        one kernel: torch's six passes made FP8 prefill slower than bf16)."""
        if x.is_cuda:  # row-wise scaled FP8 GEMMs write bf16
            x_q, x_scale = quantize_rows_fp8(x if x.stride(1) == 1 else x.contiguous())
            y = torch._scaled_mm(
                x_q,
                self.weight.t(),
                scale_a=x_scale,
                scale_b=self.weight_scale,
                bias=None if self.bias is None else self.bias.to(torch.bfloat16),
                out_dtype=torch.bfloat16,
            )
            return y if x.dtype == torch.bfloat16 else y.to(x.dtype)
        x_q, x_scale = quantize_rows(x)
        return fp8_linear_reference(x_q, x_scale, self.weight, self.weight_scale, self.bias).to(
            x.dtype
        )


def fp8_linear_reference(x_q, x_scale, w_q, w_scale, bias) -> torch.Tensor:
    """The arithmetic of `Fp8Linear`, dequantized in float32."""
    y = (x_q.float() @ w_q.float().t()) * x_scale * w_scale
    return y if bias is None else y + bias.float()


def fp8_weight_only_reference(x, w_q, w_scale, bias) -> torch.Tensor:
    """The weight-only form (decode sizes), dequantized in float32: x is not quantized."""
    y = (x.float() @ w_q.float().t()) * w_scale.reshape(1, -1)
    return y if bias is None else y + bias.float()


@torch.inference_mode()
def tune_fp8_small_m(model: nn.Module) -> dict[str, dict]:
    """CUDA: for each distinct FP8 weight shape, time the weight-only kernels' candidate tiles
    (the GEMV at one row, the tensor-core kernel at 16 and at 32 rows) and give every layer of
    that shape the fastest. Returns the timings (us)."""
    by_shape: dict[tuple[int, int], list[Fp8Linear]] = {}
    for mod in model.modules():
        if isinstance(mod, Fp8Linear):
            by_shape.setdefault(tuple(mod.weight.shape), []).append(mod)
    report = {}
    for (n, k), mods in by_shape.items():
        tiles, times = choose_tiles(mods[0].weight, mods[0].weight_scale)
        for mod in mods:
            mod.tiles = tiles
        report[f"{k}->{n}"] = {
            key: {"best": str(tiles[key]), "us": {str(c): round(t, 2) for c, t in ts.items()}}
            for key, ts in times.items()
        }
    return report


@torch.inference_mode()
def quantize_linears_fp8(model: nn.Module) -> int:
    """Replace every `engine.models.layers.Linear` in `model` by an `Fp8Linear` (the decoder's
    projections; the embeddings and LM head are not `Linear`s). Returns how many."""
    from engine.models.layers import Linear

    targets = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, Linear)
    ]
    for parent, name in targets:  # each 16-bit weight is freed as soon as its FP8 copy exists
        child = getattr(parent, name)
        setattr(parent, name, Fp8Linear(child.weight, child.bias))
    return len(targets)
