"""The one-launch per-row FP8 quantization against torch's (`engine.quantization.quantize_rows`,
the W8A8 path's reference): the same scales and the same e4m3 bytes."""

from __future__ import annotations

import pytest
import torch

from engine.quantization import quantize_rows
from kernels.fp8_quant import quantize_rows_fp8
from tests.kernels.helpers import test_device


def _assert_same(x: torch.Tensor) -> None:
    q, scale = quantize_rows_fp8(x)
    q_ref, scale_ref = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (x.shape[0], 1)
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_torch_bytes(dtype):
    dev = test_device()
    g = torch.Generator().manual_seed(0)
    # 3,000 columns: more than one block, the last one partial; rows of very different
    # magnitudes (per-row scales), an all-zero row (the minimum scale), an outlier row.
    x = torch.randn(6, 3000, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 1.0, 5e3])[:, None]
    x[4, 17] = -900.0
    _assert_same(x.to(dtype).to(dev))


def test_strided_rows_and_empty():
    dev = test_device()
    g = torch.Generator().manual_seed(1)
    base = (torch.randn(5, 96, generator=g) * 3).to(torch.bfloat16).to(dev)
    _assert_same(base[:, 10:74])  # rows 96 apart, 64 columns each
    q, scale = quantize_rows_fp8(base[:0])
    assert q.shape == (0, 96) and scale.shape == (0, 1)


def test_ties_subnormals_and_signed_zero():
    """A row whose scale is exactly 1 (amax 448): midpoints between e4m3 neighbours go to the
    even one, the subnormal grid (2^-9) rounds the same way, a value just under 448 rounds up
    to it, and -0.0 keeps its sign."""
    dev = test_device()
    s = 2.0**-9
    values = [448.0, 1.0625, 1.1875, -1.0625, 447.0, 0.5 * s, 1.5 * s, 2.5 * s, -1.5 * s]
    values += [0.015625, 0.0146484375, 2.0**-10 * 31, -0.0, 0.0, 240.0, 232.0, -13.0]
    _assert_same(torch.tensor([values], dtype=torch.float32, device=dev))
