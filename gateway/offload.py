"""Request preprocessing off the event loop: body parsing, chat templating, tokenization.

The event loop only moves bytes; everything whose cost grows with the request runs in
`Preprocessor`'s thread pool, under a time bound (`tokenize_timeout_s`) and size bounds:
  `max_request_body_bytes` (413, before parsing; gateway/allowlist.py),
  `max_messages` (400, after the JSON parse, before pydantic validates the messages),
  a prompt whose byte length alone proves it over the context is a 400 before tokenizing
  (`preprocess.check_bytes_fit`), and a prompt the tokenizer finds too long never has its ids
  turned into a Python list.
Why these and not just "a thread": pydantic-core and the JSON parser hold the GIL for their
whole call (measured: ~1 s to validate 200k messages, ~110 ms for jiter to build them), so a
thread alone does not free the loop; the bounds keep each GIL-holding call short (tens of ms),
and between calls the loop runs. Bodies with many values (`SCAN_MIN_COMMAS`) are parsed by
gateway/json_scan.py, which gives the GIL up between values and stops reading `messages` past
the limit (bench/event_loop.py measures /health while such requests are refused). A timed-out
worker still finishes in the background (threads cannot be killed); the size bounds keep that
finite.

Small requests skip the pool: a body of at most `INLINE_MAX_BYTES` is parsed, templated (with the
model's own template) and tokenized on the event loop. For a short chat that work is ~0.1 ms,
while each hand-off to a worker and back costs more than the work itself (a worker and then the
loop woken, the GIL passed between them; bench/gateway_overhead.py measured ~0.5 ms of CPU per
request for the two hops). Text costs more than its JSON: Qwen's BPE takes ~0.4 ms for 1,000
characters on the 2-core machine, ~1.3 ms for a 512-token prompt (3 KB), so the bound is 1 KiB:
longer prompts are tokenized in a worker, which releases the GIL while it does
(preprocess.encode_bounded), so a burst of them no longer queues on the loop's thread. Up to
`IDLE_INLINE_MAX_BYTES` a body is still prepared inline while its request is the only one in
flight in this process (nothing waits behind the loop, and the hand-off would only add CPU
and latency: +0.77 ms of CPU per 3 KB prompt at 150 req/s, bench/README.md).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pydantic_core
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from gateway.errors import APIError, bad_request
from gateway.json_scan import TooManyMessages, loads_large
from gateway.protocol import UTF8_CHECKED

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

# jiter builds a body in one call, holding the GIL ~0.1-0.2 us per value (~110 ms for 200k
# messages), but copies a big string faster than anything (a 7.5 MB prompt: ~2 ms). So bodies
# with many values (counted by their commas: every value after a container's first follows
# one) go to json_scan, which yields the GIL between values (~10x slower per value); the rest,
# and every small body, to jiter.
SCAN_MIN_BYTES = 256 * 1024
SCAN_MIN_COMMAS = 50_000
# At most this many bytes of body: prepared inline (see the module docstring): ~0.4 ms of
# tokenizing at most, about what the hand-off to a worker would cost.
INLINE_MAX_BYTES = 1024
# ... and this many while the process has no other request in flight.
IDLE_INLINE_MAX_BYTES = 4096


class Preprocessor:
    def __init__(
        self, num_workers: int, timeout_s: float, num_in_flight: Callable[[], int] = lambda: 1
    ):
        """`num_in_flight`: the requests this process has in flight, this one included (the
        load shedder's count; the default: always this one alone)."""
        self.timeout_s = timeout_s
        self.num_in_flight = num_in_flight
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="preprocess")

    async def run(self, fn: Callable[..., T], *args: Any, num_bytes: int | None = None) -> T:
        """`fn(*args)` in the pool; a 400 when it takes longer than `timeout_s`. With
        `num_bytes` (the size of the input whose length bounds `fn`'s cost) at most
        `INLINE_MAX_BYTES`, or `IDLE_INLINE_MAX_BYTES` while no other request is in flight,
        `fn` runs here instead, on the loop."""
        if num_bytes is not None and (
            num_bytes <= INLINE_MAX_BYTES
            or (num_bytes <= IDLE_INLINE_MAX_BYTES and self.num_in_flight() <= 1)
        ):
            return fn(*args)
        future = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            raise bad_request(
                f"Preparing the request took longer than {self.timeout_s:g} s; send a shorter "
                "prompt or fewer messages.",
                "messages",
            ) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def parse_body(model: type[M], raw: bytes, max_messages: int) -> M:
    """The JSON body as `model`, with FastAPI's validation errors (the app's handler turns
    them into vLLM's 400s). Runs in the pool."""
    try:
        data, utf8_checked = _load(raw, max_messages)
    except TooManyMessages:
        raise _too_many_messages(f"more than {max_messages}", max_messages) from None
    except ValueError as e:
        error = {"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error"}
        raise RequestValidationError([{**error, "input": {}, "ctx": {"error": str(e)}}]) from e
    messages = data.get("messages") if isinstance(data, dict) else None
    if isinstance(messages, list) and len(messages) > max_messages:
        raise _too_many_messages(str(len(messages)), max_messages)
    try:
        return model.model_validate(data, context={UTF8_CHECKED: utf8_checked})
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        raise RequestValidationError(errors) from e


def _load(raw: bytes, max_messages: int) -> tuple[Any, bool]:
    """The body, and whether its strings are known to hold no lone surrogate (jiter refuses
    them, json and json_scan do not)."""
    if len(raw) > SCAN_MIN_BYTES and raw.count(b",") > SCAN_MIN_COMMAS:  # ~5 ms for 7 MB
        return loads_large(raw, max_messages), False
    try:
        return pydantic_core.from_json(raw), True  # ~7x faster than json.loads: less GIL held
    except ValueError:
        # What jiter refuses and json accepts (lone surrogates: a precise 400 follows).
        return json.loads(raw), False


def _too_many_messages(count: str, max_messages: int) -> APIError:
    return bad_request(
        f"The request has {count} messages; this gateway accepts at most {max_messages}.",
        "messages",
    )


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that parses its own body: the model's schema, inlined (the
    fuzz tests and clients read it from the OpenAPI document)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    content = {"application/json": {"schema": inline(schema)}}
    return {"requestBody": {"required": True, "content": content}}
