"""The per-request fast paths keep the slow paths' results: small requests prepared on the loop
(gateway/offload.py), JSON bodies from orjson (gateway/serving.py), UTF-8 lengths without the
copy (gateway/preprocess.py)."""

from __future__ import annotations

import asyncio
import json
import math
import threading

import pytest
from starlette.responses import JSONResponse

from gateway.offload import IDLE_INLINE_MAX_BYTES, INLINE_MAX_BYTES, Preprocessor
from gateway.preprocess import utf8_len
from gateway.serving import json_bytes, sse


def test_small_inputs_run_on_the_loop_large_ones_in_the_pool():
    async def scenario():
        pre = Preprocessor(1, timeout_s=5.0, num_in_flight=lambda: 2)  # others in flight
        here = threading.current_thread().name
        name = threading.current_thread
        try:
            assert (await pre.run(lambda: name().name, num_bytes=10)) == here
            assert (await pre.run(lambda: name().name, num_bytes=INLINE_MAX_BYTES)) == here
            big = await pre.run(lambda: name().name, num_bytes=INLINE_MAX_BYTES + 1)
            assert big.startswith("preprocess")
            assert (await pre.run(lambda: name().name)).startswith("preprocess")  # size unknown
        finally:
            pre.close()

    asyncio.run(scenario())


def test_mid_sized_inputs_run_on_the_loop_only_while_nothing_else_is_in_flight():
    """Up to IDLE_INLINE_MAX_BYTES, inline when this request is alone (the hand-off would only
    cost); in the pool once others are in flight (a burst must not queue on the loop)."""
    in_flight = [1]

    async def scenario():
        pre = Preprocessor(1, timeout_s=5.0, num_in_flight=lambda: in_flight[0])
        here = threading.current_thread().name
        name = threading.current_thread
        try:
            assert (await pre.run(lambda: name().name, num_bytes=IDLE_INLINE_MAX_BYTES)) == here
            over = await pre.run(lambda: name().name, num_bytes=IDLE_INLINE_MAX_BYTES + 1)
            assert over.startswith("preprocess")
            in_flight[0] = 2
            busy = await pre.run(lambda: name().name, num_bytes=INLINE_MAX_BYTES + 1)
            assert busy.startswith("preprocess")
            assert (await pre.run(lambda: name().name, num_bytes=INLINE_MAX_BYTES)) == here
        finally:
            pre.close()

    asyncio.run(scenario())


BODIES = [
    {"id": "x", "choices": [{"index": 0, "message": {"content": "Paris é 東京 🙂"}}]},
    {"nested": {"a": [None, True, False, {"b": '\u2028\n\t"quoted"\\'}]}, "empty": {}},
    {"usage": {"prompt_tokens": 37, "prompt_tokens_details": {"cached_tokens": 0}}},
    {"ints": [0, -1, 2**62, -(2**63)]},
]


@pytest.mark.parametrize("body", BODIES)
def test_json_bytes_are_what_starlette_writes(body):
    assert json_bytes(body) == JSONResponse(body).body
    assert sse(body) == b"data: " + JSONResponse(body).body + b"\n\n"


def test_floats_parse_back_equal():
    # orjson spells some floats differently (1e-07 as 1e-7); the values are the same.
    body = {"logprob": -0.000123, "tiny": 1e-7, "big": 1.5e300, "neg0": -0.0, "third": 1 / 3}
    assert json.loads(json_bytes(body)) == json.loads(JSONResponse(body).body) == body


def test_json_bytes_falls_back_where_orjson_refuses():
    assert json.loads(json_bytes({"huge": 2**70})) == {"huge": 2**70}  # beyond 64 bits
    with pytest.raises(UnicodeEncodeError):  # a lone surrogate fails as JSONResponse's does
        json_bytes({"s": "\ud800"})
    with pytest.raises(UnicodeEncodeError):
        JSONResponse({"s": "\ud800"})
    assert json.loads(json_bytes({1: "int key"})) == {"1": "int key"}


def test_utf8_len():
    for text in ["", "ascii only", "é", "東京🙂", "mixed é and ascii" * 100]:
        assert utf8_len(text) == len(text.encode())


def test_no_nan_reaches_a_body():
    # orjson writes NaN as null where json raises: the gateway clamps logprobs first.
    from gateway.logprobs import _clamp

    assert not math.isnan(_clamp(math.nan))
