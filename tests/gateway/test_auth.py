"""API keys: 401s in OpenAI's shape, public routes, key sources, and keys never in logs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import httpx
import openai
import pytest

from gateway.__main__ import parse_args
from gateway.auth import KeyStore
from gateway.config import GatewaySettings
from tests.gateway.conftest import SERVED_NAME
from tests.gateway.edge_util import (
    KEY_ALPHA,
    KEY_ALPHA_2,
    KEY_BETA,
    KEY_GAMMA,
    MESSAGES,
    chat,
    edge_gateway,
    hash_prefix,
    sdk,
    wait_for,
    write_keys,
)


@pytest.fixture(scope="module")
def keyed(tiny_qwen3_path, model_info, fakes):
    keys = f"{KEY_ALPHA}:alpha, {KEY_BETA}:beta"
    with edge_gateway(tiny_qwen3_path, model_info, decode=[fakes[0][1]], api_keys=keys) as (
        url,
        state,
    ):
        yield url, state


def _assert_401(resp: httpx.Response, *, secret: str | None = None) -> dict:
    assert resp.status_code == 401
    assert resp.headers["www-authenticate"] == "Bearer"
    error = resp.json()["error"]
    assert error["type"] == "AuthenticationError" and error["code"] == 401
    if secret:
        assert secret not in resp.text
    return error


def test_requests_need_a_valid_key(keyed):
    url, _ = keyed
    assert chat(url, KEY_ALPHA).choices[0].finish_reason is not None
    assert chat(url, KEY_BETA).choices[0].finish_reason is not None
    wrong = KEY_ALPHA[:-1] + "x"
    with pytest.raises(openai.AuthenticationError) as info:
        chat(url, wrong)
    assert info.value.body["message"] == "Incorrect API key provided."
    assert wrong not in str(info.value.body)
    body = {"model": SERVED_NAME, "messages": MESSAGES}
    missing = _assert_401(httpx.post(f"{url}/v1/chat/completions", json=body))
    assert "didn't provide an API key" in missing["message"]
    for header in (f"Basic {KEY_ALPHA}", KEY_ALPHA, "Bearer", f"Bearer  {wrong}"):
        resp = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": header})
        _assert_401(resp, secret=KEY_ALPHA)


def test_auth_comes_before_body_parsing(keyed):
    url, _ = keyed
    resp = httpx.post(f"{url}/v1/completions", content=b"{not json")
    _assert_401(resp)


def test_public_routes_need_no_key(keyed):
    """vLLM's unauthenticated routes, /health and /version; the model list needs the key, as in
    vLLM and OpenAI (an SDK sends it anyway)."""
    url, _ = keyed
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/version").status_code == 200
    for path in ("/v1/models", f"/v1/models/{SERVED_NAME}"):
        _assert_401(httpx.get(f"{url}{path}"))
    with pytest.raises(openai.AuthenticationError):
        sdk(url, "not-a-key").models.list()
    (model,) = sdk(url, KEY_BETA).models.list().data
    assert model.id == SERVED_NAME


def test_public_routes_can_be_changed(tiny_qwen3_path, model_info, fakes):
    overrides = dict(api_keys=KEY_ALPHA, public_health=False, public_models=True)
    with edge_gateway(tiny_qwen3_path, model_info, decode=[fakes[0][1]], **overrides) as (url, _):
        _assert_401(httpx.get(f"{url}/health"))
        auth = {"Authorization": f"Bearer {KEY_ALPHA}"}
        assert httpx.get(f"{url}/health", headers=auth).status_code == 200
        assert httpx.get(f"{url}/v1/models").status_code == 200


def test_key_file_tenants_and_limits(tmp_path):
    path = write_keys(
        tmp_path / "keys",
        [
            (KEY_ALPHA, "alpha", {"requests_per_min": 5, "max_n": 2, "trust_group": "acme"}),
            (KEY_ALPHA_2, "alpha", {"trust_group": "acme"}),
            (KEY_BETA, "beta", None),
        ],
    )
    settings = GatewaySettings(model="m", api_keys_file=path, default_tokens_per_min=1000)
    store = KeyStore.from_settings(settings)
    alpha = store.authenticate(KEY_ALPHA.encode())
    assert alpha is not None and alpha.tenant == "alpha" and alpha.cache_salt == "group:acme"
    assert (alpha.limits.requests_per_min, alpha.limits.max_n) == (5, 2)
    assert alpha.limits.tokens_per_min == 1000  # from the defaults
    alpha_2 = store.authenticate(KEY_ALPHA_2.encode())
    assert alpha_2 is not None and alpha_2.quota_id != alpha.quota_id  # quotas are per key
    beta = store.authenticate(KEY_BETA.encode())
    assert beta is not None and beta.cache_salt == "tenant:beta" and beta.trust_group is None
    assert store.authenticate(b"nope") is None
    # Bare keys (env) belong to the default tenant.
    store = KeyStore.from_settings(GatewaySettings(model="m", api_keys=KEY_GAMMA))
    assert store.authenticate(KEY_GAMMA.encode()).tenant == "default"


@pytest.mark.parametrize(
    "line, message",
    [
        (f"{KEY_ALPHA}:bad tenant!", "tenant must match"),
        (f"{KEY_ALPHA}:t:{{not json", "not valid JSON"),
        (f'{KEY_ALPHA}:t:{{"rpm": 1}}', "unknown limit field"),
        (f'{KEY_ALPHA}:t:{{"max_n": 0}}', "max_n must be an integer >= 1"),
        (f"{KEY_ALPHA}:t\n{KEY_ALPHA}:u", "duplicate key"),
        (":t", "empty key"),
    ],
)
def test_key_file_errors_name_lines_not_keys(tmp_path, line, message):
    path = tmp_path / "keys"
    path.write_text(f"# comment\n\n{line}\n")
    with pytest.raises(ValueError, match=message) as info:
        KeyStore.from_settings(GatewaySettings(model="m", api_keys_file=path))
    assert "TANDEM_API_KEYS_FILE line" in str(info.value)
    assert KEY_ALPHA not in str(info.value)


def test_many_keys_each_find_their_tenant(tmp_path):
    """A key file of thousands of keys (a multi-tenant gateway): every key finds its own tenant,
    a key one character off finds nothing, and a duplicate of the first key on the last line is
    refused by that line's number."""
    keys = [f"sk-{i:06d}-{'x' * 24}" for i in range(5000)]
    path = tmp_path / "keys"
    path.write_text("".join(f"{key}:tenant{i}\n" for i, key in enumerate(keys)))
    store = KeyStore.from_settings(GatewaySettings(model="m", api_keys_file=path))
    for i, key in enumerate(keys):
        assert store.authenticate(key.encode()).tenant == f"tenant{i}"
        assert store.authenticate(key[:-1].encode() + b"y") is None
    path.write_text(path.read_text() + f"{keys[0]}:other\n")
    with pytest.raises(ValueError, match="line 5001: duplicate key"):
        KeyStore.from_settings(GatewaySettings(model="m", api_keys_file=path))


def test_keys_never_come_from_argv_or_reprs(monkeypatch):
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--api-keys", KEY_ALPHA])
    monkeypatch.setenv("TANDEM_API_KEYS", KEY_ALPHA)
    settings = GatewaySettings(model="m")
    assert KEY_ALPHA not in repr(settings) and KEY_ALPHA not in str(settings.model_dump())
    assert settings.api_keys.get_secret_value() == KEY_ALPHA
    with pytest.raises(ValueError, match="limits can only be set in TANDEM_API_KEYS_FILE"):
        KeyStore.from_settings(GatewaySettings(model="m", api_keys=f'{KEY_ALPHA}:t:{{"a":1}}'))


@pytest.mark.parametrize("value", [" ", ",", "#x", ""])
def test_key_variable_without_keys_refuses_to_start(monkeypatch, value):
    """Set but holding no key: a slip (a blank template value, a commented-out key) must not
    turn auth off; the message says how to run without auth on purpose."""
    monkeypatch.setenv("TANDEM_API_KEYS", value)
    with pytest.raises(ValueError, match="TANDEM_API_KEYS is set but holds no key") as info:
        KeyStore.from_settings(GatewaySettings(model="m"))
    assert "unset TANDEM_API_KEYS" in str(info.value) and "Give at least one key" in str(info.value)


@pytest.mark.parametrize("text", ["", "# tandem keys\n\n   \n# sk-old-key:alpha\n"])
def test_key_file_without_keys_refuses_to_start(tmp_path, text):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match="TANDEM_API_KEYS_FILE .* is set but holds no key") as e:
        KeyStore.from_settings(GatewaySettings(model="m", api_keys_file=path))
    assert str(path) in str(e.value) and "unset TANDEM_API_KEYS_FILE" in str(e.value)
    # A blank variable next to a good file is a slip all the same.
    good = write_keys(tmp_path / "good", [(KEY_ALPHA, "alpha", None)])
    with pytest.raises(ValueError, match="TANDEM_API_KEYS is set but holds no key"):
        KeyStore.from_settings(GatewaySettings(model="m", api_keys=" ", api_keys_file=good))


def test_gateway_with_blank_keys_does_not_start(tiny_qwen3_path):
    """`python -m gateway` exits with the message instead of serving without auth."""
    env = {**os.environ, "TANDEM_API_KEYS": ",", "PYTHONUNBUFFERED": "1"}
    env.pop("TANDEM_API_KEYS_FILE", None)
    args = [sys.executable, "-m", "gateway", "--model", str(tiny_qwen3_path), "--port", "0"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the gateway did not exit (it served): {out.decode()[-300:]!r}")
    assert proc.returncode != 0 and b"READY gateway" not in out
    assert "TANDEM_API_KEYS is set but holds no key" in err.decode()
    assert "AUTH IS OFF" not in err.decode()


def test_auth_off_is_announced(tiny_qwen3_path, model_info, caplog):
    with caplog.at_level(logging.WARNING, logger="gateway"):
        with edge_gateway(tiny_qwen3_path, model_info) as _:
            pass
    assert "AUTH IS OFF" in caplog.text


def test_keys_never_appear_in_logs(keyed, caplog):
    url, _ = keyed
    wrong = "sk-tandem-wrong-9988776655443322"
    secrets = [KEY_ALPHA, KEY_BETA, wrong]
    with caplog.at_level(logging.DEBUG):
        chat(url, KEY_ALPHA)
        chat(url, KEY_BETA, stream=True).close()
        with pytest.raises(openai.AuthenticationError):
            chat(url, wrong)
        with pytest.raises(openai.BadRequestError):  # an error after auth
            chat(url, KEY_ALPHA, top_p=7)
        httpx.get(f"{url}/v1/{KEY_ALPHA}")  # a key in a path: 404, path not logged
        httpx.get(f"{url}/health?key={KEY_BETA}")
        httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {wrong}\x7f"})
        # Access-log lines are written in batches, in order (gateway/bookkeeping.py): the last
        # one (the request before is refused by the HTTP parser, before any app code runs).
        wait_for(lambda: any("GET /health 200" in r.getMessage() for r in caplog.records))
    # The gateway's records only: the test's own HTTP clients log URLs (with that query key).
    client_side = ("httpx", "httpcore", "openai")
    records = [r for r in caplog.records if not r.name.startswith(client_side)]
    text = "\n".join(caplog.handler.format(r) for r in records)
    assert "POST /v1/chat/completions 200" in text and "tenant=alpha" in text  # logs work
    assert "<not allowed>" in text
    for secret in secrets:
        assert secret not in text
        assert hash_prefix(secret) not in text and hash_prefix(secret, 6) not in text
