"""The response side of a chat choice: its text → reasoning, content and tool calls.

Order as in vLLM: the reasoning parser splits the text first; the tool parser (or the forced
"required" / named reading) then reads the content part only. `ChatOutput.message` does it for
a whole choice (the non-streamed body), `ChoiceStream` piece by piece (SSE deltas); the two
agree on any well-formed output (tests/gateway/test_tools.py, test_reasoning.py check it).

finish_reason becomes "tool_calls" when "auto" found calls, or "required" stopped normally;
a named tool keeps the engine's reason (vLLM, like OpenAI).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from gateway.chat_tools import ToolMode
from gateway.errors import bad_request
from gateway.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningParserError
from gateway.tool_parsers import TOOL_PARSERS, ToolParser, ToolParserError
from gateway.tool_parsers.base import ExtractedToolCalls, StreamDelta, ToolStreamer
from gateway.tool_parsers.forced import (
    NamedStreamer,
    RequiredStreamer,
    extract_named,
    extract_required,
)


@functools.lru_cache(maxsize=8)
def load_parsers(
    tool_call_parser: str | None, reasoning_parser: str | None, tokenizer: Any
) -> tuple[ToolParser | None, ReasoningParser | None]:
    """The flags' parsers for this tokenizer; ToolParserError / ReasoningParserError when the
    tokenizer lacks their tokens (`tandem gateway` checks at startup)."""
    tools = TOOL_PARSERS[tool_call_parser](tokenizer) if tool_call_parser else None
    reasoning = REASONING_PARSERS[reasoning_parser](tokenizer) if reasoning_parser else None
    return tools, reasoning


def request_parsers(
    tool_call_parser: str | None, reasoning_parser: str | None, tokenizer: Any
) -> tuple[ToolParser | None, ReasoningParser | None]:
    """`load_parsers` for a request: a parser that cannot work is a 400 (as in vLLM).
    Parsers are stateless (their streamers hold a choice's state), so they are built once per
    tokenizer: building one reads the whole vocabulary, which must not run per request on the
    event loop."""
    key = (tool_call_parser, reasoning_parser, id(tokenizer))
    cached = _PARSERS.get(key)
    if cached is None or cached[0] is not tokenizer:
        try:
            cached = _PARSERS[key] = (
                tokenizer,
                load_parsers(tool_call_parser, reasoning_parser, tokenizer),
            )
        except (ToolParserError, ReasoningParserError) as e:
            raise bad_request(str(e)) from e
    return cached[1]


# (tool parser, reasoning parser, id(tokenizer)) -> (tokenizer, parsers); the tokenizer is kept
# so that its id is never reused by another while the entry lives.
_PARSERS: dict[tuple, tuple[Any, tuple[ToolParser | None, ReasoningParser | None]]] = {}


@dataclass(frozen=True)
class ChatOutput:
    """How one request's choices are read."""

    tools: ToolMode = ToolMode("none")
    reasoning: ReasoningParser | None = None
    include_reasoning: bool = True

    @property
    def is_plain(self) -> bool:
        return self.reasoning is None and self.tools.kind == "none"

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The non-streamed `message` and `finish_reason` of one choice."""
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning(text)
        extracted = self._extract(content)
        calls = extracted.tool_calls
        if not self.tools.parallel_tool_calls:
            calls = calls[:1]
        message: dict[str, Any] = {
            "role": "assistant",
            "content": extracted.content,
            "tool_calls": [c.to_dict() for c in calls],
        }
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning if self.include_reasoning else None
        return message, self.finish_reason(finish_reason, extracted.tools_called)

    def _extract(self, content: str | None) -> ExtractedToolCalls:
        kind = self.tools.kind
        if kind == "none":
            return ExtractedToolCalls(False, [], content)
        if kind == "auto":
            assert self.tools.parser is not None
            if content is None:
                return ExtractedToolCalls(False, [], None)
            return self.tools.parser.extract_tool_calls(content)
        if kind == "named":
            assert self.tools.name is not None
            extracted = extract_named(self.tools.name, content or "")
        else:
            extracted = extract_required(content or "")
        if extracted.tools_called:
            extracted.content = ""  # vLLM's forced calls come with empty content
        return extracted

    def finish_reason(self, reason: str | None, tools_called: bool) -> str | None:
        if tools_called and (
            self.tools.kind == "auto" or (self.tools.kind == "required" and reason == "stop")
        ):
            return "tool_calls"
        return reason

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One choice's SSE deltas: `feed` each new piece of text, `finish` once at the end; each
    returns the `delta` fields to send (empty: nothing yet)."""

    def __init__(self, output: ChatOutput):
        self.output = output
        self.think = output.reasoning.streamer() if output.reasoning is not None else None
        self.tools = _tool_streamer(output.tools)

    def feed(self, text: str) -> dict[str, Any]:
        if self.output.is_plain:
            return {"content": text} if text else {}
        reasoning, content = self.think.feed(text) if self.think else ("", text)
        return self._delta(reasoning, content, final=False)

    def finish(self) -> dict[str, Any]:
        if self.output.is_plain:
            return {}
        reasoning, content = self.think.finish() if self.think else ("", "")
        return self._delta(reasoning, content, final=True)

    def finish_reason(self, reason: str) -> str:
        tools_called = self.tools is not None and self.tools.tools_called
        return self.output.finish_reason(reason, tools_called) or reason

    def _delta(self, reasoning: str, content: str, final: bool) -> dict[str, Any]:
        parsed = StreamDelta(content=content)
        if self.tools is not None:
            parsed = self.tools.feed(content) if content else StreamDelta()
            if final:
                parsed.extend(self.tools.finish())
        delta: dict[str, Any] = {}
        if reasoning and self.output.include_reasoning:
            delta["reasoning_content"] = reasoning
        if parsed.content:
            delta["content"] = parsed.content
        calls = parsed.tool_calls
        if not self.output.tools.parallel_tool_calls:
            calls = [c for c in calls if c.index == 0]
        if calls:
            delta["tool_calls"] = [c.to_dict() for c in calls]
        return delta


def _tool_streamer(mode: ToolMode) -> ToolStreamer | None:
    if mode.kind == "auto":
        assert mode.parser is not None
        return mode.parser.streamer()
    if mode.kind == "named":
        assert mode.name is not None
        return NamedStreamer(mode.name)
    if mode.kind == "required":
        return RequiredStreamer()
    return None
