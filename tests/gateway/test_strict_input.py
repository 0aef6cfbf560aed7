"""Strict, safe input: what a careless or hostile client can send is a 400, never a 200 with
garbage or a 500 (each case was reproduced against the server with the `openai` SDK / httpx).

Bodies with NaN literals, lone surrogates or out-of-range integers are sent raw: the SDK's own
JSON encoder would refuse some of them, a client in another language would not.
"""

from __future__ import annotations

import json
from concurrent import futures

import grpc
import httpx
import openai
import pytest

from protos import common_pb2, decode_mux, decode_pb2, decode_pb2_grpc
from tests.gateway.conftest import SERVED_NAME
from tests.gateway.edge_util import KEY_ALPHA, KEY_BETA, MESSAGES, edge_gateway, write_keys

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BASE = {
    CHAT: f'"model": "{SERVED_NAME}", "messages": [{{"role": "user", "content": "Hi"}}]',
    COMPLETIONS: f'"model": "{SERVED_NAME}", "prompt": "Hi"',
}
INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1


def _post_raw(url: str, path: str, fields: str, **kwargs) -> httpx.Response:
    """POST `{BASE, fields}` as bytes, exactly as written (NaN literals, escapes, big numbers)."""
    body = "{" + BASE[path] + (", " + fields if fields else "") + "}"
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(f"{url}{path}", content=body.encode(), headers=headers, timeout=30, **kwargs)


def _error(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


# ---- NaN / Infinity in float sampling values (before: 200, sampling with garbage) ----

FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_non_finite_floats_are_400(gateway_url, fake, path, literal, field):
    resp = _post_raw(gateway_url, path, f'"{field}": {literal}, "max_tokens": 1')
    error = _error(resp)
    assert field in error["message"] and "finite" in error["message"]
    assert fake.record.requests == []  # refused before any decode saw it


# ---- integers beyond the proto's int32 / int64 (before: 500 from protobuf) ----

BIG_INTS = [
    (CHAT, "top_k", INT32_MAX + 1),
    (CHAT, "top_k", -(2**31) - 1),
    (CHAT, "priority", INT32_MAX + 1),
    (CHAT, "priority", -(2**40)),
    (CHAT, "min_tokens", INT32_MAX + 1),
    (CHAT, "max_tokens", 2**40),
    (CHAT, "max_completion_tokens", 2**40),
    (CHAT, "n", 2**40),
    (CHAT, "top_logprobs", 2**40),
    (CHAT, "seed", INT64_MAX + 1),
    (COMPLETIONS, "top_k", 2**63),
    (COMPLETIONS, "priority", INT32_MAX + 1),
    (COMPLETIONS, "logprobs", 2**40),
    (COMPLETIONS, "max_tokens", 2**64),
    (COMPLETIONS, "n", 2**64),
    (COMPLETIONS, "seed", -(2**63) - 1),
]


@pytest.mark.parametrize("path, field, value", BIG_INTS)
def test_integers_out_of_range_are_400(gateway_url, fake, path, field, value):
    resp = _post_raw(gateway_url, path, f'"{field}": {value}')
    assert field in _error(resp)["message"]
    assert fake.record.requests == []


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stop_token_ids_beyond_int32_are_400(gateway_url, fake, path):
    resp = _post_raw(gateway_url, path, f'"stop_token_ids": [7, {INT32_MAX + 1}]')
    assert "stop_token_ids" in _error(resp)["message"]
    assert fake.record.requests == []


def test_int32_limits_themselves_are_accepted(gateway_url, fake):
    """The bounds are the proto's, not tighter: these reach the decode unchanged."""
    fields = f'"top_k": {INT32_MAX}, "priority": {-(2**31)}, "seed": {INT64_MAX}, "max_tokens": 1'
    resp = _post_raw(gateway_url, COMPLETIONS, fields)
    assert resp.status_code == 200, resp.text
    (req,) = fake.record.requests
    assert (req.params.top_k, req.priority, req.params.seed) == (INT32_MAX, -(2**31), INT64_MAX)


# ---- lone UTF-16 surrogates (before: 500) ----

SURROGATES = [
    (COMPLETIONS, '"prompt": "Hi \\ud800 there"'),
    (COMPLETIONS, '"prompt": ["ok", "\\udfff"]'),
    (CHAT, '"messages": [{"role": "user", "content": "Hi \\ud800"}]'),
    (CHAT, '"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]'),
    (CHAT, '"messages": [{"role": "user\\ud800", "content": "Hi"}]'),
    (COMPLETIONS, '"stop": ["\\ud83d"]'),
    (COMPLETIONS, '"user": "\\ud800"'),
]


@pytest.mark.parametrize("path, fields", SURROGATES)
def test_lone_surrogates_are_400(gateway_url, fake, path, fields):
    # `fields` may override the base prompt/messages: JSON objects keep the last duplicate key.
    error = _error(_post_raw(gateway_url, path, fields + ', "max_tokens": 1'))
    assert "surrogate" in error["message"]
    assert fake.record.requests == []


def test_lone_surrogate_in_model_name_is_400_not_an_echo(gateway_url):
    resp = _post_raw(gateway_url, CHAT, '"model": "x\\ud800"')
    assert "surrogate" in _error(resp)["message"]


def test_escaped_surrogate_pairs_are_valid_text(gateway_url):
    """A *pair* is one character (here U+1F600): fine."""
    resp = _post_raw(gateway_url, COMPLETIONS, '"prompt": "Hi \\ud83d\\ude00", "max_tokens": 1')
    assert resp.status_code == 200, resp.text


def test_invalid_utf8_body_is_400(gateway_url):
    body = b'{"prompt": "Hi \xff\xfe", "max_tokens": 1}'
    resp = httpx.post(
        f"{gateway_url}{COMPLETIONS}", content=body, headers={"content-type": "application/json"}
    )
    _error(resp)


# ---- strict types: no bool-as-int, no strings for numbers or bools (before: 200) ----

WRONG_TYPES = [
    (CHAT, "max_tokens", "true"),
    (CHAT, "stream", '"yes"'),
    (CHAT, "n", "1.5"),
    (CHAT, "n", "1.0"),
    (CHAT, "temperature", '"0.5"'),
    (CHAT, "temperature", "true"),
    (CHAT, "logprobs", "1"),
    (CHAT, "top_k", '"5"'),
    (CHAT, "ignore_eos", '"true"'),
    (CHAT, "seed", "false"),
    (CHAT, "stream_options", '{"include_usage": "yes"}'),
    (COMPLETIONS, "max_tokens", "true"),
    (COMPLETIONS, "stream", '"yes"'),
    (COMPLETIONS, "n", "1.5"),
    (COMPLETIONS, "temperature", '"0.5"'),
    (COMPLETIONS, "logprobs", "true"),
    (COMPLETIONS, "prompt", "[1, true]"),
    (COMPLETIONS, "stop_token_ids", "[true]"),
]


@pytest.mark.parametrize("path, field, literal", WRONG_TYPES)
def test_wrong_types_are_400(gateway_url, fake, path, field, literal):
    extra = ', "stream": true' if field == "stream_options" else ""
    error = _error(_post_raw(gateway_url, path, f'"{field}": {literal}{extra}'))
    assert field in error["message"]
    assert fake.record.requests == []


def test_sdk_sees_strict_types_as_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=True)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=SERVED_NAME, prompt="x", temperature="0.5")


def test_ints_are_fine_for_floats(gateway_url, fake):
    resp = _post_raw(gateway_url, COMPLETIONS, '"temperature": 1, "top_p": 1, "max_tokens": 1')
    assert resp.status_code == 200, resp.text
    assert fake.record.requests[0].params.temperature == 1.0


# ---- unknown model names are not echoed in full ----


def test_unknown_model_name_is_truncated_in_the_404(client):
    name = "m" * 300 + "TAIL" + "z" * 10_000
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model=name, messages=MESSAGES)
    message = info.value.body["message"]
    assert "m" * 256 in message and "TAIL" not in message
    assert len(message) < 256 + 100
    short = "unknown-model"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model=short, prompt="x")
    assert info.value.body["message"] == f"The model `{short}` does not exist."


# ---- duplicate Authorization headers (before: the last one won) ----


@pytest.fixture(scope="module")
def keyed(tiny_qwen3_path, model_info, fakes, tmp_path_factory):
    path = write_keys(
        tmp_path_factory.mktemp("keys") / "keys",
        [(KEY_ALPHA, "alpha", None), (KEY_BETA, "beta", None)],
    )
    overrides = dict(decode=[fakes[0][1]], api_keys_file=path)
    with edge_gateway(tiny_qwen3_path, model_info, **overrides) as (url, _):
        yield url


@pytest.mark.parametrize(
    "values",
    [
        ["Bearer wrong-key-0000000000", f"Bearer {KEY_ALPHA}"],
        [f"Bearer {KEY_ALPHA}", f"Bearer {KEY_BETA}"],
        [f"Bearer {KEY_ALPHA}", f"Bearer {KEY_ALPHA}"],
    ],
)
def test_duplicate_authorization_headers_are_400(keyed, fake, values):
    headers = [("Authorization", v) for v in values] + [("Content-Type", "application/json")]
    body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    resp = httpx.post(f"{keyed}{COMPLETIONS}", content=body, headers=headers)
    error = _error(resp)
    assert "Authorization" in error["message"]
    assert KEY_ALPHA not in resp.text and KEY_BETA not in resp.text
    assert fake.record.requests == []
    # One header is still fine.
    ok = httpx.post(
        f"{keyed}{COMPLETIONS}", content=body, headers=[*headers[1:2], headers[-1]], timeout=30
    )
    assert ok.status_code == 200, ok.text


# ---- decode failures never show gRPC internals to the client ----

LEAKY_DETAIL = (
    "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:50999: "
    'Connection refused {created_time:"2024", grpc_status:14, debug_error_string:"UNKNOWN"}'
)
INTERNALS = [
    "ipv4:",
    "127.0.0.1",
    "debug_error_string",
    "grpc_status",
    "UNAVAILABLE",
    "INTERNAL",
    "DECODE_FAILED",
    "UNKNOWN",
    "Traceback",
]


class FailingDecode(decode_mux.DecodeServicer):
    """A decode that fails the way real ones do: a gRPC status (before or after some tokens)
    or an Error event whose message is an internal exception's text."""

    def __init__(self):
        self.mode = "status_after_tokens"

    def Generate(self, request, context):
        if self.mode == "status_before_tokens":
            context.abort(grpc.StatusCode.INTERNAL, LEAKY_DETAIL)
        yield decode_pb2.GenerateResponse(tokens=decode_pb2.TokenChunk(token_ids=[100, 101]))
        if self.mode == "status_after_tokens":
            context.abort(grpc.StatusCode.UNAVAILABLE, LEAKY_DETAIL)
        code = common_pb2.Error.DECODE_FAILED if self.mode == "event" else common_pb2.Error.UNKNOWN
        yield decode_pb2.GenerateResponse(error=common_pb2.Error(code=code, message=LEAKY_DETAIL))

    def Abort(self, request, context):
        return common_pb2.AbortResponse(found=False)

    def GetLoad(self, request, context):
        return common_pb2.LoadResponse(instance_id="failing", max_model_len=256)


@pytest.fixture(scope="module")
def failing(gateway_for):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = FailingDecode()
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with gateway_for(decode=[f"127.0.0.1:{port}"]) as url:
            yield url, servicer
    finally:
        server.stop(grace=None)


def _assert_no_internals(text: str) -> None:
    for needle in INTERNALS:
        assert needle not in text, (needle, text)


@pytest.mark.parametrize("mode", ["status_after_tokens", "event", "event_unknown"])
def test_mid_stream_errors_hide_grpc_detail(failing, mode, caplog):
    url, servicer = failing
    servicer.mode = mode
    body = {"prompt": "Hi", "max_tokens": 10, "stream": True}
    with caplog.at_level("WARNING", logger="gateway"):
        with httpx.stream("POST", f"{url}{COMPLETIONS}", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 500 and error["type"] == "InternalServerError"
    assert "retry" in error["message"].lower()
    _assert_no_internals("\n".join(events))
    # The detail is kept for the operator, in the gateway's log.
    assert any("127.0.0.1:50999" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("mode", ["status_before_tokens", "event"])
@pytest.mark.parametrize("stream", [False, True])
def test_decode_errors_before_the_first_byte_hide_grpc_detail(failing, mode, stream):
    url, servicer = failing
    servicer.mode = mode
    body = {"prompt": "Hi", "max_tokens": 10, "stream": stream}
    resp = httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=30)
    if stream and mode == "event":  # the first chunk went out before the error event
        assert resp.status_code == 200
    else:
        _error(resp, 500)
    _assert_no_internals(resp.text)
