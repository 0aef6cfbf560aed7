"""SiLU-and-mul vs the torch reference (fp32)."""

from __future__ import annotations

import torch

from kernels import reference as ref
from kernels.activation import silu_and_mul
from tests.kernels.helpers import max_rel_err, test_device


def test_matches_reference():
    dev = test_device()
    x = torch.randn(3, 2 * 40, device=dev) * 4  # I = 40: not a power of two
    assert max_rel_err(silu_and_mul(x), ref.silu_and_mul(x)) <= 1e-5
