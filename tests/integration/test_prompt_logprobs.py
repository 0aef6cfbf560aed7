"""Prompt logprobs through real processes: computed by a remote prefill (P sends them in its
reply, D forwards them in the first TokenChunk) or by the decode itself, they equal the
offline engine's, also for a prompt the caches have already seen."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, SamplingParams
from engine.serving import logprobs_from_proto
from tests.integration.services import decode_stub, generate_request, start_services, wait_idle

PARAMS = SamplingParams(
    temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1, prompt_logprobs=2
)


@pytest.fixture(scope="module")
def services(tiny_qwen3_path):
    cluster, prefills, decodes = start_services(tiny_qwen3_path, 1, 1)
    yield prefills[0].address, decodes[0].address
    cluster.stop()


@pytest.fixture(scope="module")
def offline(tiny_qwen3_path):
    return LLM(str(tiny_qwen3_path), max_model_len=256, num_gpu_blocks_override=64)


async def _generate(stub, req) -> tuple[list, list[int], object]:
    """(prompt logprobs as dicts, with None first; tokens; final) of one Generate stream."""
    prompt_logprobs, tokens, final = None, [], None
    async for resp in stub.Generate(req):
        kind = resp.WhichOneof("kind")
        assert kind != "error", resp.error
        if kind == "final":
            final = resp.final
            continue
        if prompt_logprobs is None:  # the first chunk carries them
            prompt_logprobs = [None, *map(logprobs_from_proto, resp.tokens.prompt_logprobs)]
        else:
            assert not resp.tokens.prompt_logprobs
        tokens += resp.tokens.token_ids
    return prompt_logprobs, tokens, final


def _assert_close(got: list, expected: list) -> None:
    assert len(got) == len(expected) and got[0] is None and expected[0] is None
    for g, e in zip(got[1:], expected[1:]):
        assert list(g) == list(e)  # the prompt token first, then the top 2, in order
        assert list(g.values()) == pytest.approx(list(e.values()), abs=1e-4)


def test_prompt_logprobs_through_remote_prefill_equal_offline(services, offline):
    prefill, decode = services
    shared = list(range(100, 150))  # several blocks: P writes them all, D reuses none
    prompts = [shared + [7, 8, 9], list(range(3, 40)), [5], shared + [7, 8, 9]]

    async def run():
        stub = decode_stub(decode)
        for i, prompt in enumerate(prompts):
            expected = offline.generate([prompt], PARAMS)[0]
            remote = await _generate(stub, generate_request(f"r{i}", prompt, PARAMS, [prefill]))
            local = await _generate(stub, generate_request(f"l{i}", prompt, PARAMS))
            assert not remote[2].timings.local_prefill and local[2].timings.local_prefill
            for got in (remote, local):
                _assert_close(got[0], expected.prompt_logprobs)
                assert got[1] == expected.outputs[0].token_ids
        await wait_idle(stub)

    asyncio.run(run())
