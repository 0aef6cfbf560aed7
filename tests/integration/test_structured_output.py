"""A structured request through real processes: the prefill samples the first token under the
grammar, the decode resumes the grammar from it; the JSON equals the offline engine's."""

from __future__ import annotations

import asyncio
import json

import grpc
import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams
from tests.integration.services import (
    collect,
    decode_stub,
    generate_request,
    prefill_stub,
    start_services,
    wait_idle,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def services(tiny_qwen3_path):
    cluster, prefills, decodes = start_services(tiny_qwen3_path, 1, 1)
    yield prefills[0].address, decodes[0].address
    cluster.stop()


def test_json_schema_through_remote_prefill(services, tiny_qwen3_path):
    prefill, decode = services
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=so)
    prompt = list(range(3, 40))
    offline = LLM(str(tiny_qwen3_path), max_model_len=256, num_gpu_blocks_override=64)
    expected = offline.generate([prompt], params)[0].outputs[0]
    assert expected.finish_reason == "stop"
    jsonschema.validate(json.loads(expected.text), SCHEMA)
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a(b"))

    async def run():
        stub = decode_stub(decode)
        tokens, final, error = await collect(
            stub, generate_request("so", prompt, params, [prefill])
        )
        assert error is None and not final.timings.local_prefill
        assert tokens == expected.token_ids and final.finish_reason == "stop"
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, generate_request("bad", prompt, bad, [prefill]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Invalid regex" in e.value.details()
        await wait_idle(stub)
        await wait_idle(prefill_stub(prefill))

    asyncio.run(run())
