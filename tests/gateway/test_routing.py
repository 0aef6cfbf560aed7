"""The request path across several decodes: failover, refusal, prefill lists, health."""

from __future__ import annotations

import socket

import httpx
import openai
import pytest

from gateway.app import build_state, create_app
from gateway.config import GatewaySettings
from gateway.registry import Instance, StaticRegistry
from tests.gateway.conftest import MAX_MODEL_LEN, SERVED_NAME, serve

MESSAGES = [{"role": "user", "content": "Hi"}]


def _dead_address() -> str:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)


def _ask(client: openai.OpenAI, n: int = 1):
    return client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=2, n=n)


def test_unreachable_decode_is_skipped(gateway_for, fakes):
    (fake, address), dead = fakes[0], _dead_address()
    with gateway_for(decode=[dead, address], unhealthy_cooldown_s=60) as url:
        client = _client(url)
        for _ in range(3):
            assert _ask(client).choices[0].finish_reason is not None
        assert len(fake.record.requests) == 3
        health = httpx.get(f"{url}/health").json()
        assert health == {"status": "ok", "num_decodes": 2, "num_decodes_reachable": 1}


def test_refusing_decode_falls_over_to_the_next(gateway_for, fakes):
    (busy, busy_addr), (ok, ok_addr) = fakes
    busy.knobs.refuse = True
    with gateway_for(decode=[busy_addr, ok_addr]) as url:
        client = _client(url)
        for _ in range(2):
            _ask(client)
    assert len(ok.record.requests) == 2 and len(busy.record.requests) >= 1
    # Each attempt is its own transfer (D owns the destination blocks).
    transfer_ids = [r.transfer_id for r in busy.record.requests + ok.record.requests]
    assert len(set(transfer_ids)) == len(transfer_ids)


def test_decode_cancelling_before_its_first_message_falls_over(gateway_for, fakes):
    """A decode that is stopping cancels calls it had not started (grpc's server.stop): no
    token was sent, so the request goes to the next decode instead of failing with a 500."""
    (stopping, stopping_addr), (ok, ok_addr) = fakes
    stopping.knobs.cancel = True
    with gateway_for(decode=[stopping_addr, ok_addr]) as url:
        assert _ask(_client(url)).choices[0].finish_reason is not None
    assert len(stopping.record.requests) == 1 and len(ok.record.requests) == 1


def test_all_refusing_is_503(gateway_for, fakes):
    for fake, _ in fakes:
        fake.knobs.refuse = True
    with gateway_for(decode=[a for _, a in fakes], retry_after_s=3) as url:
        with pytest.raises(openai.APIStatusError) as info:
            _ask(_client(url))
    assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "3"
    assert all(len(f.record.requests) == 1 for f, _ in fakes)


def test_nothing_reachable_is_503_and_unhealthy(gateway_for):
    with gateway_for(decode=[_dead_address()]) as url:
        with pytest.raises(openai.APIStatusError) as info:
            _ask(_client(url))
        assert info.value.status_code == 503
        assert info.value.body["message"] == "No decode instance is reachable."
        assert "retry-after" in info.value.response.headers
        resp = httpx.get(f"{url}/health")
        assert resp.status_code == 503 and resp.json()["num_decodes_reachable"] == 0


def test_children_spread_over_decodes_with_prefill_list(gateway_for, fakes):
    prefills = ["127.0.0.1:7001", "127.0.0.1:7002"]
    with gateway_for(decode=[a for _, a in fakes], prefill=prefills) as url:
        resp = _ask(_client(url), n=2)
    assert len(resp.choices) == 2
    requests = [r for f, _ in fakes for r in f.record.requests]
    assert all(len(f.record.requests) == 1 for f, _ in fakes)  # round robin
    orders = sorted([p.address for p in r.prefill] for r in requests)
    assert orders == [prefills, prefills[::-1]]
    assert sorted(r.request_id.split("_")[0] for r in requests) == ["0", "1"]


class _JoiningRegistry(StaticRegistry):
    """Knows only an unreachable decode until it is re-read: then a reachable one has joined
    (a rolling restart's replacement the background refresh has not seen yet)."""

    def __init__(self, dead: str, joining: str):
        super().__init__([dead])
        self.joining, self.num_refreshes = joining, 0

    async def refresh(self) -> bool:
        self.num_refreshes += 1
        self._decodes = (*self._decodes, Instance(self.joining, self.joining))
        return True


def test_every_decode_unreachable_rereads_the_registry_once(tiny_qwen3_path, model_info, fakes):
    (fake, address), dead = fakes[0], _dead_address()
    settings = GatewaySettings(
        model=str(tiny_qwen3_path), served_model_name=[SERVED_NAME], max_model_len=MAX_MODEL_LEN
    )
    registry = _JoiningRegistry(dead, address)
    state = build_state(settings, model=model_info, registry=registry)
    with serve(create_app(settings, state)) as url:
        assert _ask(_client(url)).choices[0].finish_reason is not None
    assert registry.num_refreshes == 1
    assert len(fake.record.requests) == 1


def test_no_decode_after_the_reread_is_still_503(tiny_qwen3_path, model_info):
    settings = GatewaySettings(
        model=str(tiny_qwen3_path), served_model_name=[SERVED_NAME], max_model_len=MAX_MODEL_LEN
    )
    registry = _JoiningRegistry(_dead_address(), _dead_address())
    with serve(
        create_app(settings, build_state(settings, model=model_info, registry=registry))
    ) as url:
        with pytest.raises(openai.InternalServerError, match="No decode instance is reachable"):
            _ask(_client(url))
    assert registry.num_refreshes == 1  # once, not in a loop
