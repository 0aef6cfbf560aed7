"""The batch-1 GEMV kernels (kernels/gemv.py) against the separate ops they fold together.

Reference: the torch path of the model (kernels/reference.py's RMSNorm and SiLU-and-mul, then
x @ w.T), computed in float64 on the same rounded inputs, so in fp32 the only error allowed is the
kernel's accumulation order (1e-5: a wrong norm, residual or activation is off by far more).
In bf16 the bound is the roundings'; the new residual must equal the separate add bit
for bit (bf16: on the GPU; Triton's interpreter truncates where the GPU rounds).
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference as ref
from kernels.gemv import CANDIDATES, MAX_M, GemvConfig, gemv, rms_norm_gemv, silu_mul_gemv
from kernels.utils import is_interpreting
from tests.kernels.helpers import max_rel_err, test_device

EPS = 1e-6
# K not a multiple of any tile's K, N not a multiple of any tile's N: the masks are exercised.
K, N = 200, 37
TILES = [GemvConfig(16, 64), GemvConfig(4, 128, reduce_each=True), GemvConfig(2, 256)]


def _inputs(m: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    dev = test_device()
    x = torch.randn(m, k, generator=gen).to(dtype).to(dev)
    w = (torch.randn(N, k, generator=gen) / k**0.5).to(dtype).to(dev)
    w[3] *= 40.0  # outputs of different ranges
    bias = torch.randn(N, generator=gen).to(dtype).to(dev)
    return x, w, bias


def _matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return y if bias is None else y + bias.double()


def _tol(dtype: torch.dtype) -> float:
    # bf16: a statistic summed in another order flips a normed input by one ulp now and then,
    # and the 40x output row turns that into ~1e-2 of the largest output.
    return 1e-5 if dtype == torch.float32 else 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, MAX_M])
@pytest.mark.parametrize("cfg", TILES, ids=str)
def test_gemv_matches_matmul(dtype, m, cfg):
    x, w, bias = _inputs(m, K, dtype)
    for b in (None, bias):
        out = gemv(x, w, b, config=cfg)
        assert out.shape == (m, N) and out.dtype == dtype
        assert max_rel_err(out, _matmul(x, w, b)) <= _tol(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_gemv_matches_norm_then_matmul(dtype, with_residual):
    x, w, bias = _inputs(MAX_M, K, dtype)
    dev = x.device
    gamma = (1.0 + 0.1 * torch.randn(K, generator=torch.Generator().manual_seed(1))).to(dtype)
    gamma = gamma.to(dev)
    residual = torch.randn(MAX_M, K, generator=torch.Generator().manual_seed(2)).to(dtype).to(dev)
    x_before, res_before = x.clone(), residual.clone()
    if with_residual:
        normed, expect_res = ref.fused_add_rms_norm(x.clone(), residual.clone(), gamma, EPS)
    else:
        normed, expect_res = ref.rms_norm(x, gamma, EPS), x
    for cfg in TILES:
        y, new_res = rms_norm_gemv(x, gamma, EPS, w, bias, residual if with_residual else None,
                                   config=cfg)  # fmt: skip
        assert max_rel_err(y, _matmul(normed, w, bias)) <= _tol(dtype), cfg
        if dtype == torch.float32 or not is_interpreting():
            assert torch.equal(new_res, expect_res), cfg
        else:  # the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest
            torch.testing.assert_close(new_res, expect_res, rtol=2**-7, atol=0)
    # Inputs are read, never written: a CUDA graph replays them.
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_gemv_matches_activation_then_matmul(dtype):
    x, w, bias = _inputs(MAX_M, 2 * K, dtype)
    w = w[:, :K].contiguous()
    act = ref.silu_and_mul(x)
    for cfg in TILES:
        for b in (None, bias):
            out = silu_mul_gemv(x, w, b, config=cfg)
            assert max_rel_err(out, _matmul(act, w, b)) <= _tol(dtype), cfg


def test_more_rows_than_the_kernel_serves_is_refused():
    x, w, _ = _inputs(MAX_M + 1, K, torch.float32)
    with pytest.raises(AssertionError, match="at most"):
        gemv(x, w)


def test_candidates_are_distinct():
    assert len(set(CANDIDATES)) == len(CANDIDATES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_weight_with_channel_scales(dtype):
    """`--quantization fp8`: an e4m3 weight with per-output-channel scales, each prologue,
    against the weight-only reference (x @ w_fp8.T, scaled per channel, then the bias)."""
    from engine.quantization import fp8_weight_only_reference, quantize_rows

    x, w, bias = _inputs(MAX_M, 2 * K, dtype)
    w_q, scale = quantize_rows(w[:, :K].float())  # row 3's 40x range gets its own scale
    scale = scale.reshape(-1).contiguous()
    gamma = (1.0 + 0.1 * torch.randn(K, generator=torch.Generator().manual_seed(1))).to(x)
    x_k = x[:, :K].contiguous()

    def expect(inp):  # on the same rounded input
        return fp8_weight_only_reference(inp.double(), w_q, scale.double(), bias.double())

    for cfg in TILES:
        assert max_rel_err(gemv(x_k, w_q, bias, config=cfg, weight_scale=scale),
                           expect(x_k)) <= _tol(dtype), cfg  # fmt: skip
        y, _ = rms_norm_gemv(x_k, gamma, EPS, w_q, bias, config=cfg, weight_scale=scale)
        assert max_rel_err(y, expect(ref.rms_norm(x_k, gamma, EPS))) <= _tol(dtype), cfg
        out = silu_mul_gemv(x, w_q, bias, config=cfg, weight_scale=scale)
        assert max_rel_err(out, expect(ref.silu_and_mul(x))) <= _tol(dtype), cfg
    with pytest.raises(AssertionError, match="FP8"):
        gemv(x_k, w_q, bias)  # an FP8 weight without its scales
