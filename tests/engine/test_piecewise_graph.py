"""Piecewise graphs (engine/piecewise_graph.py): the same hidden states and K/V as the fused
forward, padding rows that store nothing, and the engine's greedy tokens unchanged. On the CPU
the pieces run uncaptured under the Triton interpreter; with TRITON_INTERPRET=0 on a GPU the
first check captures and replays them (the engine's own capture: tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.attention_triton import TritonPagedAttention
from engine.piecewise_graph import MAX_CAPTURE_TOKENS, PiecewiseGraphs, capture_token_sizes
from tests.engine.test_attention_triton import _meta, _torch_path_greedy
from tests.kernels.helpers import test_device


def _fused_runner(path, **kw):
    llm = LLM(str(path), **kw)
    runner = llm.engine.runner
    runner.attn_backend = TritonPagedAttention(static_max_seq_len=4096)
    runner.model.use_fused_kernels = True
    return llm, runner


def _batch(runner, computed: list[int], new: list[int], dev: torch.device):
    """A mixed batch as the scheduler orders it (decodes first) over disjoint blocks 1..;
    returns (input ids, positions, slots, metadata)."""
    bs = runner.block_size
    tables, next_block = [], 1
    for c, n in zip(computed, new):
        nb = -(-(c + n) // bs)
        tables.append(list(range(next_block, next_block + nb)) + [0] * (8 - nb))
        next_block += nb
    meta = _meta(computed, new, torch.tensor(tables, dtype=torch.int32, device=dev), bs)
    pos = [p for c, n in zip(computed, new) for p in range(c, c + n)]
    ids = [(7 * p + 3) % 100 for p in pos]
    return ids, pos, meta.slot_mapping.tolist(), meta


def test_capture_sizes_cover_the_budget_up_to_the_cap():
    assert capture_token_sizes(512)[-1] == 512 and capture_token_sizes(500)[-1] == 500
    sizes = capture_token_sizes(8192)
    assert sizes == sorted(set(sizes)) and sizes[0] == 8
    assert sizes[-1] == MAX_CAPTURE_TOKENS  # larger steps run eagerly
    for small, large in zip(sizes, sizes[1:]):
        assert large <= max(small * 1.5, 64), "padding past a third of a step over 64 tokens"


@pytest.mark.parametrize("quantization", [None, "fp8"])
@torch.inference_mode()
def test_pieces_match_the_fused_forward_and_padding_rows_store_nothing(
    tiny_qwen3_path, quantization
):
    """Two decodes, a chunk after a cached prefix and a fresh prompt: 11 tokens padded to 16.
    The K/V cache starts as noise: every slot but the 11 real ones must come out untouched
    (a padding row given slot 0 instead of -1 would overwrite the null block). FP8 weights:
    their linear layers write qkv through a copy, not the GEMM's `out`."""
    kw = dict(max_model_len=256, num_gpu_blocks_override=64, quantization=quantization)
    _, runner = _fused_runner(tiny_qwen3_path, dtype="float32", enforce_eager=True, **kw)
    on_gpu = runner.kv_cache.is_cuda
    dev = runner.kv_cache.device
    model, backend = runner.model, runner.attn_backend
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(runner.kv_cache.shape, generator=gen).to(runner.kv_cache)
    ids, pos, slots, meta = _batch(runner, computed=[5, 12, 9, 0], new=[1, 1, 3, 6], dev=dev)
    n = len(ids)

    runner.kv_cache.copy_(noise)
    ids_t, pos_t = torch.tensor(ids, device=dev), torch.tensor(pos, device=dev)
    expect = model(ids_t, pos_t, runner.kv_cache, meta, backend).clone()
    expect_kv = runner.kv_cache.clone()

    runner.kv_cache.copy_(noise)
    pieces = PiecewiseGraphs(model, runner.kv_cache, backend, [8, 16], use_graphs=on_gpu)
    pieces.capture()  # pads with slot -1: stores nothing
    t = pieces.bucket(n)
    assert t == 16 and pieces.bucket(17) is None
    pad = [0] * (t - n)
    inputs = torch.tensor(ids + pad + pos + pad + slots + [-1] * (t - n), device=dev)
    hidden = pieces.run(inputs, n, meta)

    assert hidden.shape == expect.shape
    torch.testing.assert_close(hidden, expect, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runner.kv_cache, expect_kv, rtol=1e-4, atol=1e-4)
    written = torch.zeros(noise.shape[0] * runner.block_size, dtype=torch.bool, device=dev)
    written[slots] = True
    untouched = ~written.view(noise.shape[0], runner.block_size)
    per_slot = (runner.kv_cache != noise).transpose(1, 3).reshape(*untouched.shape, -1)
    assert not per_slot[untouched].any(), "a padding row stored K/V"
    assert per_slot[~untouched].any(dim=-1).all(), "every real token stored its K/V"


def test_engine_greedy_tokens_unchanged_with_pieces(tiny_qwen3_path):
    """Through the engine with 16-token steps: prompt chunks, mixed steps and eager decode
    steps all run as pieces padded to a captured size; the greedy tokens are the torch
    path's and the padding rows left the null block (block 0) as it was: zeros."""
    if test_device().type != "cpu":
        pytest.skip("the engine picks its own device; this is the CPU interpreter check")
    prompts, params, expect = _torch_path_greedy(tiny_qwen3_path)
    llm, runner = _fused_runner(tiny_qwen3_path, max_num_batched_tokens=16, max_num_seqs=2)
    runner.piecewise = PiecewiseGraphs(
        runner.model, runner.kv_cache, runner.attn_backend, [8, 16], use_graphs=False
    )
    steps = []
    run = runner.piecewise.run
    runner.piecewise.run = lambda inputs, n, meta: (
        steps.append((len(inputs) // 3, n)) or run(inputs, n, meta)
    )
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == expect
    assert not runner.kv_cache[0].any(), "a padding row stored K/V in the null block"
    assert all(t in (8, 16) and n <= t for t, n in steps)
    assert any(n < t for t, n in steps), "some steps were padded"
    assert (16, 16) in steps and any(n == 2 for _, n in steps), "prefill and decode steps"
