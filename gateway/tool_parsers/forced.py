"""`tool_choice: "required"` and a named tool: the output is constrained to the calls' JSON.

As vLLM does it: a named tool constrains the output to that tool's `parameters` schema and the
whole output is the call's arguments (as generated); "required" constrains it to a JSON array
of `{"name", "parameters"}` objects, one `anyOf` branch per tool, at least one item. Either
way structured outputs guarantee the calls parse, so no parser flag is needed.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

from gateway.tool_parsers.base import (
    CallsStreamer,
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolStreamer,
    make_tool_call_id,
)

logger = logging.getLogger(__name__)

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def required_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's schema for "required": `functions` are the tools' `function` objects. Each
    tool's `$defs` move to the top (a name defined twice differently is a ValueError)."""
    branches, all_defs = [], {}
    for function in functions:
        parameters = copy.deepcopy(function.get("parameters")) or None
        for name, schema in (parameters or {}).pop("$defs", {}).items():
            if name in all_defs and all_defs[name] != schema:
                raise ValueError(
                    f"Tool definition '{name}' has multiple schemas, which is not supported."
                )
            all_defs[name] = schema
        branches.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [function["name"]]},
                    # A tool without parameters is called with `{}`.
                    "parameters": parameters or _EMPTY_PARAMETERS,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": branches},
    }
    if all_defs:
        schema["$defs"] = all_defs
    return schema


def named_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The named tool's parameters (vLLM: any JSON object when it declares none)."""
    return function.get("parameters") or _EMPTY_PARAMETERS


def extract_required(text: str) -> ExtractedToolCalls:
    """The array as calls, arguments re-serialized; unparsable (cut by max_tokens): content."""
    try:
        items = json.loads(text)
        if not isinstance(items, list):
            raise TypeError("not an array")
        calls = []
        for item in items:
            if not isinstance(item["name"], str):
                raise TypeError("a tool call's name must be a string")
            arguments = json.dumps(item["parameters"], ensure_ascii=False)
            calls.append(ToolCall(item["name"], arguments))
    except (ValueError, KeyError, TypeError):
        logger.warning("tool_choice required: the output is not a list of calls")
        return ExtractedToolCalls(False, [], text)
    return ExtractedToolCalls(bool(calls), calls, None)


def extract_named(name: str, text: str) -> ExtractedToolCalls:
    """The whole output is the named tool's arguments, as generated (vLLM)."""
    return ExtractedToolCalls(True, [ToolCall(name, text)], None)


class NamedStreamer(ToolStreamer):
    """Every piece of text is an arguments fragment of call 0."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._is_sent = False

    @property
    def tools_called(self) -> bool:
        return self._is_sent

    def feed(self, text: str) -> StreamDelta:
        if not self._is_sent:
            self._is_sent = True
            return StreamDelta(tool_calls=[ToolCallDelta(0, text, self.name, make_tool_call_id())])
        return StreamDelta(tool_calls=[ToolCallDelta(0, text)] if text else [])

    def finish(self) -> StreamDelta:
        return StreamDelta() if self._is_sent else self.feed("")


class RequiredStreamer(CallsStreamer):
    """`[` call (`,` call)* `]`. States: "open", "call", "separator", "done", "broken"."""

    log_name = "tool_choice required"

    def __init__(self) -> None:
        super().__init__("open", ("parameters",))

    def feed(self, text: str) -> StreamDelta:
        self.buf += text
        out = StreamDelta()
        while self.buf:
            if self.state in ("open", "separator"):
                rest = self.buf.lstrip()
                if not rest:
                    self.buf = ""
                    break
                expected = "[" if self.state == "open" else ",]"
                if rest[0] not in expected:
                    logger.warning("tool_choice required: unexpected %r in the calls", rest[0])
                    self.buf, self.state = "", "broken"
                    break
                if rest[0] == "]":
                    self.buf, self.state = "", "done"
                    break
                self.buf, self.state = rest[1:], "element"
            elif self.state == "element":
                rest = self.buf.lstrip()
                if not rest:
                    self.buf = ""
                    break
                self.buf, self.state = rest, "call"
                self.calls.start()
            elif self.state == "call":
                self._feed_call(out, "separator")
            else:  # done or broken
                self.buf = ""
        return out

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self.state == "call":
            self._finish_call(out)
        return out
