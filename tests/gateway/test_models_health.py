"""Public metadata routes: /v1/models (vLLM shape), /health, /version."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.gateway.conftest import MAX_MODEL_LEN, SERVED_NAME


def test_models(client, gateway_url, tiny_qwen3_path):
    (model,) = client.models.list().data
    assert model.id == SERVED_NAME and model.object == "model" and model.owned_by == "tandem"
    raw = httpx.get(f"{gateway_url}/v1/models").json()
    assert raw["object"] == "list"
    entry = raw["data"][0]
    assert entry["max_model_len"] == MAX_MODEL_LEN and entry["root"] == str(tiny_qwen3_path)
    assert isinstance(entry["created"], int)


def test_health_and_version(gateway_url):
    resp = httpx.get(f"{gateway_url}/health")
    assert resp.status_code == 200 and resp.json()["num_decodes_reachable"] == 1
    assert httpx.get(f"{gateway_url}/version").json() == {"version": "0.1.0"}


def test_no_debug_routes(gateway_url):
    for path in ("/docs", "/openapi.json", "/redoc", "/metrics"):
        resp = httpx.get(f"{gateway_url}{path}")
        assert resp.status_code == 404 and resp.json()["error"]["type"] == "NotFoundError"


def test_models_retrieve(client, gateway_url):
    """`client.models.retrieve(name)`: the same entry /v1/models lists."""
    model = client.models.retrieve(SERVED_NAME)
    assert model.id == SERVED_NAME and model.object == "model" and model.owned_by == "tandem"
    listed = httpx.get(f"{gateway_url}/v1/models").json()["data"][0]
    assert httpx.get(f"{gateway_url}/v1/models/{SERVED_NAME}").json() == listed


def test_models_retrieve_unknown_is_vllm_404(client, gateway_url):
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body == {
        "message": "The model `no-such-model` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    # A name with a slash (hub ids) is one model name, not a deeper path.
    resp = httpx.get(f"{gateway_url}/v1/models/org/name")
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"
    assert httpx.get(f"{gateway_url}/v1/models/").status_code == 404
