"""A decode short of KV blocks queues remote prefills instead of refusing them (as colocated
mode queues in the scheduler): more concurrent prompts than its cache holds all complete, in
order of arrival, with the output the offline engine gives; the queue limits still refuse past
`--max-num-queued-reqs`."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine import LLM, SamplingParams
from tests.integration.services import (
    collect,
    decode_stub,
    generate_request,
    get_load,
    start_services,
    wait_idle,
)

# 20 blocks of 16 tokens: 19 usable (304 tokens); each request needs 8 (100 + 24 tokens).
SMALL_CACHE = ["--num-gpu-blocks-override", "20"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
NUM_REQUESTS = 6


def _prompt(i: int) -> list[int]:
    return [(7 * i + j) % 1500 + 10 for j in range(100)]


@pytest.fixture(scope="module")
def services(tiny_qwen3_path):
    cluster, prefills, decodes = start_services(
        tiny_qwen3_path, 1, 1, extra_decode=[*SMALL_CACHE, "--max-num-queued-reqs", "8"]
    )
    yield prefills[0].address, decodes[0].address
    cluster.stop()


def test_more_prompts_than_blocks_all_complete(services, tiny_qwen3_path):
    p_addr, d_addr = services
    offline = LLM(str(tiny_qwen3_path), max_model_len=256, num_gpu_blocks_override=64)
    expected = [
        o.outputs[0].token_ids
        for o in offline.generate(
            [{"prompt_token_ids": _prompt(i)} for i in range(NUM_REQUESTS)], PARAMS
        )
    ]

    async def run():
        stub = decode_stub(d_addr)
        reqs = [
            generate_request(f"q{i}", _prompt(i), PARAMS, prefill_addrs=[p_addr])
            for i in range(NUM_REQUESTS)
        ]
        results = await asyncio.gather(*(collect(stub, r) for r in reqs))
        load = await get_load(stub)
        await wait_idle(stub)
        return results, load

    results, load = asyncio.run(run())
    for i, (tokens, final, error) in enumerate(results):
        assert error is None, error
        assert final is not None and final.finish_reason == "length"
        assert tokens == list(expected[i]), i
    assert load.num_remote_prefills == NUM_REQUESTS  # queued for P, not sent local


def test_queue_limit_still_refuses(services):
    _, d_addr = services

    async def run():
        stub = decode_stub(d_addr)
        reqs = [
            generate_request(f"over{i}", _prompt(i), PARAMS, prefill_addrs=["127.0.0.1:9"])
            for i in range(14)
        ]
        results = await asyncio.gather(*(collect(stub, r) for r in reqs), return_exceptions=True)
        await wait_idle(stub)
        return results

    results = asyncio.run(run())
    refused = [
        r
        for r in results
        if isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    ]
    done = [r for r in results if isinstance(r, tuple) and r[1] is not None]
    assert refused, "past --max-num-queued-reqs a decode refuses"
    assert all("max_num_queued_reqs=8" in r.details() for r in refused), refused[0].details()
    assert len(refused) + len(done) == len(results), results


@pytest.fixture(scope="module")
def exact_fit_services(tiny_qwen3_path):
    # 16 usable blocks: two 128-token prompts (8 blocks each) fill them exactly.
    cluster, prefills, decodes = start_services(
        tiny_qwen3_path, 1, 1, extra_decode=["--num-gpu-blocks-override", "17"]
    )
    yield prefills[0].address, decodes[0].address
    cluster.stop()


def test_prompts_that_fill_the_cache_exactly_still_decode(exact_fit_services):
    """Reproduced hang: reservations took exactly the prompts' blocks, so two prompts that
    filled the cache were both written by P, then neither could take a slot for its next
    token, and with nothing running nothing ever freed one. A reservation now includes the
    first decode slot: the second prompt waits in line and every request completes."""
    p_addr, d_addr = exact_fit_services
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def run():
        stub = decode_stub(d_addr)
        reqs = [
            generate_request(f"x{i}", [(11 * i + j) % 1500 + 10 for j in range(128)], params,
                             prefill_addrs=[p_addr])
            for i in range(3)
        ]  # fmt: skip
        results = await asyncio.wait_for(
            asyncio.gather(*(collect(stub, r) for r in reqs)), timeout=60
        )
        load = await get_load(stub)
        await wait_idle(stub)
        return results, load

    results, load = asyncio.run(run())
    for tokens, final, error in results:
        assert error is None, error
        assert final is not None and final.finish_reason == "length"
        assert len(tokens) == 8
    assert load.num_remote_prefills == 3
