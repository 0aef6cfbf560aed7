"""Fuzz the gateway from the OpenAPI schema it serves (schemathesis): no 5xx, no crash, and
every answer is one the schema states (status, content type, headers, body).

The schema is fetched where operators get it, `/openapi.json` on the internal metrics port
(gateway/openapi.py); the public port does not serve it. Cases go over loopback to a real
uvicorn server with a valid key (otherwise every case would stop at the 401) whose `max_tokens`
cap is 4, so generations stay short whatever the fuzzer picks (larger values are 400s, which
the schema states). The tokenizer routes are on, so they are fuzzed too. Bounded: 25 examples
per operation and mode (valid and invalid bodies); half the cases name the served model, so
that they get past the 404 to tokenization, sampling parameters and the decode.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.allowlist import OPTIONAL_ROUTES, ROUTES
from gateway.app import build_state, create_app
from gateway.config import GatewaySettings
from tests.gateway.conftest import MAX_MODEL_LEN, SERVED_NAME, serve
from tests.gateway.edge_util import KEY_ALPHA, KEY_BETA, write_keys

MAX_EXAMPLES = 25
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def fuzz_target(tiny_qwen3_path, model_info, fakes, tmp_path_factory):
    """(public URL, metrics URL) of a gateway with keys, tokenizer routes and a metrics port."""
    keys = tmp_path_factory.mktemp("keys") / "keys"
    write_keys(keys, [(KEY_ALPHA, "alpha", {"max_tokens": 4}), (KEY_BETA, "beta", None)])
    settings = GatewaySettings(
        model=str(tiny_qwen3_path),
        served_model_name=[SERVED_NAME],
        max_model_len=MAX_MODEL_LEN,
        decode=[fakes[0][1]],
        api_keys_file=keys,
        enable_tokenizer_endpoints=True,
        metrics_port=0,
    )
    state = build_state(settings, model=model_info)
    with serve(create_app(settings, state)) as url:
        yield url, "http://{}:{}".format(*state.edge.metrics_address)


@pytest.fixture(scope="module")
def openapi_schema(fuzz_target):
    _, metrics_url = fuzz_target
    return schemathesis.openapi.from_url(f"{metrics_url}/openapi.json")


def test_schema_is_served_internally_only(fuzz_target):
    url, metrics_url = fuzz_target
    headers = {"Authorization": f"Bearer {KEY_ALPHA}"}
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(f"{url}{path}", headers=headers).status_code == 404, path
    r = httpx.get(f"{metrics_url}/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    schema = r.json()
    assert set(schema["paths"]) == set(ROUTES) | set(OPTIONAL_ROUTES)
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert set(chat) == {"200", "400", "401", "404", "413", "429", "500", "503"}
    assert chat["429"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"
    }
    assert "text/event-stream" in chat["200"]["content"]
    operations = [op for ops in schema["paths"].values() for op in ops.values()]
    assert not any("422" in op["responses"] for op in operations)  # validation errors are 400s
    assert httpx.get(f"{metrics_url}/metrics").status_code == 200


# Operations come from the allowlist (everything reachable); schemathesis's lazy pytest loader
# does not run under pytest 9, so each operation's strategy is driven with hypothesis directly.
# Invalid inputs only exist for operations that take any (the POST bodies).
OPERATIONS = [
    (method, path, mode)
    for path, methods in {**ROUTES, **OPTIONAL_ROUTES}.items()
    for method in sorted(methods)
    for mode in [GenerationMode.POSITIVE, GenerationMode.NEGATIVE][: 2 if method == "POST" else 1]
]


def _served_model_sometimes(strategy):
    """Random `model` strings all stop at the 404; half the cases name the served model. A
    `model` that is not a string is an invalid case's point (the 400 it must get): kept."""

    def apply(drawn):
        case, use_served = drawn
        if (
            use_served
            and isinstance(case.body, dict)
            and isinstance(case.body.get("model", ""), str)
        ):
            case.body["model"] = SERVED_NAME
        return case

    return st.tuples(strategy, st.booleans()).map(apply)


@pytest.mark.parametrize("method, path, mode", OPERATIONS)
def test_answers_match_the_schema(openapi_schema, fuzz_target, method, path, mode):
    url, _ = fuzz_target
    assert url.startswith("http://127.0.0.1:")
    operation = openapi_schema[path][method]
    headers = {"Authorization": f"Bearer {KEY_ALPHA}"}

    @given(case=_served_model_sometimes(operation.as_strategy(generation_mode=mode)))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def fuzz(case) -> None:
        case.call_and_validate(base_url=url, headers=headers, checks=CHECKS, timeout=30)

    fuzz()


def test_gateway_survived_the_fuzzing(fuzz_target):
    url, _ = fuzz_target
    assert httpx.get(f"{url}/health").status_code == 200
