"""Optional mTLS under the internal token: with TANDEM_INTERNAL_TLS_{CERT,KEY,CA} set, gateway,
decode and prefill talk TLS with client certificates (the gateway's framed connections to the
decodes too); a client without a certificate, with one from another CA, or in plaintext cannot
connect, and the token is still required."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from pathlib import Path

import grpc
import httpx
import pytest

from engine import internal_auth
from engine.sampling_params import SamplingParams
from gateway.clients import DecodeClients
from gateway.registry import Instance
from protos import common_pb2, decode_pb2_grpc
from tests.e2e.cluster import deploy
from tests.fixtures.pki import make_pki, tls_env
from tests.integration.services import (
    ENGINE_FLAGS,
    collect,
    generate_request,
    open_frames,
    read_call,
)

TOKEN = "tls-test-internal-token-0123456789"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def deployment(pki, tiny_qwen3_path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(internal_auth.ENV_TOKEN, TOKEN)  # inherited by every process deploy() starts
        for name, value in tls_env(pki).items():
            mp.setenv(name, value)
        d = deploy(str(tiny_qwen3_path), 1, 1, ENGINE_FLAGS)
        try:
            yield d
        finally:
            d.stop()


def _credentials(pki: Path, leaf: str | None) -> grpc.ChannelCredentials:
    ca = (pki / "ca.pem").read_bytes()
    if leaf is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    key, cert = (pki / f"{leaf}.key").read_bytes(), (pki / f"{leaf}.pem").read_bytes()
    return grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)


def _get_load(make_channel: Callable[[], grpc.aio.Channel], token: str | None):
    """GetLoad over a fresh channel (made on the call's own event loop)."""
    return asyncio.run(_get_load_async(make_channel, token))


async def _get_load_async(make_channel, token):
    metadata = [("authorization", f"Bearer {token}")] if token else None
    async with make_channel() as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        return await stub.GetLoad(common_pb2.LoadRequest(), timeout=10, metadata=metadata)


def test_mtls_clients_with_the_ca_certificate_and_token_get_through(deployment, pki):
    d_addr, p_addr = deployment.decodes[0].address, deployment.prefills[0].address
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run():
        # internal_channel reads the TLS files and the token from this process's environment.
        stub = decode_pb2_grpc.DecodeStub(internal_auth.internal_channel(d_addr))
        tokens, final, error = await collect(
            stub, generate_request("tls1", [1, 2, 3], params, [p_addr])
        )
        assert error is None and len(tokens) == 4
        assert not final.timings.local_prefill  # D → P went over mTLS too

    asyncio.run(run())
    # The gateway's channels to decode and prefill use the same function.
    r = httpx.post(
        f"{deployment.base_url}/completions",
        json={"model": deployment.model, "prompt": "hi", "max_tokens": 3, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("client", ["plaintext", "no client certificate", "another CA"])
def test_mtls_refuses_clients_without_a_valid_certificate(deployment, pki, client):
    address = deployment.decodes[0].address
    if client == "plaintext":
        channel = partial(grpc.aio.insecure_channel, address)
    else:
        leaf = None if client == "no client certificate" else "rogue"
        channel = partial(grpc.aio.secure_channel, address, _credentials(pki, leaf))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        _get_load(channel, TOKEN)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # no TLS session, no call


def test_mtls_still_needs_the_token(deployment, pki):
    address = deployment.decodes[0].address
    channel = partial(grpc.aio.secure_channel, address, _credentials(pki, "svc"))
    assert _get_load(channel, TOKEN).max_num_batched_tokens > 0
    with pytest.raises(grpc.aio.AioRpcError) as e:
        _get_load(channel, None)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_gateways_framed_connection_to_a_decode_has_mtls_and_the_token(deployment):
    """The decode service advertises its framed port (protos/mux_frames.py) on the gRPC stream;
    the gateway's client connects with this process's certificate and token and gets the same
    greedy tokens there, from both a local and a remote prefill."""
    d, p_addr = Instance(deployment.decodes[0].address, "d"), deployment.prefills[0].address
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def run():
        clients = DecodeClients()
        try:
            on_grpc = clients.generate(d, generate_request("g1", [5, 6, 7], params))
            expected = await read_call(on_grpc)
            frames = await open_frames(clients, d)
            for rid, prefills in (("f1", []), ("f2", [p_addr])):
                call = clients.generate(d, generate_request(rid, [5, 6, 7], params, prefills))
                assert call._stream is frames
                assert await read_call(call) == expected
        finally:
            await clients.close()

    asyncio.run(run())
