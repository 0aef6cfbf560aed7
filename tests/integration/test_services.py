"""Real prefill and decode processes over gRPC and UCX: outputs equal the offline engine,
KV really crosses processes, prefix reuse, bad input, faults with no leaked blocks."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine import LLM, SamplingParams
from protos import common_pb2, decode_pb2, prefill_pb2
from tests.integration.services import (
    collect,
    decode_stub,
    generate_request,
    get_load,
    prefill_stub,
    start_services,
    wait_idle,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LEASE = ["--kv-lease-s", "2"]


@pytest.fixture(scope="module")
def services(tiny_qwen3_path):
    cluster, prefills, decodes = start_services(
        tiny_qwen3_path,
        2,
        1,
        extra_prefill=LEASE,
        extra_decode=[*LEASE, "--prefill-timeout-s", "3"],
    )
    yield cluster, [p.address for p in prefills], decodes[0].address
    cluster.stop()


@pytest.fixture(scope="module")
def offline(tiny_qwen3_path):
    return LLM(str(tiny_qwen3_path), max_model_len=256, num_gpu_blocks_override=64)


def _prompts():
    shared = list(range(100, 150))
    return [shared + [7, 8, 9], shared + [10, 11], list(range(3, 40)), [5]]


def test_remote_and_local_prefill_equal_offline(services, offline):
    _, prefills, decode = services

    async def run():
        stub = decode_stub(decode)
        before = await get_load(stub)
        p_before = await get_load(prefill_stub(prefills[0]))
        for i, prompt in enumerate(_prompts()):
            expected = offline.generate([prompt], GREEDY)[0].outputs[0].token_ids
            remote = await collect(stub, generate_request(f"a{i}", prompt, GREEDY, prefills[:1]))
            local = await collect(stub, generate_request(f"b{i}", prompt, GREEDY))
            assert remote[0] == expected and local[0] == expected
            assert remote[1].finish_reason == "length" and not remote[1].timings.local_prefill
            assert local[1].timings.local_prefill
            assert remote[1].usage.prompt_tokens == len(prompt)
            assert remote[1].usage.completion_tokens == GREEDY.max_tokens
        after = await get_load(stub)
        p_after = await get_load(prefill_stub(prefills[0]))
        assert after.kv_backend == "ucx" and p_after.kv_backend == "ucx"
        assert after.num_remote_prefills - before.num_remote_prefills == 4
        # Bytes counted on both sides, and equal: what P wrote is what D received.
        sent = p_after.kv_transfer_bytes - p_before.kv_transfer_bytes
        assert sent > 0 and sent == after.kv_transfer_bytes - before.kv_transfer_bytes
        await wait_idle(stub)
        await wait_idle(prefill_stub(prefills[0]))

    asyncio.run(run())


def test_prefix_reuse_at_prefill(services, offline):
    _, prefills, decode = services
    shared = list(range(300, 380))  # 5 full blocks

    async def run():
        stub, pstub = decode_stub(decode), prefill_stub(prefills[1])
        await collect(stub, generate_request("p0", shared + [1, 2], GREEDY, prefills[1:]))
        before = await get_load(pstub)
        tokens, final, _ = await collect(
            stub, generate_request("p1", shared + [3, 4, 5], GREEDY, prefills[1:])
        )
        after = await get_load(pstub)
        assert after.prefix_cache_hits - before.prefix_cache_hits == 80
        assert final.usage.cached_tokens >= 80
        assert tokens == offline.generate([shared + [3, 4, 5]], GREEDY)[0].outputs[0].token_ids

    asyncio.run(run())


def test_seeded_sampling_crosses_the_handoff(services, offline):
    _, prefills, decode = services
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)

    async def run():
        tokens, _, _ = await collect(
            decode_stub(decode), generate_request("s0", [9, 8, 7, 6], params, prefills)
        )
        assert tokens == offline.generate([[9, 8, 7, 6]], params)[0].outputs[0].token_ids

    asyncio.run(run())


def test_bad_input_is_invalid_argument(services):
    _, prefills, decode = services
    ok = generate_request("x", [1, 2, 3], GREEDY)

    async def run():
        stub, pstub = decode_stub(decode), prefill_stub(prefills[0])
        bad_generate = [
            decode_pb2.GenerateRequest(),  # everything missing
            generate_request("", [1, 2], GREEDY),
            generate_request("x1", [], GREEDY),
            generate_request("x2", [1, 99999], GREEDY),
            generate_request("x3", [1] * 300, GREEDY),  # > max_model_len
            decode_pb2.GenerateRequest(request_id="x4", prompt_token_ids=[1, 2]),  # no params
        ]
        bad_params = generate_request("x5", [1, 2], GREEDY)
        bad_params.params.top_p = 3.0
        bad_generate.append(bad_params)
        for req in bad_generate:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(stub, req)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
        # A priority on an FCFS decode would be accepted and ignored: refused, as vLLM does.
        prioritized = generate_request("x6", [1, 2], GREEDY)
        prioritized.priority = 1
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, prioritized)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Got priority 1 but Priority scheduling is not enabled" in e.value.details()
        load = await pstub.GetLoad(common_pb2.LoadRequest())
        target = common_pb2.KVTarget(
            agent_name="d",
            agent_metadata=b"junk",
            block_ids=[1],
            first_block=0,
            transfer_token="t",
            block_bytes=load.kv_bytes_per_block,  # past this check: the metadata is the fault
        )
        base = dict(
            request_id="y",
            transfer_id="t",
            prompt_token_ids=[1, 2, 3],
            params=ok.params,
            target=target,
        )
        bad_prefill = [
            prefill_pb2.PrefillRequest(),
            prefill_pb2.PrefillRequest(**{**base, "transfer_id": ""}),
            prefill_pb2.PrefillRequest(
                **{
                    **base,
                    "target": common_pb2.KVTarget(
                        agent_name="d", agent_metadata=b"junk", block_ids=[1, 2, 3], first_block=0
                    ),
                }
            ),
            prefill_pb2.PrefillRequest(
                **{
                    **base,
                    "target": common_pb2.KVTarget(
                        agent_name="d", agent_metadata=b"junk", block_ids=[1], first_block=5
                    ),
                }
            ),
            prefill_pb2.PrefillRequest(**{**base, "prompt_token_ids": [1] * 10000}),
            prefill_pb2.PrefillRequest(**base),  # malformed agent metadata
        ]
        for req in bad_prefill:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await pstub.Prefill(req, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
        # A decode whose KV blocks have another layout (here: an FP8 cache's half-size blocks).
        half = common_pb2.KVTarget()
        half.CopyFrom(target)
        half.block_bytes = load.kv_bytes_per_block // 2
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pstub.Prefill(prefill_pb2.PrefillRequest(**{**base, "target": half}), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--kv-cache-dtype" in e.value.details()
        # Both still serve.
        tokens, final, _ = await collect(
            stub, generate_request("z", [4, 5, 6], GREEDY, prefills[:1])
        )
        assert len(tokens) == GREEDY.max_tokens
        assert not (await stub.Abort(common_pb2.AbortRequest(request_id="unknown"))).found
        await wait_idle(stub)
        await wait_idle(pstub)

    asyncio.run(run())


def test_client_disconnect_mid_stream_frees_blocks(services):
    _, prefills, decode = services
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def run():
        stub = decode_stub(decode)
        call = stub.Generate(generate_request("c0", list(range(3, 60)), long, prefills[:1]))
        got = 0
        async for resp in call:
            got += len(resp.tokens.token_ids)
            if got >= 3:
                call.cancel()
                break
        load = await wait_idle(stub)
        assert load.num_running == 0

    asyncio.run(run())
