"""Greedy output of the engine equals transformers' generate, token for token (fp32, CPU)."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _random_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 2000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _assert_matches_hf(path, outs, max_tokens) -> None:
    for o in outs:
        assert o.outputs[0].token_ids == hf_greedy(path, o.prompt_token_ids, max_tokens), (
            f"prompt of {len(o.prompt_token_ids)} tokens diverged from transformers"
        )


def _assert_idle(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_usable_blocks, "blocks leaked"
    assert not kv.req_to_blocks and not llm.engine.has_unfinished_requests()


def test_one_prompt(tiny_model_path):
    llm = LLM(str(tiny_model_path), max_model_len=256)
    out = llm.generate("The quick brown fox jumps over the lazy dog", GREEDY)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    assert out.outputs[0].finish_reason == "length"
    _assert_matches_hf(tiny_model_path, [out], GREEDY.max_tokens)
    _assert_idle(llm)


def test_sixteen_mixed_prompts_in_one_batch(tiny_model_path):
    llm = LLM(str(tiny_model_path), max_model_len=256)
    prompts = _random_prompts(16, 1, 70, seed=1)
    outs = llm.generate(prompts, GREEDY)
    assert [o.prompt_token_ids for o in outs] == prompts
    _assert_matches_hf(tiny_model_path, outs, GREEDY.max_tokens)
    _assert_idle(llm)


def test_chunked_prefill(tiny_model_path):
    # A 13-token budget splits every long prompt into chunks and mixes them with decodes.
    llm = LLM(str(tiny_model_path), max_model_len=256, max_num_batched_tokens=13)
    prompts = _random_prompts(4, 30, 60, seed=2)
    steps = []
    orig = llm.engine.scheduler.schedule

    def spy():
        out = orig()
        steps.append(out.num_scheduled_tokens)
        return out

    llm.engine.scheduler.schedule = spy
    outs = llm.generate(prompts, GREEDY)
    assert max(steps) <= 13
    _assert_matches_hf(tiny_model_path, outs, GREEDY.max_tokens)
    _assert_idle(llm)


def test_preemption_by_recompute(tiny_model_path):
    # 13 usable blocks of 16 tokens: 6 requests growing to ~40 tokens each cannot all fit.
    llm = LLM(
        str(tiny_model_path),
        max_model_len=128,
        num_gpu_blocks_override=14,
        enable_prefix_caching=False,
    )
    prompts = _random_prompts(6, 20, 30, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_matches_hf(tiny_model_path, outs, 16)
    _assert_idle(llm)


def test_prefix_cache_hits(tiny_model_path):
    llm = LLM(str(tiny_model_path), max_model_len=256)
    shared = _random_prompts(1, 80, 80, seed=4)[0]
    first = llm.generate([shared + [5, 6, 7]], GREEDY)
    stats = llm.engine.kv.prefix_stats
    assert stats.hits == 0
    tails = _random_prompts(3, 3, 9, seed=5)
    outs = llm.generate([shared + t for t in tails], GREEDY)
    # Each of the 3 prompts reuses the 5 full blocks (80 tokens) of the shared prefix.
    assert stats.hits == 3 * 80
    assert all(o.num_cached_tokens == 80 for o in outs)
    _assert_matches_hf(tiny_model_path, first + outs, GREEDY.max_tokens)
    _assert_idle(llm)


def test_prefix_hit_needs_every_block_before_it(tiny_model_path):
    """Blocks a and c are both cached, but c only after x: `a + c + b` reuses a's 16 tokens and
    recomputes c (its KV after a differs from its KV after x), so it still equals transformers."""
    llm = LLM(str(tiny_model_path), max_model_len=256)
    a, c, b, x, y = _random_prompts(5, 16, 16, seed=9)  # one 16-token block each
    warm = llm.generate([a + y + [7], x + c + [7]], GREEDY)
    stats = llm.engine.kv.prefix_stats
    assert stats.hits == 0
    (out,) = llm.generate([a + c + b + [7]], GREEDY)
    assert out.num_cached_tokens == 16 and stats.hits == 16
    _assert_matches_hf(tiny_model_path, [*warm, out], GREEDY.max_tokens)
    _assert_idle(llm)


def test_prefix_cache_with_preemption_and_chunking(tiny_qwen3_path):
    llm = LLM(
        str(tiny_qwen3_path),
        max_model_len=128,
        num_gpu_blocks_override=20,
        max_num_batched_tokens=24,
    )
    shared = _random_prompts(1, 40, 40, seed=6)[0]
    prompts = [shared + t for t in _random_prompts(8, 5, 20, seed=7)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.engine.kv.prefix_stats.hits > 0
    _assert_matches_hf(tiny_qwen3_path, outs, 20)
    _assert_idle(llm)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_policies_give_same_tokens(tiny_llama_path, policy):
    llm = LLM(
        str(tiny_llama_path),
        max_model_len=128,
        num_gpu_blocks_override=12,
        scheduling_policy=policy,
        max_num_seqs=3,
    )
    prompts = _random_prompts(5, 10, 30, seed=8)
    outs = llm.generate(prompts, GREEDY, priority=[4, 3, 2, 1, 0] if policy == "priority" else None)
    _assert_matches_hf(tiny_llama_path, outs, GREEDY.max_tokens)
    _assert_idle(llm)


def test_priority_without_priority_scheduling_is_refused(tiny_llama_path):
    """vLLM refuses a non-zero priority unless the scheduler orders by it: FCFS would accept it
    and ignore it. Priority 0 (the default) is fine."""
    llm = LLM(str(tiny_llama_path), max_model_len=128, num_gpu_blocks_override=12)
    prompts = _random_prompts(2, 10, 30, seed=8)
    with pytest.raises(ValueError, match="Got priority 2 but Priority scheduling is not enabled"):
        llm.generate(prompts, GREEDY, priority=[0, 2])
    assert len(llm.generate(prompts, GREEDY, priority=[0, 0])) == 2
    _assert_idle(llm)


def test_stop_token_text_is_not_output(tiny_qwen3_path):
    """vLLM: a request stopped by a token (EOS or stop_token_ids) does not show that token's
    text, even with skip_special_tokens off, unless include_stop_str_in_output."""
    llm = LLM(str(tiny_qwen3_path), max_model_len=256)
    prompt = {"prompt_token_ids": [11, 12, 13, 14, 15]}
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    stop_id = free[0].outputs[0].token_ids[3]
    for include in (False, True):
        params = SamplingParams(
            temperature=0,
            max_tokens=8,
            stop_token_ids=[stop_id],
            skip_special_tokens=False,
            include_stop_str_in_output=include,
        )
        out = llm.generate([prompt], params)[0].outputs[0]
        assert out.finish_reason == "stop" and out.token_ids[-1] == stop_id
        shown = out.token_ids if include else out.token_ids[:-1]
        assert out.text == llm.tokenizer.decode(shown, skip_special_tokens=False)
