"""RMSNorm and fused residual-add RMSNorm vs the torch reference (fp32)."""

from __future__ import annotations

import torch

from kernels import reference as ref
from kernels.rms_norm import fused_add_rms_norm, rms_norm
from tests.kernels.helpers import max_rel_err, test_device

EPS = 1e-6


def test_rms_norm_strided_rows():
    dev = test_device()
    x = torch.randn(5, 80, device=dev)[:, :48]  # hidden 48: not a power of two; rows strided
    w = torch.randn(48, device=dev)
    assert max_rel_err(rms_norm(x, w, EPS), ref.rms_norm(x, w, EPS)) <= 1e-5


def test_fused_add_rms_norm_in_place():
    dev = test_device()
    x, residual, w = torch.randn(5, 48, device=dev), torch.randn(5, 48, device=dev), torch.randn(48)
    expect_out, expect_res = ref.fused_add_rms_norm(x, residual, w.to(dev), EPS)
    out, res = fused_add_rms_norm(x, residual, w.to(dev), EPS)
    assert out.data_ptr() == x.data_ptr() and res.data_ptr() == residual.data_ptr()
    assert max_rel_err(res, expect_res) <= 1e-6
    assert max_rel_err(out, expect_out) <= 1e-5
