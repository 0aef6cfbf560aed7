"""GPU tests: skipped cleanly without CUDA, and under the CPU interpreter."""

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
# `pytestmark = GPU_ONLY` in a module: marked gpu, skipped unless the kernels run on a GPU.
GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ON_GPU, reason="needs CUDA with TRITON_INTERPRET=0"),
]
