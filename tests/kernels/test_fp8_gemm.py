"""The weight-only FP8 GEMM (kernels/fp8_gemm.py) against torch's arithmetic on the same e4m3
weight, and `Fp8Linear` choosing it at decode sizes.

Reference: x @ (w_fp8.float() * scale).T (+ bias) in float64 on the unrounded inputs: converting
e4m3 up is exact, so the only error allowed is the kernel's fp32 accumulation and the final
rounding to x's dtype. The tensor-core kernel (more than GEMV_MAX_M rows) takes 16-bit
activations on the GPU only: Triton's interpreter computes bf16 `tl.dot`s wrongly (numpy has
no bf16; a 16 x 16 product came out ~1e10 off). The GEMV kernel has no dot: bf16 everywhere."""

from __future__ import annotations

import pytest
import torch

from engine.quantization import (
    Fp8Linear,
    fp8_linear_reference,
    fp8_weight_only_reference,
    quantize_rows,
)
from kernels import fp8_gemm
from kernels.fp8_gemm import (
    CANDIDATES,
    GEMV_CANDIDATES,
    GEMV_MAX_M,
    MAX_M,
    Fp8GemmConfig,
    default_config,
    default_gemv_config,
    fp8_weight_gemm,
)
from kernels.utils import is_interpreting
from tests.kernels.helpers import max_rel_err, norm_rel_err, test_device

BF16_DOTS = [] if is_interpreting() else [torch.bfloat16]


def _weight(n: int, k: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w[1] *= 50.0  # channels of different ranges: each scale must land on its own column
    q, scale = quantize_rows(w)
    return q.to(device), scale.reshape(-1).to(device)


def _reference(x, q, scale, bias) -> torch.Tensor:
    y = (x.double() @ q.double().t()) * scale.double()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize(
    "m, dtype",
    [
        (1, torch.float32),
        (1, torch.bfloat16),
        (GEMV_MAX_M, torch.bfloat16),
        (GEMV_MAX_M, torch.float32),
    ]
    + [(m, torch.float32) for m in (GEMV_MAX_M + 1, 16, 17, MAX_M)]
    + [(m, torch.bfloat16) for m in (GEMV_MAX_M + 1, MAX_M) for _ in BF16_DOTS],
)
def test_weight_only_gemm_equals_torch_on_the_same_fp8_weight(m, dtype):
    """N and K not multiples of any tile (masked edges in both), rows 1..MAX_M (the GEMV up to
    GEMV_MAX_M, then one tensor-core M tile of 16 or 32), with and without bias, 32- and 16-bit
    activations."""
    dev = test_device()
    n, k = 40, 300
    q, scale = _weight(n, k, 0, dev)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(dev, dtype)
    for b in (None, bias):
        out = fp8_weight_gemm(x, q, scale, b)
        assert out.shape == (m, n) and out.dtype == dtype
        ref = _reference(x, q, scale, b)
        # bf16: one final rounding, which Triton's interpreter truncates (a whole ulp).
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        assert max_rel_err(out, ref) <= tol, (m, dtype, b is not None)


@pytest.mark.parametrize(
    "config, m",
    [(c, GEMV_MAX_M) for c in GEMV_CANDIDATES] + [(c, GEMV_MAX_M + 1) for c in CANDIDATES],
    ids=lambda v: f"{v.block_n}x{v.block_k}" if hasattr(v, "block_n") else f"m{v}",
)
def test_every_candidate_tile_computes_the_same_product(config, m):
    """What `choose_config` may pick on the GPU: each tiling of each kernel, with K longer than
    its K tile (several iterations) and N over several programs, writing into a given `out` (a
    CUDA graph's static buffer) without allocating."""
    dev = test_device()
    n, k = 3 * config.block_n + 5, 2 * config.block_k + 7
    q, scale = _weight(n, k, 3, dev)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)).to(dev)
    out = torch.full((m, n), float("nan"), device=dev)
    key = "gemv_config" if m <= GEMV_MAX_M else "config"
    got = fp8_weight_gemm(x, q, scale, out=out, **{key: config})
    assert got.data_ptr() == out.data_ptr()
    assert max_rel_err(out, _reference(x, q, scale, None)) <= 1e-6


def test_strided_rows_and_the_limits():
    dev = test_device()
    q, scale = _weight(24, 64, 5, dev)
    wide = torch.randn(4, 100, generator=torch.Generator().manual_seed(6)).to(dev)
    x = wide[:, :64]  # rows 100 apart
    assert max_rel_err(fp8_weight_gemm(x, q, scale), _reference(x, q, scale, None)) <= 1e-6
    assert fp8_weight_gemm(x[:0], q, scale).shape == (0, 24)
    with pytest.raises(AssertionError, match=f"at most {MAX_M} rows"):
        fp8_weight_gemm(torch.randn(MAX_M + 1, 64, device=dev), q, scale)
    with pytest.raises(AssertionError, match="x has 63 columns"):
        fp8_weight_gemm(x[:, :63], q, scale)


def test_default_tiles_fill_the_grid():
    """Two programs per SM (132 off-GPU) where N allows; Qwen3-8B's o/down (N=4096) need the
    narrowest tile for that, its gate_up (N=24,576) can take the widest."""
    cpu = torch.device("cpu")
    assert default_config(4096, cpu).block_n == 16
    assert default_config(24576, cpu).block_n == 64
    assert default_config(12288, cpu).block_n == 32
    assert default_gemv_config(4096, cpu).block_n == 8
    assert default_gemv_config(6144, cpu).block_n == 16


def test_fp8_linear_is_weight_only_up_to_max_m_then_w8a8():
    """At decode sizes the activations are not quantized (a row with one large entry keeps its
    small ones), above them the per-token W8A8 path runs: the two give measurably different
    results on such rows, and each equals its own reference exactly."""
    dev = test_device()
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(7))
    w[:, 0] = 0.0  # the large entry below sets each row's activation scale, adds nothing
    lin = Fp8Linear(w.to(dev), None)
    x = torch.randn(MAX_M + 1, 256, generator=torch.Generator().manual_seed(8)).to(dev)
    x[:, 0] = 3000.0  # the other entries land near e4m3's bottom: a few % off, some flushed
    x_q, x_scale = quantize_rows(x)
    w8a8 = fp8_linear_reference(x_q, x_scale, lin.weight, lin.weight_scale, None)
    weight_only = fp8_weight_only_reference(x, lin.weight, lin.weight_scale, None)
    assert norm_rel_err(w8a8, weight_only) > 1e-2  # the two forms are distinguishable here
    small = lin(x[:MAX_M])
    # On the GPU: fp32 sums in another order, and _scaled_mm writes bf16.
    tol, w8a8_tol = (1e-6, 1e-6) if dev.type == "cpu" else (1e-5, 2**-8)
    assert max_rel_err(small, weight_only[:MAX_M]) <= tol
    assert norm_rel_err(small, w8a8[:MAX_M]) > 1e-2
    assert max_rel_err(lin(x), w8a8) <= w8a8_tol


@pytest.mark.parametrize("m", [GEMV_MAX_M + 1, 17, MAX_M])
def test_split_k_partials_sum_to_the_same_product(m, monkeypatch):
    """A tile split along K: 10 K tiles over 4 splits (3, 3, 3, 1 tiles: uneven, the last
    short and masked), fp32 partials added by `_fp8_gemm_reduce_kernel`, scale and bias applied once
    there. `config_m32` tiles only above 16 rows, `config` up to 16: the reduce runs exactly
    when the split tile is the one the rows select."""
    dev = test_device()
    n, k = 45, 9 * 32 + 5
    q, scale = _weight(n, k, 9, dev)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(10)).to(dev)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(11)).to(dev)
    launches = []
    real = fp8_gemm._fp8_gemm_reduce_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(fp8_gemm, "_fp8_gemm_reduce_kernel", Counting())
    split = Fp8GemmConfig(16, 32, 4, 2, split_k=4)
    whole = Fp8GemmConfig(16, 32, 4, 2)
    for b in (None, bias):
        launches.clear()
        out = torch.full((m, n), float("nan"), device=dev)
        fp8_weight_gemm(x, q, scale, b, out=out, config=whole, config_m32=split)
        assert max_rel_err(out, _reference(x, q, scale, b)) <= 1e-6
        assert len(launches) == (1 if m > 16 else 0)
        launches.clear()
        fp8_weight_gemm(x, q, scale, b, out=out, config=split)  # no config_m32: `config`
        assert max_rel_err(out, _reference(x, q, scale, b)) <= 1e-6
        assert len(launches) == 1
