"""Prefill attention over a paged prefix vs the torch reference (fp32, interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference as ref
from kernels.prefill_attention import prefill_attention
from tests.kernels.helpers import make_paged_kv, max_rel_err, packed_qkv, test_device

# (cached prefix, new tokens): a fresh prompt spanning two query tiles, a chunk after a prefix
# that ends mid-block, a decode row mixed in, and a chunk whose context ends mid-block.
SEQS = [(0, 21), (13, 5), (6, 1), (8, 11)]
HEAD_DIM, BLOCK_SIZE, SCALE = 16, 4, 0.3


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 2), (8, 1)])
def test_matches_reference(num_q_heads, num_kv_heads):
    dev = test_device()
    lens = [p + n for p, n in SEQS]
    _, kv_layer, tables = make_paged_kv(lens, num_kv_heads, HEAD_DIM, BLOCK_SIZE, device=dev)
    qsl = torch.tensor([0] + [n for _, n in SEQS], device=dev).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    num_tokens = int(qsl[-1])
    q, _, _ = packed_qkv(num_tokens, num_q_heads, num_kv_heads, HEAD_DIM, torch.float32, dev)
    max_query_len = max(n for _, n in SEQS)
    out = prefill_attention(q, kv_layer, tables, qsl, seq_lens, SCALE, max_query_len)
    expect = ref.paged_attention(q, kv_layer, tables, qsl, seq_lens, SCALE)
    assert max_rel_err(out, expect) <= 1e-5
