"""One request never blocks the gateway's event loop: huge bodies, many messages, long stop
lists, and the early quota check (gateway/offload.py, gateway/preprocess.py)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.gateway.conftest import SERVED_NAME

# Every /health answer while the heavy request runs must come within this. A correctness bound,
# not the speed target: before the fix these requests stalled the loop for 5-15 s (and ~1 s for
# one pydantic pass over 200k messages); run alone the worst /health is ~50 ms, but on a loaded
# 2-core CI machine single answers reached 256 ms. The 50 ms target is a benchmark's
# figure, not a unit test's.
HEALTH_BOUND_S = 1.0


def _health_latencies_while(url: str, path: str, body: bytes) -> tuple[list[float], httpx.Response]:
    """POST `body` in a thread; poll /health until it has answered; return both."""
    result: dict[str, httpx.Response] = {}
    started = threading.Event()

    def post() -> None:
        with httpx.Client(timeout=120) as c:
            started.set()
            result["r"] = c.post(
                f"{url}{path}", content=body, headers={"Content-Type": "application/json"}
            )

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    started.wait()
    latencies = []
    with httpx.Client(timeout=30) as c:
        c.get(f"{url}/health")  # connection up before timing
        while thread.is_alive() or len(latencies) < 5:
            t0 = time.perf_counter()
            assert c.get(f"{url}/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
    thread.join()
    return latencies, result["r"]


def test_huge_prompt_leaves_health_answering(gateway_url):
    prompt = "hello world " * (7_500_000 // 12)
    body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1}).encode()
    latencies, r = _health_latencies_while(gateway_url, "/v1/completions", body)
    print(f"huge prompt: max /health {max(latencies) * 1000:.1f} ms over {len(latencies)}")
    assert r.status_code == 400, r.text
    assert "maximum context length is" in r.json()["error"]["message"]
    assert max(latencies) < HEALTH_BOUND_S, f"max /health latency {max(latencies):.3f} s"


def test_many_messages_leave_health_answering(gateway_url):
    messages = [{"role": "user", "content": "hi"}] * 200_000
    body = json.dumps({"model": SERVED_NAME, "messages": messages, "max_tokens": 1}).encode()
    latencies, r = _health_latencies_while(gateway_url, "/v1/chat/completions", body)
    print(f"200k messages: max /health {max(latencies) * 1000:.1f} ms over {len(latencies)}")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"
    # 7 MB: read by gateway/json_scan.py, which stops counting past the limit.
    assert "more than 4096 messages" in r.json()["error"]["message"]
    assert max(latencies) < HEALTH_BOUND_S, f"max /health latency {max(latencies):.3f} s"


def test_long_chat_is_refused_with_its_length(gateway_url):
    # Under max_messages, but far over the context: vLLM's 400 naming the length.
    messages = [{"role": "user", "content": "hi there"}] * 1000
    r = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        json={"model": SERVED_NAME, "messages": messages, "max_tokens": 1},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert "maximum context length is 256 tokens" in r.json()["error"]["message"]


def test_stop_list_is_capped(gateway_url):
    body = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 1, "stop": ["x"] * 10_000}
    t0 = time.perf_counter()
    r = httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stop"
    assert "at most 256 stop strings" in r.json()["error"]["message"]
    assert time.perf_counter() - t0 < 5


def test_stop_list_at_the_cap_is_served(gateway_url, fake):
    fake.knobs.max_tokens_cap = 1
    body = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 1, "stop": ["zq"] * 256}
    r = httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("where", ["field", "kwargs"])
def test_request_chat_template_refused_by_default(gateway_url, where):
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}]}
    if where == "field":
        body["chat_template"] = "{{ 'x' }}"
    else:
        body["chat_template_kwargs"] = {"chat_template": "{{ 'x' }}"}
    r = httpx.post(f"{gateway_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "chat_template" in r.json()["error"]["message"]
    assert "--trust-request-chat-template" in r.json()["error"]["message"]


@pytest.mark.parametrize("where", ["field", "kwargs"])
def test_request_chat_template_applied_when_trusted(gateway_for, fakes, where):
    fake, address = fakes[0]
    fake.knobs.max_tokens_cap = 1
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}]}
    if where == "field":
        body["chat_template"] = template
    else:
        body["chat_template_kwargs"] = {"chat_template": template}
    with gateway_for(decode=[address], trust_request_chat_template=True) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    (req,) = fake.record.requests
    assert list(req.prompt_token_ids) == fake_tokenize(fake, "[hi]")


def fake_tokenize(fake, text: str) -> list[int]:
    return list(fake.llm.tokenizer.encode(text, add_special_tokens=False))


def test_quota_checked_before_tokenizing(gateway_for, fakes, monkeypatch):
    """A request whose estimate (bytes / 4) is over the key's tokens per minute is refused
    without being tokenized."""
    import gateway.routes.completions as route

    calls = []
    real = route.tokenize_completion
    monkeypatch.setattr(
        route, "tokenize_completion", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    _, address = fakes[0]
    with gateway_for(decode=[address], default_tokens_per_min=1000) as url:
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": SERVED_NAME, "prompt": ["word " * 200] * 5, "max_tokens": 1},
            timeout=60,
        )
    # The estimate (5 * 250 + 5) can never fit 1000 tokens/min: the quota's 400 for that.
    assert r.status_code in (400, 429), r.text
    assert "tokens per minute" in r.json()["error"]["message"]
    assert calls == []
