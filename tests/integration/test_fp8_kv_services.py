"""`--kv-cache-dtype fp8` across processes: a prefill and a decode with FP8 caches hand the FP8
blocks over UCX (half the bytes of a bf16 cache's; a quarter of this fp32 model's) and the
decode's tokens equal the offline engine's with an FP8 cache. A prefill whose cache differs is
refused by layout, and the decode prefills locally: the request still gets its tokens."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from tests.integration.services import (
    ENGINE_FLAGS,
    collect,
    decode_stub,
    generate_request,
    get_load,
    prefill_stub,
    start_services,
    wait_idle,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
FP8 = ["--kv-cache-dtype", "fp8"]


@pytest.fixture(scope="module")
def services(tiny_qwen3_path):
    """Prefill 0 with an FP8 cache, prefill 1 with the model's dtype; one FP8 decode."""
    cluster, prefills, decodes = start_services(
        tiny_qwen3_path, 1, 1, extra_prefill=FP8, extra_decode=FP8
    )
    try:
        prefills.append(cluster.start("prefill", [str(tiny_qwen3_path), *ENGINE_FLAGS]))
        yield cluster, [p.address for p in prefills], decodes[0].address
    finally:
        cluster.stop()


def test_fp8_blocks_cross_processes_and_equal_offline(services, tiny_qwen3_path):
    _, prefills, decode = services
    offline = LLM(
        str(tiny_qwen3_path), max_model_len=256, num_gpu_blocks_override=64, kv_cache_dtype="fp8"
    )
    fp32 = EngineConfig.from_args(str(tiny_qwen3_path), max_model_len=256)  # the model's dtype
    prompts = [list(range(100, 150)) + [7, 8, 9], list(range(3, 40))]

    async def run():
        stub, pstub = decode_stub(decode), prefill_stub(prefills[0])
        # A first remote prefill may outlast the decode's first wait (2 s, before it has
        # measured the prefill's rate) on a loaded machine, and the decode then prefills
        # locally: warm up both first, whatever path this one takes.
        await collect(stub, generate_request("warm", list(range(200, 230)), GREEDY, prefills[:1]))
        await wait_idle(stub)
        await wait_idle(pstub)
        before, p_before = await get_load(stub), await get_load(pstub)
        for i, prompt in enumerate(prompts):
            tokens, final, _ = await collect(
                stub, generate_request(f"f{i}", prompt, GREEDY, prefills[:1])
            )
            assert not final.timings.local_prefill
            assert tokens == offline.generate([prompt], GREEDY)[0].outputs[0].token_ids
        after, p_after = await get_load(stub), await get_load(pstub)
        assert after.num_remote_prefills - before.num_remote_prefills == 2
        sent = p_after.kv_transfer_bytes - p_before.kv_transfer_bytes
        assert sent == after.kv_transfer_bytes - before.kv_transfer_bytes
        # One byte per value: a quarter of what the same blocks take in fp32.
        blocks = sum(-(-len(p) // 16) for p in prompts)
        fp32_block = fp32.kv_bytes_per_token() * 16
        assert sent == blocks * fp32_block // 4
        assert after.kv_bytes_per_block == fp32_block // 4
        await wait_idle(stub)
        await wait_idle(pstub)

    asyncio.run(run())


def test_a_prefill_with_another_cache_dtype_is_refused_and_the_decode_prefills(services):
    _, prefills, decode = services
    prompt = list(range(60, 90))

    async def run():
        stub = decode_stub(decode)
        before = await get_load(stub)
        tokens, final, _ = await collect(stub, generate_request("m0", prompt, GREEDY, prefills[1:]))
        assert len(tokens) == GREEDY.max_tokens and final.timings.local_prefill
        after = await get_load(stub)
        assert after.num_remote_prefills == before.num_remote_prefills
        await wait_idle(stub)
        await wait_idle(prefill_stub(prefills[1]))

    asyncio.run(run())
