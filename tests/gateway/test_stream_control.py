"""Cancellation: a client that goes away, or a stop string, ends the decode's work."""

from __future__ import annotations

import httpx

from tests.gateway.conftest import SERVED_NAME
from tests.gateway.edge_util import wait_for


def test_client_disconnect_cancels_the_decode_stream(gateway_url, fake):
    fake.knobs.token_delay_s = 0.05
    body = {
        "model": SERVED_NAME,
        "prompt": "Hello",
        "max_tokens": 100,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{gateway_url}/v1/completions", json=body) as resp:
        lines = (line for line in resp.iter_lines() if line)
        for _ in range(3):
            assert next(lines).startswith("data: ")
    # Leaving the block closed the connection mid-stream.
    wait_for(lambda: fake.record.cancelled, timeout_s=5.0)
    assert fake.record.cancelled == [fake.record.requests[0].request_id]
    assert not fake.record.finished


def test_client_disconnect_cancels_a_non_streamed_request(gateway_url, fake):
    fake.knobs.token_delay_s = 0.05
    body = {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 100, "ignore_eos": True}
    try:
        httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=0.5)
    except httpx.TimeoutException:
        pass
    wait_for(lambda: fake.record.cancelled, timeout_s=5.0)
    assert not fake.record.finished


def test_stop_string_aborts_the_decode(client, fake, llm):
    from engine import SamplingParams

    full = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    text = full[0].outputs[0].text
    stop = text[4:7]
    fake.knobs.token_delay_s = 0.05
    resp = client.completions.create(
        model=SERVED_NAME,
        prompt="Hello",
        temperature=0,
        max_tokens=40,
        stop=stop,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].finish_reason == "stop"
    rid = fake.record.requests[0].request_id
    # Cancelling the call and the background Abort both reach D.
    wait_for(lambda: rid in fake.record.cancelled and rid in fake.record.aborted, timeout_s=5.0)
    assert not fake.record.finished
