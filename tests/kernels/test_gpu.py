"""Every kernel at real shapes in bf16 vs an fp32 reference (norm-relative error <= 1e-2).

GPU only: run with `TRITON_INTERPRET=0 pytest -m gpu tests/kernels` (tests/conftest.py turns
the interpreter on by default). Shapes: Qwen3-8B-like, 32 q / 8 kv heads, head_dim 128,
block size 16, contexts up to 4096.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference as ref
from kernels.activation import silu_and_mul
from kernels.kv_cache_write import kv_cache_write
from kernels.paged_decode_attention import DecodeConfig, paged_decode_attention
from kernels.prefill_attention import prefill_attention
from kernels.rms_norm import fused_add_rms_norm, rms_norm
from kernels.rotary import rotary_embedding
from tests.kernels.helpers import gpu, make_paged_kv, norm_rel_err, packed_qkv

pytestmark = [pytest.mark.gpu, gpu]
HQ, HKV, D, BS, BF16, TOL = 32, 8, 128, 16, torch.bfloat16, 1e-2


@pytest.mark.parametrize("num_splits", [None, 1, 3, 64])
def test_decode_attention(num_splits):
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 4097, (32,), generator=gen).tolist()
    lens[0] = 4096
    _, kv_layer, tables = make_paged_kv(lens, HKV, D, BS, BF16, "cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q, _, _ = packed_qkv(32, HQ, HKV, D, BF16, "cuda")
    cfg = DecodeConfig(num_splits=num_splits)
    out = paged_decode_attention(q, kv_layer, tables, seq_lens, D**-0.5, max_seq_len=4096,
                                 config=cfg)  # fmt: skip
    expect = ref.decode_attention(q.float(), kv_layer.float(), tables, seq_lens, D**-0.5)
    assert norm_rel_err(out, expect) <= TOL


def test_prefill_attention():
    seqs = [(0, 1024), (512, 512), (3000, 1000), (100, 1), (17, 333)]
    lens = [p + n for p, n in seqs]
    _, kv_layer, tables = make_paged_kv(lens, HKV, D, BS, BF16, "cuda")
    qsl = torch.tensor([0] + [n for _, n in seqs], device="cuda").cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q, _, _ = packed_qkv(int(qsl[-1]), HQ, HKV, D, BF16, "cuda")
    out = prefill_attention(q, kv_layer, tables, qsl, seq_lens, D**-0.5, max(n for _, n in seqs))
    expect = ref.paged_attention(q.float(), kv_layer.float(), tables, qsl, seq_lens, D**-0.5)
    assert norm_rel_err(out, expect) <= TOL


def test_kv_cache_write():
    cache = torch.randn(600, 2, 2, BS, HKV, D, device="cuda").to(BF16)
    expect = cache.clone()
    _, k, v = packed_qkv(4096, HQ, HKV, D, BF16, "cuda")
    slots = torch.randperm(600 * BS, device="cuda")[:4096]
    slots[::7] = -1
    kv_cache_write(k, v, cache[:, 1], slots)
    ref.kv_cache_write(expect[:, 1], k, v, slots)
    assert torch.equal(cache, expect)


def test_rms_norm():
    x = torch.randn(4096, 4096, device="cuda").to(BF16)
    residual = torch.randn_like(x)
    w = (torch.rand(4096, device="cuda") + 0.5).to(BF16)
    assert norm_rel_err(rms_norm(x, w, 1e-6), ref.rms_norm(x.float(), w.float(), 1e-6)) <= TOL
    expect_out, expect_res = ref.fused_add_rms_norm(x, residual, w, 1e-6)  # same-dtype oracle
    out, res = fused_add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(res, expect_res)
    torch.testing.assert_close(out, expect_out)


@pytest.mark.parametrize("with_norm", [False, True])
def test_rotary(with_norm):
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.float, device="cuda") / D))
    cache = ref.build_cos_sin_cache(inv_freq, 8192, BF16)
    positions = torch.randint(0, 8192, (4096,), device="cuda")
    q, k, _ = packed_qkv(4096, HQ, HKV, D, BF16, "cuda")
    qw = (torch.rand(D, device="cuda") + 0.5).to(BF16) if with_norm else None
    kw = (torch.rand(D, device="cuda") + 0.5).to(BF16) if with_norm else None
    f32 = [t.float() if t is not None else None for t in (q, k, cache, qw, kw)]
    expect_q, expect_k = ref.rotary(f32[0], f32[1], positions, f32[2], f32[3], f32[4])
    rotary_embedding(positions, q, k, cache, qw, kw)
    assert norm_rel_err(q, expect_q) <= TOL and norm_rel_err(k, expect_k) <= TOL


def test_rotary_fused_kv_write():
    """Real shapes, bf16: the cache gets exactly the rotated k (as left in place) and v."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.float, device="cuda") / D))
    cache = ref.build_cos_sin_cache(inv_freq, 8192, BF16)
    t = 4096
    positions = torch.randint(0, 8192, (t,), device="cuda")
    q, k, v = packed_qkv(t, HQ, HKV, D, BF16, "cuda")
    qw = (torch.rand(D, device="cuda") + 0.5).to(BF16)
    kw = (torch.rand(D, device="cuda") + 0.5).to(BF16)
    kv = torch.zeros(t // 16 + 2, 2, 2, 16, HKV, D, dtype=BF16, device="cuda")
    slots = torch.randperm(t, device="cuda") + 16  # shuffled, never the null block
    slots[::97] = -1
    rotary_embedding(positions, q, k, cache, qw, kw, v=v, kv_layer=kv[:, 1], slot_mapping=slots)
    expect = torch.zeros_like(kv)
    ref.kv_cache_write(expect[:, 1], k, v, slots)
    assert torch.equal(kv, expect)


def test_silu_and_mul():
    x = torch.randn(4096, 2 * 12288, device="cuda").to(BF16)
    assert norm_rel_err(silu_and_mul(x), ref.silu_and_mul(x.float())) <= TOL
    torch.testing.assert_close(silu_and_mul(x), ref.silu_and_mul(x))  # torch's own bf16 path
