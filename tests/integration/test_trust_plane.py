"""The internal plane against a stray process, a forged record and a hostile message.

Each test starts from a reviewer's reproduction against real processes:
- a decode sent its KV metadata (rkeys for its whole KV cache) to whichever prefill the caller
  named, including one found only in a forged Redis record;
- one malformed 11-byte UCX message ended a decode's engine loop for good;
- a SIGSTOPped prefill held TTFT for the full `--prefill-timeout-s` (60 s), and a zombie
  resuming after the lease could still write into blocks the decode had reused;
- one tenant's burst of long prompts reserved every block, starving other tenants;
- a Prefill call still in flight when the decode gave up could start writing afterwards.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from engine.internal_auth import add_port, server_interceptors
from engine.record_auth import RecordAuth
from engine.registry import InstanceRecord, new_epoch
from kv_transfer import Agent
from kv_transfer.ucx_request import _MAGIC
from protos import common_pb2, decode_pb2, prefill_pb2, prefill_pb2_grpc
from tests.integration.services import (
    collect,
    decode_stub,
    generate_request,
    get_load,
    prefill_stub,
    start_services,
    wait_idle,
)
from tests.integration.test_faults import GREEDY, PROMPT, expected  # noqa: F401  (fixture)
from tests.kv_transfer.test_hostile_messages import send_raw
from tests.redis_server import redis_server  # noqa: F401  (the fixture)


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    """A process posing as a prefill: records what reaches it, then refuses."""

    def __init__(self):
        self.calls: list[prefill_pb2.PrefillRequest] = []

    async def Prefill(self, request, context):
        self.calls.append(request)
        await context.abort(grpc.StatusCode.ABORTED, "fake prefill")

    async def Abort(self, request, context):
        return common_pb2.AbortResponse(found=False)


async def _start_fake() -> tuple[grpc.aio.Server, FakePrefill, str]:
    fake = FakePrefill()
    server = grpc.aio.server(interceptors=server_interceptors())
    prefill_pb2_grpc.add_PrefillServicer_to_server(fake, server)
    port = add_port(server, "127.0.0.1:0")
    await server.start()
    return server, fake, f"127.0.0.1:{port}"


def _registration(auth: RecordAuth, address: str, role: str = "prefill") -> bytes:
    record = InstanceRecord("p-x", role, address, "m", 16, new_epoch(), 4096)
    record = InstanceRecord(**{**record.__dict__, "published_at": time.time()})
    return record.seal(auth)


def test_registered_decode_gives_kv_metadata_only_to_verified_prefills(
    tiny_qwen3_path,
    redis_server,  # noqa: F811
    expected,  # noqa: F811
):
    cluster, _, (d,) = start_services(
        tiny_qwen3_path, 0, 1, extra_decode=["--redis-url", redis_server.url]
    )

    async def run():
        server, fake, address = await _start_fake()
        stub = decode_stub(d.address)
        try:
            forged = [
                decode_pb2.PrefillTarget(address=address),  # named, no record
                decode_pb2.PrefillTarget(  # a record sealed without the internal secret
                    address=address,
                    registration=_registration(RecordAuth("not-the-secret-0123456789"), address),
                ),
                decode_pb2.PrefillTarget(  # an authentic record of a decode, not a prefill
                    address=address,
                    registration=_registration(RecordAuth.from_env(), address, "decode"),
                ),
            ]
            for i, target in enumerate(forged):
                req = generate_request(f"f{i}", PROMPT, GREEDY)
                req.prefill.append(target)
                tokens, final, error = await collect(stub, req)
                assert error is None and tokens == expected and final.timings.local_prefill
            assert fake.calls == []  # never saw the metadata, the token or the prompt
            # Positive control: a record sealed with the cluster's secret is trusted.
            req = generate_request("ok", PROMPT, GREEDY)
            req.prefill.append(
                decode_pb2.PrefillTarget(
                    address=address, registration=_registration(RecordAuth.from_env(), address)
                )
            )
            tokens, _, _ = await collect(stub, req)
            assert tokens == expected and len(fake.calls) == 1
            await wait_idle(stub)
        finally:
            await server.stop(None)

    try:
        asyncio.run(run())
    finally:
        cluster.stop()


def test_malformed_ucx_message_leaves_the_decode_serving(tiny_qwen3_path, expected):  # noqa: F811
    cluster, _, (d,) = start_services(tiny_qwen3_path, 0, 1)

    async def run():
        server, fake, address = await _start_fake()
        stub = decode_stub(d.address)
        try:
            # Whoever D hands its metadata to can reach its UCX worker: capture it.
            tokens, _, _ = await collect(stub, generate_request("m0", PROMPT, GREEDY, [address]))
            assert tokens == expected
            attacker = Agent("attacker", "ucx")
            try:
                name = attacker.add_remote_agent(fake.calls[0].target.agent_metadata)
                hostile = _MAGIC + (5).to_bytes(2, "little") + b"\xff\xfe\xfd\xfc\xfb"
                for i in range(3):
                    send_raw(attacker, name, hostile)
                    tokens, _, error = await collect(
                        stub, generate_request(f"m{i + 1}", PROMPT, GREEDY)
                    )
                    assert error is None and tokens == expected
            finally:
                attacker.close()
            await wait_idle(stub)
        finally:
            await server.stop(None)

    try:
        asyncio.run(run())
    finally:
        cluster.stop()


@pytest.fixture
def stoppable(tiny_qwen3_path):
    """2 prefills + 1 decode with default timeouts (no test-tuned --prefill-timeout-s)."""
    cluster, prefills, decodes = start_services(tiny_qwen3_path, 2, 1)
    yield prefills, decodes[0]
    for c in cluster.children:  # resume anything a test stopped, so it can exit
        if c.proc.poll() is None:
            os.kill(c.proc.pid, signal.SIGCONT)
    cluster.stop()


def test_stopped_prefill_costs_a_bounded_ttft_and_stays_fenced(stoppable, expected):  # noqa: F811
    (p1, p2), d = stoppable

    async def run():
        stub = decode_stub(d.address)
        # Warm both paths so the decode has measured each prefill's rate.
        for i, p in enumerate((p1, p2)):
            tokens, _, _ = await collect(
                stub, generate_request(f"w{i}", PROMPT, GREEDY, [p.address])
            )
            assert tokens == expected
        await wait_idle(stub)
        idle = (await get_load(stub)).num_idle_free_blocks
        os.kill(p1.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        req = generate_request("s", PROMPT[::-1], GREEDY, [p1.address, p2.address])
        tokens, final, error = await collect(stub, req)
        ttft_s = time.monotonic() - t0
        assert error is None and final.timings.prefill_instance == p2.address
        assert ttft_s < 10.0, ttft_s  # bounded by the predicted prefill time, not 60 s
        # P1 may still write the blocks it was given: they stay out of use while it is stopped.
        load = await get_load(stub)
        assert load.num_free_blocks < idle
        os.kill(p1.proc.pid, signal.SIGCONT)
        await wait_idle(stub)  # P1 acknowledged the abort: the blocks come back
        await wait_idle(prefill_stub(p1.address))

    asyncio.run(run())


def test_prefill_refuses_a_transfer_the_decode_already_aborted(stoppable):
    (p1, _), d = stoppable

    async def run():
        pstub = prefill_stub(p1.address)
        await pstub.Abort(common_pb2.AbortRequest(request_id="late", transfer_id="t-late"))
        req = generate_request("late", PROMPT, GREEDY)
        msg = prefill_pb2.PrefillRequest(
            request_id="late",
            transfer_id="t-late",
            prompt_token_ids=PROMPT,
            params=req.params,
            target=common_pb2.KVTarget(agent_name="x", agent_metadata=b"x", block_ids=[1, 2, 3, 4]),
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pstub.Prefill(msg, timeout=5)
        assert err.value.code() == grpc.StatusCode.ABORTED
        assert "aborted by the decode" in err.value.details()

    asyncio.run(run())


def test_one_tenant_cannot_reserve_every_block(stoppable):
    (p1, p2), d = stoppable
    long_prompt = [(i * 7) % 500 + 3 for i in range(200)]  # 13 blocks of 16

    async def run():
        stub = decode_stub(d.address)
        idle = (await get_load(stub)).num_idle_free_blocks
        os.kill(p1.proc.pid, signal.SIGSTOP)  # tenant A's prefills hang there
        burst = [
            asyncio.ensure_future(
                collect(
                    stub,
                    generate_request(
                        f"a{i}", [i, *long_prompt], GREEDY, [p1.address], cache_salt="tenant:a"
                    ),
                )
            )
            for i in range(6)
        ]
        deadline = time.monotonic() + 10
        while (await get_load(stub)).num_free_blocks > idle - 26:  # A holds >= 2 prompts' worth
            assert time.monotonic() < deadline, "tenant A's reservations never landed"
            await asyncio.sleep(0.02)
        # Tenant B arrives while A's prefills hang: it must still be served.
        tokens, final, error = await collect(
            stub,
            generate_request("b", long_prompt[::-1], GREEDY, [p2.address], cache_salt="tenant:b"),
        )
        assert error is None and len(tokens) == GREEDY.max_tokens
        assert final.timings.prefill_instance == p2.address
        results = await asyncio.gather(*burst, return_exceptions=True)
        refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert refused and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
        assert "per tenant" in refused[0].details()
        os.kill(p1.proc.pid, signal.SIGCONT)
        await wait_idle(stub)

    asyncio.run(run())
