"""Internal gRPC traffic is authenticated when a token is configured: calls without it (or with
a wrong one) are UNAUTHENTICATED; health probes stay open; D → P calls carry the token."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import internal_auth
from engine.sampling_params import SamplingParams
from protos import common_pb2, decode_pb2_grpc
from tests.integration.services import collect, generate_request, start_services

TOKEN = "internal-secret-for-tests-0123456789"


@pytest.fixture(scope="module")
def services(tiny_qwen3_path):
    mp = pytest.MonkeyPatch()
    mp.setenv(internal_auth.ENV_TOKEN, TOKEN)  # inherited by the service processes
    cluster, prefills, decodes = start_services(tiny_qwen3_path, 1, 1)
    yield mp, prefills[0].address, decodes[0].address
    cluster.stop()
    mp.undo()


def test_calls_need_the_token(services):
    mp, p_addr, d_addr = services
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run():
        plain = decode_pb2_grpc.DecodeStub(grpc.aio.insecure_channel(d_addr))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await plain.GetLoad(common_pb2.LoadRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(plain, generate_request("u1", [1, 2, 3], params))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(grpc.aio.insecure_channel(d_addr))
        ok = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert ok.status == health_pb2.HealthCheckResponse.SERVING
        # With the token (this process's env), including D's own call to P.
        authed = decode_pb2_grpc.DecodeStub(internal_auth.insecure_channel(d_addr))
        tokens, final, _ = await collect(
            authed, generate_request("u2", [1, 2, 3], params, [p_addr])
        )
        assert len(tokens) == 4 and not final.timings.local_prefill

    asyncio.run(run())
    mp.setenv(internal_auth.ENV_TOKEN, "wrong-token")

    async def wrong():
        stub = decode_pb2_grpc.DecodeStub(internal_auth.insecure_channel(d_addr))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GetLoad(common_pb2.LoadRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(wrong())
    mp.setenv(internal_auth.ENV_TOKEN, TOKEN)
