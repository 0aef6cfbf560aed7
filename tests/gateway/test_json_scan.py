"""gateway/json_scan.py: json.loads' results for large bodies, messages refused past the limit,
and the event loop kept free while a huge body is read."""

from __future__ import annotations

import json

import pytest

from gateway.errors import APIError
from gateway.json_scan import TooManyMessages, loads_large
from gateway.offload import SCAN_MIN_BYTES, SCAN_MIN_COMMAS, parse_body
from gateway.protocol import ChatCompletionRequest

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
