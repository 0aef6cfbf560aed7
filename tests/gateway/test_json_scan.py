"""gateway/json_scan.py: json.loads' results for large bodies, messages refused past the limit,
and the event loop kept free while a huge body is read."""

from __future__ import annotations

import json

import pytest
from fastapi.exceptions import RequestValidationError

from gateway.errors import APIError
from gateway.json_scan import TooManyMessages, loads_large
from gateway.offload import SCAN_MIN_BYTES, SCAN_MIN_COMMAS, parse_body
from gateway.protocol import UTF8_CHECKED, ChatCompletionRequest

DOCUMENTS = [
    {},
    [],
    [1, 2.5, -3e10, True, False, None, "x"],
    {"model": "m", "messages": [{"role": "user", "content": 'Café 😀 \u2028 \\ " \t'}]},
    {"messages": []},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}] * 3, "n": 2},
    {"a": {"b": [[], [{}], {"c": [1, [2, [3]]]}]}, "": "", "big": 10**30},
    {"prompt": "x" * 100, "messages": "not a list", "stop": ["a"] * 50},
    "just a string",
    12,
]


@pytest.mark.parametrize("doc", DOCUMENTS, ids=range(len(DOCUMENTS)))
@pytest.mark.parametrize("indent", [None, 2])
def test_same_as_json_loads(doc, indent):
    raw = json.dumps(doc, indent=indent, ensure_ascii=False).encode()
    assert loads_large(raw, max_messages=10) == json.loads(raw)


def test_duplicate_keys_and_specials_as_json_loads():
    raw = b'{"messages": [], "messages": [{"role": "u"}], "x": NaN, "y": "\\ud800"}'
    assert repr(loads_large(raw, 10)) == repr(json.loads(raw))


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b'{"a" 1}', b'{"a": 1,}', b'{"a": 1} x', b'{"messages": [1,]}', b"[1 2]",
     b'{"a": tru}', b"[" * 100_000, b'{"a": "\x01"}', b"\xff\xfe\xfd"],
)  # fmt: skip
def test_malformed_is_a_value_error(raw):
    with pytest.raises(ValueError):
        loads_large(raw, 10)


def test_messages_past_the_limit_are_refused_unread():
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}] * 50}).encode()
    assert len(loads_large(raw, 50)["messages"]) == 50
    with pytest.raises(TooManyMessages):
        loads_large(raw, 49)
    # Only the top-level `messages` is bounded.
    nested = json.dumps({"x": {"messages": [1] * 100}, "stop": ["s"] * 100}).encode()
    assert loads_large(nested, 10) == json.loads(nested)


def test_parse_body_refuses_a_huge_chat_early():
    messages = [{"role": "user", "content": "hi"}] * 200_000
    raw = json.dumps({"model": "m", "messages": messages}).encode()
    assert len(raw) > SCAN_MIN_BYTES and raw.count(b",") > SCAN_MIN_COMMAS

    def refused() -> None:
        with pytest.raises(APIError, match="more than 4096 messages"):
            parse_body(ChatCompletionRequest, raw, max_messages=4096)

    # Refused from the scanner's path (it yields the GIL between values); how long the event
    # loop then waits is a speed figure, measured by bench/event_loop.py, not asserted here.
    refused()


@pytest.mark.parametrize("large", [False, True])
def test_lone_surrogates_are_refused_by_every_parser(large):
    """jiter refuses them itself (its bodies skip the surrogate walk); json.loads and json_scan
    read them, and validation refuses them."""
    messages = [{"role": "user", "content": "a"}] * (SCAN_MIN_COMMAS if large else 1)
    body = {"model": "m", "messages": messages, "user": "\ud800"}
    raw = json.dumps(body).encode()
    assert (len(raw) > SCAN_MIN_BYTES) == large
    with pytest.raises(RequestValidationError) as info:
        parse_body(ChatCompletionRequest, raw, len(messages))
    assert "surrogate" in str(info.value.errors())
    # A caller that says the strings are valid UTF-8 when they are not: no walk, so no refusal.
    del body["messages"][1:]
    assert ChatCompletionRequest.model_validate(body, context={UTF8_CHECKED: True}).user


def test_jiter_parsed_bodies_are_marked_utf8_checked(monkeypatch):
    seen = []
    validate = ChatCompletionRequest.model_validate.__func__

    def spy(cls, data, **kwargs):
        seen.append(kwargs.get("context"))
        return validate(cls, data, **kwargs)

    monkeypatch.setattr(ChatCompletionRequest, "model_validate", classmethod(spy))
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "😀"}]}).encode()
    assert parse_body(ChatCompletionRequest, raw, 10).messages[0].content == "😀"
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "user": "\\udc00"}'
    with pytest.raises(RequestValidationError):
        parse_body(ChatCompletionRequest, raw, 10)
    assert seen == [{UTF8_CHECKED: True}, {UTF8_CHECKED: False}]
