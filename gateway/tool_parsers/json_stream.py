"""Streaming a tool call's JSON as it is generated: token by token, in canonical form.

A tool call's `arguments` reach the client as a string that must equal, once the fragments are
joined, what the non-streamed response holds: vLLM's `json.dumps(arguments, ensure_ascii=False)`.
`JsonScanner` cuts streamed text into complete JSON tokens; re-serializing each token on its own
(`canonical`) gives exactly that string, because `json.dumps` with its default separators writes
every token independently of its neighbours (", " after a comma, ": " after a colon, strings and
numbers as `json.loads` of the token reads them).

`CallStreamer` follows one `{"name": ..., "arguments": {...}}` object: it reports the name once
it is complete and the arguments' canonical text as each token completes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_WHITESPACE = " \t\r\n"
_PUNCTUATION = "{}[]:,"
_STRING_BODY = re.compile(r'[^"\\]*')


class JsonStreamError(ValueError):
    """The streamed text is not JSON of the expected shape."""


def canonical(token: str) -> str:
    """One complete JSON token as `json.dumps(..., ensure_ascii=False)` writes it."""
    if token == ",":
        return ", "
    if token == ":":
        return ": "
    if token in "{}[]":
        return token
    try:
        value = json.loads(token)
    except ValueError as e:
        raise JsonStreamError(f"not a JSON token: {token[:40]!r}") from e
    return json.dumps(value, ensure_ascii=False)


class JsonScanner:
    """Cuts streamed JSON text into complete tokens. A string token ends at its closing quote; a
    number or literal at the next delimiter (or at `finish`). Whitespace is dropped."""

    def __init__(self) -> None:
        self._pending: list[str] = []  # pieces of the token being read
        self._in_string = False
        self._escape = False

    def scan(self, text: str, start: int = 0) -> list[tuple[str, int]]:
        """(token, offset in `text` just past it) for each token completed by `text[start:]`."""
        out: list[tuple[str, int]] = []
        i, n = start, len(text)
        while i < n:
            if self._in_string:
                i = self._read_string(text, i, out)
                continue
            c = text[i]
            if self._pending:  # a number or literal: it ends at a delimiter
                if c in _WHITESPACE or c in _PUNCTUATION or c == '"':
                    out.append(("".join(self._pending), i))
                    self._pending = []
                    continue
                self._pending.append(c)
            elif c in _PUNCTUATION:
                out.append((c, i + 1))
            elif c == '"':
                self._pending, self._in_string = ['"'], True
            elif c not in _WHITESPACE:
                self._pending.append(c)
            i += 1
        return out

    def _read_string(self, text: str, i: int, out: list[tuple[str, int]]) -> int:
        if self._escape:
            self._pending.append(text[i])
            self._escape = False
            return i + 1
        body = _STRING_BODY.match(text, i)
        assert body is not None
        self._pending.append(body.group())
        i = body.end()
        if i == len(text):
            return i
        c = text[i]
        self._pending.append(c)
        if c == "\\":
            self._escape = True
        else:  # the closing quote
            out.append(("".join(self._pending), i + 1))
            self._pending, self._in_string = [], False
        return i + 1

    def finish(self) -> str | None:
        """The number or literal the text ended with, if any (a string must be closed)."""
        if self._in_string or not self._pending:
            return None
        token, self._pending = "".join(self._pending), []
        return token


@dataclass
class CallUpdate:
    """What one `CallStreamer.feed` learned."""

    name: str | None = None  # the call's name, the first time it is complete
    arguments: str = ""  # canonical text of the arguments, continuing the previous updates
    end: int | None = None  # offset in the fed text just past the object's `}`, once it closed


@dataclass
class CallStreamer:
    """One tool call object, `{"name": "...", "<arguments key>": <any JSON>}`, streamed.

    The arguments are held back until the name is known (a model may write them first). A
    call whose object closes without a name or without arguments is a `JsonStreamError`.
    """

    argument_keys: tuple[str, ...] = ("arguments",)
    name: str | None = None
    has_arguments: bool = False
    _scanner: JsonScanner = field(default_factory=JsonScanner)
    _depth: int = 0
    _expect: str = "open"  # at depth 1: "key", "colon", "value", "comma"
    _key: str | None = None
    _nested_depth: int | None = None  # depth inside a value's container while in one
    _nested_is_args: bool = False  # ... and whether that value is the arguments
    _held: list[str] = field(default_factory=list)  # arguments text before the name is known
    _name_sent: bool = False

    def feed(self, text: str, start: int = 0) -> CallUpdate:
        update = CallUpdate()
        for token, end in self._scanner.scan(text, start):
            self._take(token, update)
            if self._depth == 0 and self._expect == "done":
                update.end = end
                break
        return self._release(update)

    def finish(self) -> CallUpdate:
        """The stream ended: a number or literal the arguments ended with completes."""
        update = CallUpdate()
        token = self._scanner.finish()
        if token is not None and self._expect == "value":  # a scalar ended the text
            self._take(token, update)
        return self._release(update)

    def _take(self, token: str, update: CallUpdate) -> None:
        if self._nested_depth is not None:  # inside a container value
            text = canonical(token)  # validates skipped values too
            if self._nested_is_args:
                self._held.append(text)
            if token in "{[":
                self._nested_depth += 1
            elif token in "}]":
                self._nested_depth -= 1
            if self._nested_depth == 0:
                self._nested_depth = None
                self._expect = "comma"
            return
        if self._expect == "open":
            if token != "{":
                raise JsonStreamError("a tool call must be a JSON object")
            self._depth, self._expect = 1, "key"
        elif self._expect == "key":
            if token == "}" and self._key is None:
                self._close()
            elif not token.startswith('"'):
                raise JsonStreamError("expected a key in the tool call object")
            else:
                self._key, self._expect = json.loads(token), "colon"
        elif self._expect == "colon":
            if token != ":":
                raise JsonStreamError("expected ':' in the tool call object")
            self._expect = "value"
        elif self._expect == "value":
            self._value(token)
        elif self._expect == "comma":
            if token == ",":
                self._expect = "key"
            elif token == "}":
                self._close()
            else:
                raise JsonStreamError("expected ',' or '}' in the tool call object")

    def _value(self, token: str) -> None:
        if token in "}],:":
            raise JsonStreamError("expected a value in the tool call object")
        is_args = self._key in self.argument_keys and not self.has_arguments
        if self._key == "name" and self.name is None:
            if not token.startswith('"'):
                raise JsonStreamError("a tool call's name must be a string")
            self.name = json.loads(token)
        elif is_args:
            self.has_arguments = True
            self._held.append(canonical(token))
        else:
            canonical(token)  # another key's value: validated, not kept
        if token in "{[":
            self._nested_depth, self._nested_is_args = 1, is_args
        else:
            self._expect = "comma"

    def _close(self) -> None:
        if self.name is None or not self.has_arguments:
            raise JsonStreamError("a tool call needs a name and arguments")
        self._depth, self._expect = 0, "done"

    def _release(self, update: CallUpdate) -> CallUpdate:
        if self.name is not None and not self._name_sent:
            self._name_sent = True
            update.name = self.name
        if self._name_sent and self._held:
            update.arguments = "".join(self._held)
            self._held = []
        return update

    @property
    def is_done(self) -> bool:
        return self._expect == "done"
