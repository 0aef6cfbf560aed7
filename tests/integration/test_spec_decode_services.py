"""Speculative decoding on the decode service after a remote prefill: P samples the first
token, D speculates from there; the tokens equal the offline engine's without speculation,
and D exports vLLM's spec-decode counters."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.engine.test_spec_decode import _looping_prompt, _random_prompts
from tests.integration.services import (
    collect,
    decode_stub,
    free_port,
    generate_request,
    metric_value,
    prefill_stub,
    start_services,
    wait_idle,
)

SPEC = ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4})]
SPEC_MIN1 = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
)


@pytest.fixture(scope="module")
def services(tiny_repetitive_path):
    port = free_port()
    cluster, prefills, decodes = start_services(
        tiny_repetitive_path,
        1,
        1,
        extra_prefill=SPEC,  # as `tandem serve` passes it: the prefill has no decode to speed
        extra_decode=["--speculative-config", SPEC_MIN1, "--metrics-port", str(port)],
    )
    yield prefills[0].address, decodes[0].address, port
    cluster.stop()


@pytest.fixture(scope="module")
def offline(tiny_repetitive_path):
    return LLM(str(tiny_repetitive_path), max_model_len=256, num_gpu_blocks_override=64)


def test_remote_prefill_then_speculation_equals_offline(services, offline):
    prefill, decode, port = services
    looping, _ = _looping_prompt(offline, seed=8)
    prompts = [looping, *_random_prompts(2, 5, 30, seed=21)]
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    seeded = SamplingParams(temperature=0.15, seed=5, max_tokens=60, ignore_eos=True)
    url = f"http://127.0.0.1:{port}/metrics"
    before = metric_value(httpx.get(url).text, "vllm:spec_decode_num_accepted_tokens_total")

    async def run():
        stub = decode_stub(decode)
        for i, prompt in enumerate(prompts):
            for params in (greedy, seeded):
                expected = offline.generate([prompt], params)[0].outputs[0].token_ids
                tag = f"{i}-{params.temperature}"
                remote = await collect(stub, generate_request(f"r{tag}", prompt, params, [prefill]))
                local = await collect(stub, generate_request(f"l{tag}", prompt, params))
                assert remote[0] == expected and not remote[1].timings.local_prefill
                assert local[0] == expected and local[1].timings.local_prefill
                assert remote[1].usage.completion_tokens == params.max_tokens
        await wait_idle(stub)
        await wait_idle(prefill_stub(prefill))

    asyncio.run(run())
    text = httpx.get(url).text
    accepted = metric_value(text, "vllm:spec_decode_num_accepted_tokens_total") - before
    assert accepted > 100
    assert metric_value(text, "vllm:spec_decode_num_draft_tokens_total") >= accepted
    assert metric_value(text, "vllm:spec_decode_num_drafts_total") > 0
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total{" in text
