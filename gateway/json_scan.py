"""Large JSON bodies parsed without holding the GIL for long, and chats with too many messages
refused before their messages are built.

Why: jiter (`pydantic_core.from_json`) builds a 7 MB body of 200,000 messages in ~110 ms in one
C call, holding the GIL, so the event loop (and every /health) waits that long even though the
parse runs in a worker thread; freeing that object graph later costs another ~50 ms wherever
the last reference drops. Here the body is read by the standard library's pure-Python scanner
(`json.scanner.py_make_scanner`, json.loads' semantics), which returns to the interpreter
between values, so the GIL changes hands every switch interval; the top-level object is walked
here, and its `messages` array is read one message at a time and abandoned after
`max_messages + 1`. About 10x slower than jiter per value, and slower on one big string, so
only bodies with many values come here (`offload.SCAN_MIN_COMMAS`).
"""

from __future__ import annotations

import json
from json.decoder import WHITESPACE, scanstring
from json.scanner import py_make_scanner
from typing import Any


class TooManyMessages(Exception):
    def __init__(self, limit: int):
        super().__init__(limit)
        self.limit = limit


def loads_large(raw: bytes, max_messages: int) -> Any:
    """json.loads(raw), raising TooManyMessages for a top-level `messages` array longer than
    `max_messages` and ValueError (with json's wording) for malformed JSON."""
    text = raw.decode(json.detect_encoding(raw), "surrogatepass")
    scan = py_make_scanner(json.JSONDecoder())
    try:
        i = _skip_ws(text, 0)
        if not text.startswith("{", i):
            value, i = scan(text, i)
            return _at_end(text, i, value)
        return _object(text, i, scan, max_messages)
    except StopIteration as e:
        raise ValueError(f"Expecting value: char {e.value}") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _skip_ws(text: str, i: int) -> int:
    return WHITESPACE.match(text, i).end()


def _at_end(text: str, i: int, value: Any) -> Any:
    i = _skip_ws(text, i)
    if i != len(text):
        raise ValueError(f"Extra data: char {i}")
    return value


def _object(text: str, i: int, scan, max_messages: int) -> dict[str, Any]:
    """The top-level object starting at `text[i] == "{"` (duplicate keys: the last wins)."""
    data: dict[str, Any] = {}
    i = _skip_ws(text, i + 1)
    if text.startswith("}", i):
        return _at_end(text, i + 1, data)
    while True:
        if not text.startswith('"', i):
            raise ValueError(f"Expecting property name enclosed in double quotes: char {i}")
        key, i = scanstring(text, i + 1)
        i = _skip_ws(text, i)
        if not text.startswith(":", i):
            raise ValueError(f"Expecting ':' delimiter: char {i}")
        i = _skip_ws(text, i + 1)
        if key == "messages" and text.startswith("[", i):
            data[key], i = _messages(text, i, scan, max_messages)
        else:
            data[key], i = scan(text, i)
        i = _skip_ws(text, i)
        if text.startswith(",", i):
            i = _skip_ws(text, i + 1)
        elif text.startswith("}", i):
            return _at_end(text, i + 1, data)
        else:
            raise ValueError(f"Expecting ',' delimiter: char {i}")


def _messages(text: str, i: int, scan, max_messages: int) -> tuple[list, int]:
    """The array at `text[i] == "["`, one element at a time, refused past `max_messages`."""
    items: list[Any] = []
    i = _skip_ws(text, i + 1)
    if text.startswith("]", i):
        return items, i + 1
    while True:
        item, i = scan(text, i)
        items.append(item)
        if len(items) > max_messages:
            raise TooManyMessages(max_messages)
        i = _skip_ws(text, i)
        if text.startswith(",", i):
            i = _skip_ws(text, i + 1)
        elif text.startswith("]", i):
            return items, i + 1
        else:
            raise ValueError(f"Expecting ',' delimiter: char {i}")
