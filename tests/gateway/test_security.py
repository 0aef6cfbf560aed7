"""The edge: path allowlist, CORS, body size, internal metrics, caps, tenant cache salts."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.gateway.conftest import SERVED_NAME
from tests.gateway.edge_util import (
    KEY_ALPHA,
    KEY_ALPHA_2,
    KEY_BETA,
    KEY_GAMMA,
    MESSAGES,
    chat,
    edge_gateway,
    wait_for,
    write_keys,
)

NOT_ALLOWED = [
    "/docs",
    "/redoc",
    "/openapi.json",
    "/metrics",
    "/health/",
    "/HEALTH",
    "/Health",
    "//health",
    "/v1/models/",
    "/V1/models",
    "/tokenize",  # vLLM's tokenizer routes: off unless enable_tokenizer_endpoints
    "/detokenize",
    "/v1/chat/completions/",
    "/v1/Chat/Completions",
    "/v1",
    "/",
    "/v1/embeddings",
    "/v1/responses",
    "/admin",
    "/debug/pprof",
    "/v1/%2E%2E/health",  # dot segments reach the server encoded
]


@pytest.fixture(scope="module")
def secured(tiny_qwen3_path, model_info, fakes, tmp_path_factory):
    path = write_keys(
        tmp_path_factory.mktemp("keys") / "keys",
        [
            (KEY_ALPHA, "alpha", {"max_tokens": 8, "max_n": 2}),
            (KEY_ALPHA_2, "alpha", None),
            (KEY_BETA, "beta", None),
            (KEY_GAMMA, "gamma", {"trust_group": "beta-and-gamma"}),
        ],
    )
    overrides = dict(decode=[fakes[0][1]], api_keys_file=path, metrics_port=0)
    with edge_gateway(tiny_qwen3_path, model_info, **overrides) as (url, state):
        yield url, state


def _auth(key: str = KEY_ALPHA) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _completion(url: str, key: str, **body) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions", json={"max_tokens": 2, **body}, headers=_auth(key), timeout=30
    )


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_paths_outside_the_allowlist_are_404(secured, method):
    url, _ = secured
    for path in NOT_ALLOWED:
        for headers in ({}, _auth()):
            resp = httpx.request(method, f"{url}{path}", headers=headers, json={})
            assert resp.status_code == 404, (path, resp.status_code)
            error = resp.json()["error"]
            assert error["type"] == "NotFoundError" and error["code"] == 404


def test_other_methods_are_405(secured):
    url, _ = secured
    cases = [
        ("GET", "/v1/chat/completions"),
        ("PUT", "/v1/completions"),
        ("DELETE", "/v1/models"),
        ("POST", "/health"),
        ("HEAD", "/version"),
        ("OPTIONS", "/v1/chat/completions"),  # CORS closed: no preflight handling
    ]
    for method, path in cases:
        resp = httpx.request(method, f"{url}{path}", headers=_auth())
        assert resp.status_code == 405, (method, path)
        assert "allow" in resp.headers and "access-control-allow-origin" not in resp.headers
        if method != "HEAD":
            assert resp.json()["error"]["type"] == "MethodNotAllowedError"


def test_cors_is_closed_by_default_and_configurable(secured, tiny_qwen3_path, model_info, fakes):
    url, _ = secured
    origin = {"Origin": "https://evil.example"}
    resp = httpx.get(f"{url}/v1/models", headers={**origin, **_auth()})
    assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers
    overrides = dict(decode=[fakes[0][1]], cors_origins="https://app.example")
    with edge_gateway(tiny_qwen3_path, model_info, **overrides) as (open_url, _):
        preflight = {
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        resp = httpx.options(f"{open_url}/v1/chat/completions", headers=preflight)
        assert resp.status_code == 200
        assert resp.headers["access-control-allow-origin"] == "https://app.example"
        resp = httpx.options(f"{open_url}/v1/chat/completions", headers={**preflight, **origin})
        assert "access-control-allow-origin" not in resp.headers


def test_large_bodies_are_413(secured):
    url, _ = secured
    big = {"model": SERVED_NAME, "prompt": "x" * (9 * 1024 * 1024)}
    resp = httpx.post(f"{url}/v1/completions", json=big, headers=_auth())
    assert resp.status_code == 413 and resp.json()["error"]["code"] == 413

    def chunked():
        yield b'{"prompt": "'
        for _ in range(9):
            yield b"x" * (1024 * 1024)
        yield b'"}'

    resp = httpx.post(f"{url}/v1/completions", content=chunked(), headers=_auth())
    assert resp.status_code == 413


def test_metrics_only_on_the_internal_port(secured):
    url, state = secured
    assert httpx.get(f"{url}/metrics").status_code == 404
    assert httpx.get(f"{url}/metrics", headers=_auth()).status_code == 404
    chat(url, KEY_ALPHA)
    assert [c for c in chat(url, KEY_ALPHA, stream=True)]  # TTFT: observed for streams
    with pytest.raises(openai.AuthenticationError):
        chat(url, "sk-wrong-key-000000000000")
    host, port = state.edge.metrics_address
    assert host == "127.0.0.1" and port != int(url.rsplit(":", 1)[1])
    label = f'{{model_name="{SERVED_NAME}"}}'

    def metrics() -> str:
        return httpx.get(f"http://{host}:{port}/metrics").text

    def sample(text: str, name: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith(name + label + " "))
        return float(line.rsplit(" ", 1)[1])

    # Observed in batches (gateway/bookkeeping.py): both chats' observations, then read.
    wait_for(lambda: sample(metrics(), "vllm:e2e_request_latency_seconds_count") == 2)
    text = metrics()
    for name in (
        "vllm:request_success_total",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        'tandem:auth_failures_total{reason="invalid"}',
        "tandem:quota_rejections_total",
        "tandem:degraded 0.0",
    ):
        assert name in text, name
    assert f'vllm:request_success_total{{finished_reason="length",model_name="{SERVED_NAME}"}}' in (
        text
    )
    # The gateway's own part of the TTFT (arrival to ready for a decode), one per request.
    assert [c for c in chat(url, KEY_ALPHA, stream=True)]
    wait_for(lambda: sample(metrics(), "vllm:e2e_request_latency_seconds_count") == 3)
    after = metrics()
    grew = {
        name: sample(after, name) - sample(text, name)
        for name in (
            "tandem:request_prepare_seconds_count",
            "tandem:request_prepare_seconds_sum",
            "vllm:time_to_first_token_seconds_sum",
            "vllm:generation_tokens_total",
        )
    }
    assert grew["tandem:request_prepare_seconds_count"] == 1
    assert grew["vllm:generation_tokens_total"] >= 1
    assert 0 < grew["tandem:request_prepare_seconds_sum"]
    assert grew["tandem:request_prepare_seconds_sum"] < grew["vllm:time_to_first_token_seconds_sum"]


def test_caps_on_n_and_max_tokens(secured, fake):
    url, _ = secured
    with pytest.raises(openai.BadRequestError, match="limit of 2 choices") as info:
        chat(url, KEY_ALPHA, n=3)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError, match="above this key's limit of 8") as info:
        chat(url, KEY_ALPHA, max_tokens=9)
    assert info.value.body["param"] == "max_tokens"
    resp = _completion(url, KEY_ALPHA, prompt=["a", "b"], n=2)
    assert resp.status_code == 400 and "n * prompts (2 * 2)" in resp.json()["error"]["message"]
    # No max_tokens: the default is capped, not refused.
    sdk_chat = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_ALPHA, max_retries=0)
    sdk_chat.chat.completions.create(model=SERVED_NAME, messages=MESSAGES)
    assert fake.record.requests[-1].params.max_tokens == 8
    # Another key of the same tenant has the defaults (caps are per key).
    assert chat(url, KEY_ALPHA_2, n=3, max_tokens=9).choices


def test_cache_salt_is_the_tenants(secured, fake):
    url, _ = secured
    for key in (KEY_ALPHA, KEY_ALPHA_2, KEY_BETA, KEY_GAMMA):
        chat(url, key)
        chat(url, key, stream=True).close()
        assert _completion(url, key, prompt="Hi").status_code == 200
    salts = [r.cache_salt for r in fake.record.requests]
    alpha, beta, gamma = salts[:6], salts[6:9], salts[9:]
    assert len(set(alpha)) == 1 and len(set(beta)) == 1 and len(set(gamma)) == 1
    assert alpha[0] == "tenant:alpha" and beta[0] == "tenant:beta"
    assert gamma[0] == "group:beta-and-gamma"  # a trust group of its own, not beta's
    # Clients cannot choose (or override) it.
    with pytest.raises(openai.BadRequestError, match="cache_salt is set by the gateway"):
        chat(url, KEY_BETA, extra_body={"cache_salt": "tenant:alpha"})
    resp = _completion(url, KEY_BETA, prompt="Hi", cache_salt="")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt"
    assert len(fake.record.requests) == 12


def test_trust_group_shares_the_salt(tiny_qwen3_path, model_info, fakes, tmp_path):
    fake, address = fakes[0]
    group = {"trust_group": "acme"}
    path = write_keys(tmp_path / "keys", [(KEY_ALPHA, "alpha", group), (KEY_BETA, "beta", group)])
    with edge_gateway(tiny_qwen3_path, model_info, decode=[address], api_keys_file=path) as (
        url,
        _,
    ):
        chat(url, KEY_ALPHA)
        chat(url, KEY_BETA)
    assert [r.cache_salt for r in fake.record.requests] == ["group:acme", "group:acme"]


def test_auth_off_keeps_vllm_cache_salt(client, fake):
    client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=2, extra_body={"cache_salt": "mine"}
    )
    assert fake.record.requests[-1].cache_salt == "mine"
