"""vLLM's POST /tokenize and /detokenize: off by default, behind auth, ids as the tokenizer's."""

from __future__ import annotations

import httpx
import pytest

from engine.tokenizer import apply_chat_template
from tests.gateway.conftest import MAX_MODEL_LEN, SERVED_NAME
from tests.gateway.edge_util import KEY_ALPHA, MESSAGES, edge_gateway

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tok_url(tiny_qwen3_path, model_info):
    with edge_gateway(tiny_qwen3_path, model_info, enable_tokenizer_endpoints=True) as (url, _):
        yield url


def test_off_by_default(gateway_url):
    for path in ("/tokenize", "/detokenize"):
        resp = httpx.post(f"{gateway_url}{path}", json={"model": SERVED_NAME, "prompt": "x"})
        assert resp.status_code == 404 and resp.json()["error"]["type"] == "NotFoundError"


def test_tokenize_prompt(tok_url, model_info):
    body = {"model": SERVED_NAME, "prompt": PROMPT}
    resp = httpx.post(f"{tok_url}/tokenize", json=body)
    assert resp.status_code == 200, resp.text
    ids = list(model_info.tokenizer.encode(PROMPT, add_special_tokens=True))
    assert resp.json() == {
        "count": len(ids),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": ids,
        "token_strs": None,
    }
    body["add_special_tokens"] = False
    plain = list(model_info.tokenizer.encode(PROMPT, add_special_tokens=False))
    assert httpx.post(f"{tok_url}/tokenize", json=body).json()["tokens"] == plain


def test_tokenize_messages_matches_chat_template(tok_url, model_info):
    resp = httpx.post(f"{tok_url}/tokenize", json={"model": SERVED_NAME, "messages": MESSAGES})
    assert resp.status_code == 200, resp.text
    ids = apply_chat_template(model_info.tokenizer, MESSAGES, add_generation_prompt=True)
    assert resp.json()["tokens"] == ids and resp.json()["count"] == len(ids)


def test_tokenize_token_strs(tok_url, model_info):
    body = {"prompt": PROMPT, "return_token_strs": True}  # no model: the served one (vLLM)
    out = httpx.post(f"{tok_url}/tokenize", json=body).json()
    assert out["token_strs"] == model_info.tokenizer.convert_ids_to_tokens(out["tokens"])


def test_detokenize_round_trip(tok_url, model_info):
    ids = list(model_info.tokenizer.encode(PROMPT, add_special_tokens=False))
    resp = httpx.post(f"{tok_url}/detokenize", json={"model": SERVED_NAME, "tokens": ids})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"prompt": model_info.tokenizer.decode(ids)} == {"prompt": PROMPT}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"model": "nope", "prompt": "x"}, "model"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, "model"),
        ("/tokenize", {"model": SERVED_NAME}, None),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, None),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ],
)
def test_bad_requests(tok_url, path, body, param):
    resp = httpx.post(f"{tok_url}{path}", json=body)
    assert resp.status_code == (404 if param == "model" else 400), resp.text
    assert resp.json()["error"]["param"] == param


def test_behind_auth_when_keys_are_configured(tiny_qwen3_path, model_info):
    overrides = dict(api_keys=KEY_ALPHA, enable_tokenizer_endpoints=True)
    with edge_gateway(tiny_qwen3_path, model_info, **overrides) as (url, _):
        body = {"prompt": PROMPT}
        assert httpx.post(f"{url}/tokenize", json=body).status_code == 401
        assert httpx.post(f"{url}/detokenize", json={"tokens": [1]}).status_code == 401
        auth = {"Authorization": f"Bearer {KEY_ALPHA}"}
        assert httpx.post(f"{url}/tokenize", json=body, headers=auth).status_code == 200
        # /v1/models/{model} follows /v1/models: behind the key unless public_models.
        assert httpx.get(f"{url}/v1/models/{SERVED_NAME}").status_code == 401
    overrides = dict(api_keys=KEY_ALPHA, public_models=True)
    with edge_gateway(tiny_qwen3_path, model_info, **overrides) as (url, _):
        assert httpx.get(f"{url}/v1/models/{SERVED_NAME}").status_code == 200


def test_flag_turns_them_on():
    from gateway.__main__ import parse_args, settings_from_args

    args = parse_args(["--model", "m", "--decode", "h:1", "--enable-tokenizer-endpoints"])
    assert settings_from_args(args).enable_tokenizer_endpoints
    args = parse_args(["--model", "m", "--decode", "h:1"])
    assert not settings_from_args(args).enable_tokenizer_endpoints
