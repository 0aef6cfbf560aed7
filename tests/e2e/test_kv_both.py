"""Two kv_both decodes (`--kv-role kv_both`): each may also serve prefills for the other, over real
gRPC and UCX, and the gateway never asks an instance to prefill for itself. With
`--prefill-policy remote` every request is prefilled on the other instance; outputs equal the
offline engine's, and the route log holds each request's predicted and measured TTFT."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from engine import LLM, SamplingParams
from tests.e2e.cluster import deploy
from tests.gateway.edge_util import wait_for

FLAGS = ["--max-model-len", "256", "--num-gpu-blocks-override", "128"]


@pytest.fixture(scope="module")
def dep(tiny_llama_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("routes") / "routes.jsonl"
    gateway_flags = ["--prefill-policy", "remote", "--route-log", str(log)]
    d = deploy(str(tiny_llama_path), 0, 2, FLAGS, gateway_flags=gateway_flags, kv_both=True)
    d.route_log = log
    yield d
    d.stop()


def test_kv_both_decodes_prefill_for_each_other(dep, tiny_llama_path):
    offline = LLM(str(tiny_llama_path), max_model_len=256, num_gpu_blocks_override=128)
    prompts = [f"Report {i}: " + "the river runs " * (3 + i % 5) for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.generate(prompts, params)]

    async def one(client, prompt):
        out = await client.completions.create(
            model=dep.model,
            prompt=prompt,
            temperature=0,
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
        return out.choices[0].text

    async def run():
        client = openai.AsyncOpenAI(base_url=dep.base_url, api_key="u", max_retries=0)
        return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(run()) == expected
    loads = dep.loads("decode")
    assert sum(ld.num_remote_prefills for ld in loads) == 16
    assert sum(ld.num_local_prefills for ld in loads) == 0
    dep.wait_idle()
    # The route log: one line per request (written in the batch after it finished: up to
    # 0.1 s later, gateway/bookkeeping.py), never self-prefill.
    wait_for(lambda: len(dep.route_log.read_text().splitlines()) >= 16)
    lines = [json.loads(x) for x in dep.route_log.read_text().splitlines()]
    assert len(lines) == 16
    ids = {c.address for c in dep.decodes}
    for x in lines:
        assert x["planned"] == "remote" and x["decode"] in ids and x["prefill"] in ids
        assert x["prefill"] != x["decode"]
        assert x["predicted_ttft_s"] > 0 and x["measured_ttft_s"] > 0
        assert 0 < x["decode_ttft_s"] <= x["measured_ttft_s"]  # D's part of the gateway's
        assert x["kv_transfer_bytes"] > 0
