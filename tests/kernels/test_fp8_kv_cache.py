"""`--kv-cache-dtype fp8`: the kernels store K/V into an FP8 e4m3 cache (scale 1.0, saturating at
+-448 as vLLM's conversion does) and the attention kernels read it as the queries' dtype.

Stores: the values are e4m3 numbers already (torch's cast of random data) plus some past the
range, so the stored bytes must equal torch's saturating cast exactly. Rounding a value that lies
between two e4m3 numbers is the hardware's cast, which these tests leave to the GPU: Triton's
interpreter gets it wrong where rounding carries into the exponent (126.0 -> 64.0 instead of
128.0; 31.9 -> 16.0), so random data would fail on CPU for the interpreter's sake. Reads: against
the torch reference over the same FP8 cache, as closely as over a 32-bit one (converting e4m3
up is exact)."""

from __future__ import annotations

import torch

from engine.attention import to_cache_dtype
from kernels import reference as ref
from kernels.kv_cache_write import kv_cache_write
from kernels.paged_decode_attention import DecodeConfig, paged_decode_attention
from kernels.prefill_attention import prefill_attention
from kernels.rotary import rotary_embedding
from tests.kernels.helpers import make_paged_kv, max_rel_err, packed_qkv, test_device

FP8 = torch.float8_e4m3fn
HEAD_DIM, BLOCK_SIZE, SCALE = 16, 4, 0.3


def e4m3_values(x: torch.Tensor, num_saturating: int = 5) -> torch.Tensor:
    """x rounded to e4m3 numbers (normals: tiny values raised to 2**-6), then a few entries set
    past the range (+-500, +-1e4), which must saturate to +-448."""
    x = torch.where(x.abs() < 2**-6, torch.full_like(x, 2**-6), x)
    x = x.to(FP8).float()
    flat = x.view(-1)
    flat[:num_saturating] = torch.tensor([500.0, -500.0, 1e4, -1e4, 449.0])[:num_saturating]
    return x


def assert_stored_as_fp8(stored: torch.Tensor, values: torch.Tensor) -> None:
    assert stored.dtype == FP8
    got = stored.float()
    assert torch.isfinite(got).all(), "an FP8 cache must saturate, not overflow to NaN"
    assert torch.equal(got, to_cache_dtype(values, FP8).float())
    big = values.abs() > 448
    assert big.any() and torch.equal(got[big], values[big].sign() * 448)


def test_kv_cache_write_saturates_into_an_fp8_cache():
    dev = test_device()
    cache = torch.zeros(6, 2, 2, BLOCK_SIZE, 2, HEAD_DIM, device=dev).to(FP8)
    _, k, v = packed_qkv(7, 4, 2, HEAD_DIM, torch.float32, dev)
    k, v = e4m3_values(k * 100), e4m3_values(v)
    slots = torch.tensor([13, 5, -1, 22, 6, -1, 23], dtype=torch.int64, device=dev)
    kv_cache_write(k, v, cache[:, 1], slots)
    keep = slots >= 0
    block, offset = slots[keep] // BLOCK_SIZE, slots[keep] % BLOCK_SIZE
    assert_stored_as_fp8(cache[:, 1][block, 0, offset], k[keep])
    assert_stored_as_fp8(cache[:, 1][block, 1, offset], v[keep])
    assert not cache[:, 0].float().any()  # the other layer untouched


def test_rotary_stores_k_and_v_into_an_fp8_cache():
    """At position 0 RoPE is the identity (cos 1, sin 0), so K reaches the store unchanged."""
    dev = test_device()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    cos_sin = ref.build_cos_sin_cache(inv_freq, 64, torch.float32).to(dev)
    positions = torch.zeros(4, dtype=torch.int64, device=dev)
    q, k, v = packed_qkv(4, 8, 2, HEAD_DIM, torch.float32, dev)
    k.copy_(e4m3_values(k * 100))
    v.copy_(e4m3_values(v))
    expect_k = k.clone()
    cache = torch.zeros(6, 2, 2, BLOCK_SIZE, 2, HEAD_DIM, device=dev).to(FP8)
    slots = torch.tensor([13, 5, 22, 7], dtype=torch.int64, device=dev)
    rotary_embedding(positions, q, k, cos_sin, v=v, kv_layer=cache[:, 1], slot_mapping=slots)
    assert torch.equal(k, expect_k)
    block, offset = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    assert_stored_as_fp8(cache[:, 1][block, 0, offset], expect_k)
    assert_stored_as_fp8(cache[:, 1][block, 1, offset], v)


def test_decode_and_prefill_attention_read_an_fp8_cache():
    dev = test_device()
    seq_lens = [1, 7, 33, 20]
    _, kv32, tables = make_paged_kv(seq_lens, 2, HEAD_DIM, BLOCK_SIZE, device=dev)
    kv8 = kv32.to(FP8)
    assert kv8.float().ne(kv32).any()  # rounding happened: the test reads real FP8 values
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    q, _, _ = packed_qkv(len(seq_lens), 4, 2, HEAD_DIM, torch.float32, dev)
    for splits in (1, 3):
        out = paged_decode_attention(
            q, kv8, tables, lens, SCALE, max_seq_len=33, config=DecodeConfig(16, splits)
        )
        assert max_rel_err(out, ref.decode_attention(q, kv8, tables, lens, SCALE)) <= 1e-5
    # f16_dots (the default under bf16 queries) rounds q to fp16: close to the reference, and
    # not equal to it (the fp16 path ran).
    for splits in (1, 3):
        cfg = DecodeConfig(16, splits, f16_dots=True)
        out = paged_decode_attention(q, kv8, tables, lens, SCALE, max_seq_len=33, config=cfg)
        err = max_rel_err(out, ref.decode_attention(q, kv8, tables, lens, SCALE))
        assert 1e-6 < err <= 2e-3, err
        assert out.dtype == q.dtype
    # Prefill: the last 1, 3, 9 and 20 tokens of each sequence are new.
    q_lens = [1, 3, 9, 20]
    qsl = torch.tensor([0, 1, 4, 13, 33], dtype=torch.int32, device=dev)
    q, _, _ = packed_qkv(sum(q_lens), 4, 2, HEAD_DIM, torch.float32, dev, seed=1)
    out = prefill_attention(q, kv8, tables, qsl, lens, SCALE, max_query_len=20)
    expect = ref.paged_attention(q, kv8, tables, qsl, lens, SCALE)
    assert max_rel_err(out, expect) <= 1e-5
    # And FP8 is what was read: against the 32-bit cache the answer moves.
    assert max_rel_err(out, ref.paged_attention(q, kv32, tables, qsl, lens, SCALE)) > 1e-4
