"""Fuzz the public API from its own OpenAPI schema (schemathesis): no 5xx, no crash.

The gateway serves no /openapi.json, so the schema comes from `app.openapi()` in-process; the
cases go over loopback to a real uvicorn server with a valid key (otherwise every case would
stop at the 401) whose `max_tokens` cap is 4, so generations stay short whatever the fuzzer
picks (larger values are 400s, which is fine: only 5xx fail). Bounded: 50 examples per
operation and mode (valid and invalid bodies).
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from gateway.allowlist import ROUTES
from gateway.app import build_state, create_app
from gateway.config import GatewaySettings
from tests.gateway.conftest import MAX_MODEL_LEN, SERVED_NAME, serve
from tests.gateway.edge_util import KEY_ALPHA, KEY_BETA, write_keys

MAX_EXAMPLES = 50


@pytest.fixture(scope="module")
def fuzz_target(tiny_qwen3_path, model_info, fakes, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    write_keys(keys, [(KEY_ALPHA, "alpha", {"max_tokens": 4}), (KEY_BETA, "beta", None)])
    settings = GatewaySettings(
        model=str(tiny_qwen3_path),
        served_model_name=[SERVED_NAME],
        max_model_len=MAX_MODEL_LEN,
        decode=[fakes[0][1]],
        api_keys_file=keys,
    )
    app = create_app(settings, build_state(settings, model=model_info))
    with serve(app) as url:
        yield app, url


@pytest.fixture(scope="module")
def openapi_schema(fuzz_target):
    app, _ = fuzz_target
    return schemathesis.openapi.from_dict(app.openapi())


# Operations come from the allowlist (everything reachable); schemathesis's lazy pytest loader
# does not run under pytest 9, so each operation's strategy is driven with hypothesis directly.
# Invalid inputs only exist for operations that take any (the POST bodies).
OPERATIONS = [
    (method, path, mode)
    for path, methods in ROUTES.items()
    for method in sorted(methods)
    for mode in [GenerationMode.POSITIVE, GenerationMode.NEGATIVE][: 2 if method == "POST" else 1]
]


def _served_model_sometimes(strategy):
    """Random `model` strings all stop at the 404; half the cases name the served model so
    that they reach tokenization, sampling parameters and the decode."""

    def apply(drawn):
        case, use_served = drawn
        if use_served and isinstance(case.body, dict):
            case.body["model"] = SERVED_NAME
        return case

    return st.tuples(strategy, st.booleans()).map(apply)


@pytest.mark.parametrize("method, path, mode", OPERATIONS)
def test_no_server_errors(openapi_schema, fuzz_target, method, path, mode):
    _, url = fuzz_target
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
        case.call_and_validate(
            base_url=url, headers=headers, checks=[not_a_server_error], timeout=30
        )

    fuzz()


def test_gateway_survived_the_fuzzing(fuzz_target):
    _, url = fuzz_target
    assert httpx.get(f"{url}/health").status_code == 200
