"""Logprobs against transformers, seeded sampling independent of the batch, n and stops."""

from __future__ import annotations

import math

import pytest

from engine import LLM, SamplingParams
from tests.engine.hf_reference import hf_logprobs


@pytest.fixture(scope="module")
def llm(tiny_qwen3_path):
    return LLM(str(tiny_qwen3_path), max_model_len=256)


def test_logprobs_match_transformers(llm, tiny_qwen3_path):
    prompt = [11, 250, 7, 1200, 42, 99, 512, 3, 77]
    params = SamplingParams(
        temperature=0.8, seed=1, max_tokens=8, logprobs=5, prompt_logprobs=3, ignore_eos=True
    )
    out = llm.generate([prompt], params)[0]
    comp = out.outputs[0]
    ref = hf_logprobs(tiny_qwen3_path, prompt + comp.token_ids)
    assert len(comp.logprobs) == 8
    for i, (tok, lps) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert tok in lps and len(lps) >= 5
        for t, lp in lps.items():
            assert abs(lp - row[t].item()) < 1e-4
        top5 = row.topk(5).indices.tolist()
        assert set(top5) <= set(lps)
    assert comp.cumulative_logprob == pytest.approx(
        sum(lps[t] for t, lps in zip(comp.token_ids, comp.logprobs)), abs=1e-4
    )
    # prompt_logprobs: None for the first token, then the actual next prompt token's logprob.
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        lps = out.prompt_logprobs[p]
        assert abs(lps[prompt[p]] - ref[p - 1, prompt[p]].item()) < 1e-4


def test_seeded_sampling_is_batch_independent(llm):
    target = [5, 17, 300, 12, 8]
    params = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True
    )
    alone = llm.generate([target], params)[0].outputs[0]
    others = [[3, 4, 5, 6, 7, 8, 9] * k for k in range(1, 6)]
    noise = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(others[:2] + [target] + others[2:], [noise] * 2 + [params] + [noise] * 3)
    assert batch[2].outputs[0].token_ids == alone.token_ids
    assert batch[2].outputs[0].text == alone.text


def test_n_with_seed_is_reproducible_and_distinct(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    a = llm.generate("Once upon a time", params)[0]
    b = llm.generate("Once upon a time", params)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3
    assert [c.index for c in a.outputs] == [0, 1, 2]


def test_stop_token_ids_and_stop_strings(llm):
    base = llm.generate(
        "Hello there", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )[0].outputs[0]
    stop_tok = base.token_ids[4]
    first = base.token_ids.index(stop_tok)
    out = llm.generate(
        "Hello there",
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_tok]),
    )
    comp = out[0].outputs[0]
    assert comp.token_ids == base.token_ids[: first + 1]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop_tok

    text = base.text
    stop_str = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop_str.strip(), "pick a visible stop string"
    out = llm.generate(
        "Hello there",
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop_str]),
    )
    comp = out[0].outputs[0]
    assert comp.text == text[: text.index(stop_str)]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop_str
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_usable_blocks


def test_eos_stops_unless_ignored(tiny_qwen3_path):
    llm = LLM(str(tiny_qwen3_path), max_model_len=128, num_gpu_blocks_override=64)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    base = llm.generate("Hello", greedy)[0].outputs[0]
    # Declare the model's 3rd greedy token an EOS: generation must end right there.
    llm.eos_token_ids = frozenset({base.token_ids[2]})
    first = base.token_ids.index(base.token_ids[2])
    stopped = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert stopped.token_ids == base.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    ignored = llm.generate("Hello", greedy)[0].outputs[0]
    assert ignored.token_ids == base.token_ids and ignored.finish_reason == "length"
    # min_tokens masks EOS until reached.
    held = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6, min_tokens=6))
    assert len(held[0].outputs[0].token_ids) == 6
    assert base.token_ids[2] not in held[0].outputs[0].token_ids


def test_generation_config_defaults(tiny_qwen3_path):
    llm = LLM(str(tiny_qwen3_path), max_model_len=128, num_gpu_blocks_override=64)
    p = llm.get_default_sampling_params()
    # The tiny Qwen3 fixture ships Qwen3's real defaults in generation_config.json.
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 20)
    plain = LLM(
        str(tiny_qwen3_path),
        max_model_len=128,
        num_gpu_blocks_override=64,
        generation_config="vllm",
    )
    q = plain.get_default_sampling_params()
    assert (q.temperature, q.top_p, q.top_k) == (1.0, 1.0, 0)
    assert math.isclose(SamplingParams().temperature, 1.0)


def test_offline_keeps_no_kv_events(llm):
    """Nothing drains KV-cache events offline: the LLM must not gather them (they grew for as
    long as it lived), while its prefix cache still works."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(3, 3 + 40))
    llm.generate({"prompt_token_ids": prompt}, params)
    again = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert again.num_cached_tokens > 0
    assert llm.engine.kv.pool.take_events() == []
