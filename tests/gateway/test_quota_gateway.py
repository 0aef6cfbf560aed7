"""Quotas through the gateway: 429s, settlement, slots freed on every exit, Redis failures,
and one limit shared by two gateway processes."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest
import redis

from tests.gateway.conftest import MAX_MODEL_LEN, SERVED_NAME
from tests.gateway.edge_util import (
    KEY_ALPHA,
    KEY_BETA,
    chat,
    edge_gateway,
    hash_prefix,
    wait_for,
    write_keys,
)
from tests.redis_server import redis_server  # noqa: F401  (fixture)


@pytest.fixture
def limited(tiny_qwen3_path, model_info, fakes, redis_server, tmp_path):  # noqa: F811
    """`limited(limits)`: a gateway with Redis quotas where KEY_ALPHA has `limits`."""

    def start(limits: dict, **overrides):
        path = write_keys(
            tmp_path / "keys", [(KEY_ALPHA, "alpha", limits), (KEY_BETA, "beta", None)]
        )
        return edge_gateway(
            tiny_qwen3_path,
            model_info,
            decode=[fakes[0][1]],
            api_keys_file=path,
            redis_url=redis_server.url,
            **overrides,
        )

    return start


def _redis_state(server, state) -> tuple[int, int]:
    """(tokens in KEY_ALPHA's window, its concurrency slots) as Redis holds them."""
    quota_id = state.edge.keys.authenticate(KEY_ALPHA.encode()).quota_id
    r = redis.Redis.from_url(server.url)
    total = int(r.get(f"tandem:quota:{{{quota_id}}}:sum") or 0)
    return total, r.zcard(f"tandem:quota:{{{quota_id}}}:slots")


def test_burst_over_the_limit_is_429_with_retry_after(limited):
    with limited({"requests_per_min": 3}) as (url, state):
        for _ in range(3):
            chat(url, KEY_ALPHA)
        with pytest.raises(openai.RateLimitError) as info:
            chat(url, KEY_ALPHA)
        assert 1 <= int(info.value.response.headers["retry-after"]) <= 60
        assert info.value.body["type"] == "RateLimitError" and info.value.body["code"] == 429
        assert "3 requests per minute" in info.value.body["message"]
        chat(url, KEY_BETA)  # other keys are not affected
        assert state.edge.quota.backend_name == "redis"


def test_tokens_settle_to_actual_usage(limited, redis_server, fake):  # noqa: F811
    fake.knobs.max_tokens_cap = 5  # asks for 100, stops at 5
    prompt = [5, 6, 7, 8]
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 100, "ignore_eos": True}
    auth = {"Authorization": f"Bearer {KEY_ALPHA}"}
    with limited({"tokens_per_min": 150}) as (url, state):
        resp = httpx.post(f"{url}/v1/completions", json=body, headers=auth)
        assert resp.json()["usage"]["total_tokens"] == 9
        # 104 reserved, 95 freed.
        wait_for(lambda: _redis_state(redis_server, state) == (9, 0), timeout_s=5.0)
        # Without settlement 104 + 104 > 150 would be refused.
        assert httpx.post(f"{url}/v1/completions", json=body, headers=auth).status_code == 200
        wait_for(lambda: _redis_state(redis_server, state)[0] == 18, timeout_s=5.0)
        stream = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, headers=auth)
        assert stream.status_code == 200
        wait_for(lambda: _redis_state(redis_server, state)[0] == 27, timeout_s=5.0)


def test_slots_are_freed_on_every_exit(limited, redis_server, fake):  # noqa: F811
    body = {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 100, "ignore_eos": True}
    auth = {"Authorization": f"Bearer {KEY_ALPHA}"}
    with limited({"max_concurrent": 1}) as (url, state):
        fake.knobs.token_delay_s = 0.05
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=auth
        ) as resp:
            lines = (line for line in resp.iter_lines() if line)
            next(lines), next(lines)
            assert _redis_state(redis_server, state)[1] == 1
            with pytest.raises(openai.RateLimitError):  # the one slot is taken
                chat(url, KEY_ALPHA)
        # Client gone mid-stream: the slot comes back.
        wait_for(lambda: _redis_state(redis_server, state)[1] == 0, timeout_s=5.0)
        with pytest.raises(httpx.TimeoutException):  # gone while not streamed
            httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=0.3)
        wait_for(lambda: _redis_state(redis_server, state)[1] == 0, timeout_s=5.0)
        fake.knobs.token_delay_s = 0.0
        fake.knobs.fail_after_tokens = 1  # decode error
        with pytest.raises(openai.InternalServerError):
            chat(url, KEY_ALPHA)
        fake.knobs.fail_after_tokens, fake.knobs.refuse = None, True  # 503 at admission
        with pytest.raises(openai.APIStatusError, match="busy"):
            chat(url, KEY_ALPHA)
        wait_for(lambda: _redis_state(redis_server, state)[1] == 0, timeout_s=5.0)
        fake.knobs.refuse = False
        chat(url, KEY_ALPHA)


def test_redis_down_falls_back_to_memory_and_recovers(limited, redis_server):  # noqa: F811
    overrides = dict(metrics_port=0, redis_probe_interval_s=0.1)
    with limited({"requests_per_min": 4}, **overrides) as (url, state):
        metrics_url = "http://{}:{}/metrics".format(*state.edge.metrics_address)
        chat(url, KEY_ALPHA)
        assert httpx.get(f"{url}/health").json()["quota_backend"] == "redis"
        redis_server.kill()
        for _ in range(4):  # memory starts a fresh window: 4 more
            chat(url, KEY_ALPHA)
        with pytest.raises(openai.RateLimitError):  # ... and enforces the same limit
            chat(url, KEY_ALPHA)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 200
        assert health.json()["status"] == "degraded"
        assert health.json()["quota_backend"] == "memory"
        assert "tandem:degraded 1.0" in httpx.get(metrics_url).text
        redis_server.start()  # back, empty
        wait_for(lambda: httpx.get(f"{url}/health").json()["status"] == "ok", timeout_s=5.0)
        assert httpx.get(f"{url}/health").json()["quota_backend"] == "redis"
        assert "tandem:degraded 0.0" in httpx.get(metrics_url).text
        chat(url, KEY_ALPHA)


def _start_gateway_process(model_path, decode: str, redis_url: str, keys_path) -> subprocess.Popen:
    env = {**os.environ, "TANDEM_API_KEYS_FILE": str(keys_path), "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "-m", "gateway", "--model", str(model_path)]
    args += ["--served-model-name", SERVED_NAME, "--max-model-len", str(MAX_MODEL_LEN)]
    args += ["--decode", decode, "--port", "0", "--redis-url", redis_url, "--log-level", "debug"]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _ready_url(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline().decode()
    assert line.startswith("READY gateway "), f"gateway did not start: {line!r}"
    return "http://" + line.split()[-1]


def test_two_gateway_processes_share_one_limit(tiny_qwen3_path, fakes, redis_server, tmp_path):  # noqa: F811
    keys = write_keys(tmp_path / "keys", [(KEY_ALPHA, "alpha", {"requests_per_min": 6})])
    procs = [
        _start_gateway_process(tiny_qwen3_path, fakes[0][1], redis_server.url, keys)
        for _ in range(2)
    ]
    try:
        urls = [_ready_url(p) for p in procs]
        statuses = []
        for i in range(12):
            try:
                chat(urls[i % 2], KEY_ALPHA)
                statuses.append(200)
            except openai.RateLimitError:
                statuses.append(429)
        assert statuses.count(200) == 6 and statuses[:6] == [200] * 6
        with pytest.raises(openai.AuthenticationError):
            chat(urls[0], KEY_BETA)
    finally:
        for p in procs:
            p.terminate()
        logs = "".join(p.communicate(timeout=20)[1].decode() for p in procs)
    assert "POST /v1/chat/completions 429" in logs and "tenant=alpha" in logs
    for secret in (KEY_ALPHA, KEY_BETA):
        assert secret not in logs and hash_prefix(secret) not in logs
