"""TritonPagedAttention honours engine/attention.py's contract: same outputs and same cache
as TorchPagedAttention, and the whole engine decodes the same greedy tokens with it."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import AttentionMetadata, TorchPagedAttention
from engine.attention_triton import TritonPagedAttention
from tests.kernels.helpers import (
    gpu,
    make_paged_kv,
    max_rel_err,
    norm_rel_err,
    packed_qkv,
    test_device,
)

BLOCK_SIZE, HEAD_DIM = 4, 16


def _meta(
    computed: list[int], new: list[int], tables: torch.Tensor, block_size: int = BLOCK_SIZE
) -> AttentionMetadata:
    """Metadata as the model runner builds it: slots of the new tokens in each block table."""
    slots, qsl = [], [0]
    for s, (c, n) in enumerate(zip(computed, new)):
        row = tables[s].tolist()
        slots += [row[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
        qsl.append(qsl[-1] + n)
    seq_lens = [c + n for c, n in zip(computed, new)]
    dev = tables.device
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=tables,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        block_size=block_size,
        max_query_len=max(new),
        max_seq_len=max(seq_lens),
    )


@pytest.mark.parametrize(
    "computed,new",
    [([0, 9, 5], [6, 3, 1]), ([5, 12, 30], [1, 1, 1]), ([5, 70, 0, 9, 12], [1, 1, 6, 3, 1])],
    ids=["mixed", "decode", "decodes_first"],
)
def test_matches_torch_backend(computed, new, monkeypatch):
    """decodes_first: the scheduler's mixed order; its two leading rows take the decode
    kernel (one over 71 tokens: two 64-token partitions, the split-K path) and the rest, a
    trailing one-token row included, the prefill kernel."""
    import engine.attention_triton as backend_module

    decode_rows = []
    decode = backend_module.paged_decode_attention

    def spy(q, *args, **kwargs):
        decode_rows.append(q.shape[0])
        return decode(q, *args, **kwargs)

    monkeypatch.setattr(backend_module, "paged_decode_attention", spy)
    dev = test_device()
    lens = [c + n for c, n in zip(computed, new)]
    cache, kv_layer, tables = make_paged_kv(lens, 2, HEAD_DIM, BLOCK_SIZE, device=dev)
    meta = _meta(computed, new, tables)
    q, k, v = packed_qkv(sum(new), 4, 2, HEAD_DIM, torch.float32, dev)
    expect_cache = cache.clone()
    expect = TorchPagedAttention().forward(q, k, v, expect_cache[:, 1], meta, 0.25)
    out = TritonPagedAttention().forward(q, k, v, kv_layer, meta, 0.25)
    assert torch.equal(cache, expect_cache)
    assert max_rel_err(out, expect) <= 1e-5
    leading_decodes = next((i for i, n in enumerate(new) if n != 1), len(new))
    assert meta.num_decodes == leading_decodes
    assert decode_rows == ([leading_decodes] if leading_decodes else [])


@gpu
def test_a_mixed_batch_at_qwen3_8b_shapes_matches_torch_backend():
    """bf16, 32 q / 8 KV heads of 128, blocks of 16: 96 decodes at 100-1,500 tokens (the split-K
    decode path) ahead of a 512-token chunk after 700 cached tokens and a fresh 300-token
    prompt, as the scheduler orders a serving step."""
    gen = torch.Generator().manual_seed(0)
    computed = torch.randint(100, 1500, (96,), generator=gen).tolist() + [700, 0]
    new = [1] * 96 + [512, 300]
    lens = [c + n for c, n in zip(computed, new)]
    cache, kv_layer, tables = make_paged_kv(lens, 8, 128, 16, torch.bfloat16, "cuda")
    meta = _meta(computed, new, tables, block_size=16)
    q, k, v = packed_qkv(sum(new), 32, 8, 128, torch.bfloat16, "cuda")
    expect = TorchPagedAttention().forward(q, k, v, cache.clone()[:, 1], meta, 128**-0.5)
    backend = TritonPagedAttention(static_max_seq_len=4096)
    out = backend.forward(q, k, v, kv_layer, meta, 128**-0.5)
    assert meta.num_decodes == 96
    assert norm_rel_err(out, expect) <= 1e-2


def _torch_path_greedy(path, **llm_kwargs):
    """Prompts of 21 and 35 tokens, greedy params, and the CPU torch path's tokens."""
    prompts = [list(range(3, 24)), list(range(100, 135))]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm = LLM(str(path), **llm_kwargs)
    expect = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return prompts, params, expect


def test_engine_greedy_tokens_match_torch_backend(tiny_qwen3_path):
    """Prompts of 21 and 35 tokens: full blocks to share, tails mid-block; the second Triton
    run hits the prefix cache, so the prefill kernel also runs over a cached prefix. A static
    max length of 4096 (as for CUDA graphs) makes decode take the split-K path."""
    if test_device().type != "cpu":
        pytest.skip("the engine picks its own device; this is the CPU interpreter check")
    prompts, params, expect = _torch_path_greedy(tiny_qwen3_path)
    llm = LLM(str(tiny_qwen3_path))
    backend = TritonPagedAttention(static_max_seq_len=4096)
    calls = []
    forward = backend.forward
    backend.forward = lambda *a: calls.append(a[4].max_query_len) or forward(*a)
    llm.engine.runner.attn_backend = backend
    for _ in range(2):  # fresh, then prefix hits
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expect
    assert 1 in calls and max(calls) > 1, "both kernels ran"


@pytest.mark.parametrize("rope_in_attention", [True, False])
def test_engine_fused_model_path_matches_torch_path(
    tiny_qwen3_path, monkeypatch, rope_in_attention
):
    """The CUDA model path (Triton RMSNorm + residual, q/k-norm + RoPE with the KV store fused
    in, SiLU-and-mul, Triton attention) run under the interpreter decodes the torch path's
    greedy tokens, prefix hits included; decode steps with the RoPE work and the K/V store
    inside the attention kernel (`attend_rope`), or in the RoPE kernel before it."""
    if test_device().type != "cpu":
        pytest.skip("the engine picks its own device; this is the CPU interpreter check")
    import engine.attention_triton as attention_triton

    monkeypatch.setattr(attention_triton, "ROPE_IN_ATTENTION", rope_in_attention)
    fused_steps = []
    attend_rope = TritonPagedAttention.attend_rope

    def recorded(self, q, kv_layer, meta, *args, **kwargs):
        out = attend_rope(self, q, kv_layer, meta, *args, **kwargs)
        fused_steps.append((meta.max_query_len, out is not None))
        return out

    monkeypatch.setattr(TritonPagedAttention, "attend_rope", recorded)
    prompts, params, expect = _torch_path_greedy(tiny_qwen3_path)
    llm = LLM(str(tiny_qwen3_path))
    llm.engine.runner.attn_backend = TritonPagedAttention(static_max_seq_len=4096)
    llm.engine.runner.model.use_fused_kernels = True
    for _ in range(2):  # fresh, then prefix hits
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expect
    # decode steps only (one query token per sequence), every one of them when on
    assert fused_steps == [(1, True)] * len(fused_steps)
    assert bool(fused_steps) == rope_in_attention


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_engine_batch1_gemv_path_matches_torch_path(tiny_qwen3_path, monkeypatch, quantization):
    """`--fused-decode`, with every projection on kernels/gemv.py's fused forms at decode (as
    `tune_gemv` sets them where they pay on the GPU): the norms, the residual add and the
    SiLU-mul folded into the GEMVs still decode the torch path's greedy tokens at batch 1, and
    batch 2 (not on them) is unchanged. With FP8 weights the GEMVs read e4m3 and scale each
    channel, as the weight-only reference does."""
    if test_device().type != "cpu":
        pytest.skip("the engine picks its own device; this is the CPU interpreter check")
    import kernels.gemv as gemv_module
    from engine.models.layers import PROJECTIONS, getattr_path

    prompts, params, expect = _torch_path_greedy(tiny_qwen3_path, quantization=quantization)
    llm = LLM(str(tiny_qwen3_path), quantization=quantization)
    llm.engine.runner.attn_backend = TritonPagedAttention(static_max_seq_len=4096)
    model = llm.engine.runner.model
    model.use_fused_kernels = True
    for layer in model.layers:
        for name in PROJECTIONS:
            getattr_path(layer, name).gemv_config = gemv_module.GemvConfig(8, 32)
        layer.gemv = True
    launched, launched_scales = [], []
    launch = gemv_module._launch

    def recorded(*a):
        launched.append((a[0].shape[0], a[4]))
        launched_scales.append(a[10])
        return launch(*a)

    monkeypatch.setattr(gemv_module, "_launch", recorded)
    if quantization is None:  # batch 2 does not reach the GEMVs: once is enough
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expect
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params)] == expect[:1]
    prologues = {gemv_module.NONE, gemv_module.RMS_NORM, gemv_module.SILU_MUL}
    assert {p for m, p in launched if m == 1} == prologues
    assert all(m == 1 for m, _ in launched)
    # a[10]: the weight scales, given exactly when the weights are FP8
    assert {a is not None for a in launched_scales} == {quantization == "fp8"}
