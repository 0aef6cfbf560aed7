"""Shared builders for kernel tests: a paged KV cache with shuffled blocks, error metrics.

Tiny tests run on CPU in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); with
TRITON_INTERPRET=0 on a CUDA machine the same tests run compiled on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from kernels.utils import is_interpreting


def test_device() -> torch.device:
    """cpu under the interpreter, else cuda (the kernels cannot run compiled on CPU)."""
    if is_interpreting():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("kernels need TRITON_INTERPRET=1 or a CUDA device")
    return torch.device("cuda")


test_device.__test__ = False  # a helper, not a test

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or is_interpreting(),
    reason="needs CUDA and TRITON_INTERPRET=0 (tests/conftest.py defaults it to 1)",
)


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute error relative to the reference's largest magnitude."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def norm_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||: the bf16-vs-fp32 metric (elementwise rounding averages out)."""
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    num_layers: int = 2,
    spare_blocks: int = 3,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_cache, kv_layer, block_tables): a whole-model cache filled with noise, the strided
    view of its last layer, and int32 block tables of shuffled (non-monotonic) block ids that
    never use the null block 0, padded with 0 and one spare column."""
    gen = torch.Generator().manual_seed(seed)  # block ids
    dev_gen = torch.Generator(device).manual_seed(seed)  # values, made where they live
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return kv_cache, kv_cache[:, num_layers - 1], tables.to(device)


def packed_qkv(
    num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype, device, seed=0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model makes them: strided views of one packed qkv projection."""
    gen = torch.Generator(device).manual_seed(seed)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen, device=device).to(dtype)
    q, k, v = qkv.split(
        [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    return (
        q.view(num_tokens, num_q_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )
