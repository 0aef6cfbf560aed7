"""Prefill role + decode role in one process: the KV computed by one engine and copied into the
other's blocks gives exactly the tokens a colocated engine produces (greedy and seeded)."""

from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, SamplingParams
from engine.request import Request


def _prefill_then_decode(p: LLM, d: LLM, rid: str, prompt: list[int], params: SamplingParams):
    p_params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
    p_req = Request(rid, prompt, p_params, p.eos_token_ids, hold_blocks=True)
    d_req = Request(rid, prompt, params, d.eos_token_ids)
    alloc = d.engine.allocate_for_remote_prefill(d_req)
    assert alloc is not None
    p.engine.add_request(p_req)
    first = None
    while p.engine.has_unfinished_requests():
        for out in p.engine.step():
            first = out
    assert first.finish_reason == "length" and p_req.is_finished
    # "Transfer": P's blocks for prompt blocks not cached at D -> D's blocks.
    bs = p.config.cache.block_size
    p_blocks = p.engine.kv.get_block_ids(rid)
    first_block = alloc.num_hit_tokens // bs
    num_prompt_blocks = -(-len(prompt) // bs)
    for i in range(first_block, num_prompt_blocks):
        d.engine.runner.kv_cache[alloc.block_ids[i]] = p.engine.runner.kv_cache[p_blocks[i]]
    p.engine.release_blocks(p_req)
    out = d.engine.add_remote_prefilled(
        d_req, first.new_token_ids[0], None, p_req.num_cached_tokens
    )
    tokens = list(out.new_token_ids)
    while d.engine.has_unfinished_requests():
        for o in d.engine.step():
            tokens += o.new_token_ids
    return tokens, alloc


@pytest.mark.parametrize("seed", [None, 17])
def test_disaggregated_equals_colocated(tiny_model_path, seed):
    kwargs = dict(max_model_len=256, num_gpu_blocks_override=64)
    p, d, ref = (LLM(str(tiny_model_path), **kwargs) for _ in range(3))
    params = SamplingParams(
        temperature=0.0 if seed is None else 0.9, seed=seed, max_tokens=10, ignore_eos=True
    )
    prompts = [list(range(3, 40)), list(range(3, 40)) + [9, 9, 9], [5, 6, 7]]
    for i, prompt in enumerate(prompts):
        tokens, alloc = _prefill_then_decode(p, d, f"r{i}", prompt, params)
        expected = ref.generate([prompt], params)[0].outputs[0].token_ids
        assert tokens == expected
        if i == 1:  # shares 2 full blocks with prompt 0, cached at D: not written again
            assert alloc.num_hit_tokens == 32
    for llm in (p, d):
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_usable_blocks


def test_quarantine_keeps_blocks_until_released(tiny_qwen3_path):
    d = LLM(str(tiny_qwen3_path), max_model_len=64, num_gpu_blocks_override=6)
    req = Request("q", list(range(3, 50)), SamplingParams(max_tokens=4), d.eos_token_ids)
    alloc = d.engine.allocate_for_remote_prefill(req)
    assert len(alloc.block_ids) == 3
    key = d.engine.quarantine_blocks(req)
    assert d.engine.kv.num_free_blocks == 2
    # Quarantined blocks are never handed out: a request needing 4 blocks is refused.
    big = Request("big", list(range(3, 63)), SamplingParams(max_tokens=4), d.eos_token_ids)
    assert d.engine.allocate_for_remote_prefill(big) is None
    d.engine.release_quarantine(key)
    assert d.engine.kv.num_free_blocks == 5
