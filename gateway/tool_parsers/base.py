"""The contract of a tool call parser (vLLM's `ToolParser`), and the shapes it returns.

A parser reads the text a model generated after `tool_choice: "auto"` and splits it into the
content the client sees and the tool calls it asked for. It does so twice, in two ways that
must agree on any well-formed output:
  `extract_tool_calls(text)`: the whole text at once (non-streamed responses), with vLLM's
    algorithm, falling back to "all of it is content" when the calls do not parse;
  `streamer()`: a per-choice object fed the text as it is generated (`feed`, then `finish`
    once) that returns `StreamDelta`s. Joined, their content equals the extracted content, and
    each call's `arguments` fragments join to the extracted call's `arguments`. A streamer
    never sends what it may have to take back: it holds text that could still be the start of
    a tool call tag.
Arguments are JSON text as `json.dumps(arguments, ensure_ascii=False)` writes it (vLLM's form).

`__init__(tokenizer)` raises `ToolParserError` when the tokenizer lacks the parser's tokens (the
gateway then refuses to start); `adjust_request` names SamplingParams overrides the parser needs.
"""

from __future__ import annotations

import logging
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gateway.tool_parsers.json_stream import CallStreamer, CallUpdate, JsonStreamError

logger = logging.getLogger(__name__)


class ToolParserError(ValueError):
    """The parser cannot work with this tokenizer."""


def make_tool_call_id() -> str:
    """vLLM's tool call ids: `chatcmpl-tool-` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=make_tool_call_id)

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's `message.tool_calls[i]`."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass
class ToolCallDelta:
    """One streamed piece of call `index`: the first carries id and name (and arguments "")."""

    index: int
    arguments: str = ""
    name: str | None = None
    id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's `delta.tool_calls[i]`."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: StreamDelta) -> StreamDelta:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)
        return self


class ToolStreamer(ABC):
    """One choice's streaming state."""

    @property
    @abstractmethod
    def tools_called(self) -> bool:
        """At least one call was sent."""

    @abstractmethod
    def feed(self, text: str) -> StreamDelta: ...

    @abstractmethod
    def finish(self) -> StreamDelta:
        """The output ended: flush what was held back."""


class CallsStreamer(ToolStreamer):
    """A streamer whose calls are JSON objects read through one `CallSequence`. Its state
    machine keeps `state` and the unread text `buf`; the "call" state (inside a call's JSON) is
    `_feed_call` and `_finish_call`, and a call that does not parse sends the streamer to
    "broken" (the rest is dropped, as vLLM's streaming does)."""

    log_name: ClassVar[str]  # names the parser in its warnings

    def __init__(self, state: str, argument_keys: tuple[str, ...]) -> None:
        self.state, self.buf = state, ""
        self.calls = CallSequence(argument_keys)

    @property
    def tools_called(self) -> bool:
        return self.calls.num_sent > 0

    def _feed_call(self, out: StreamDelta, next_state: str) -> None:
        """State "call": the buffer's deltas go to `out`. When the call closes, `buf` holds what
        follows it and the state is `next_state`; otherwise `buf` is empty (all taken, or the
        call did not parse and the state is "broken")."""
        try:
            deltas, end = self.calls.feed(self.buf)
        except JsonStreamError as e:
            logger.warning("%s: a streamed tool call does not parse: %s", self.log_name, e)
            self.buf, self.state = "", "broken"
            return
        out.tool_calls += deltas
        if end is None:
            self.buf = ""
        else:
            self.buf, self.state = self.buf[end:], next_state

    def _finish_call(self, out: StreamDelta) -> None:
        """The output ended inside a call: what the call still holds goes to `out`."""
        try:
            out.tool_calls += self.calls.finish()
        except JsonStreamError as e:
            logger.warning("%s: a streamed tool call does not parse: %s", self.log_name, e)


class ToolParser(ABC):
    name: ClassVar[str]

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def adjust_request(self) -> dict[str, Any]:
        """SamplingParams fields this parser needs when tools are in use (vLLM's
        `adjust_request`)."""
        return {}

    @abstractmethod
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls: ...

    @abstractmethod
    def streamer(self) -> ToolStreamer: ...


def held_prefix_len(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def vocab_has(tokenizer: Any, *tokens: str) -> bool:
    vocab = tokenizer.get_vocab()
    return all(t in vocab for t in tokens)


class CallSequence:
    """The calls of one choice, streamed: each `{name, arguments}` object through a
    `CallStreamer`, numbered from 0, sent as `ToolCallDelta`s (the first with id and name)."""

    def __init__(self, argument_keys: tuple[str, ...]):
        self.argument_keys = argument_keys
        self.num_calls = 0  # calls started (their header may not be sent yet)
        self.num_sent = 0  # calls whose header was sent
        self.current: CallStreamer | None = None
        self._id = ""

    def start(self) -> None:
        assert self.current is None, "a call is still open"
        self.current = CallStreamer(self.argument_keys)
        self._id = make_tool_call_id()
        self.num_calls += 1

    def feed(self, text: str, start: int = 0) -> tuple[list[ToolCallDelta], int | None]:
        """Deltas, and the offset in `text` past the call's closing `}` (None: still open)."""
        assert self.current is not None, "no call is open"
        update = self.current.feed(text, start)
        deltas = self._deltas(update)
        if update.end is not None:
            self.current = None
        return deltas, update.end

    def finish(self) -> list[ToolCallDelta]:
        if self.current is None:
            return []
        deltas = self._deltas(self.current.finish())
        self.current = None
        return deltas

    def _deltas(self, update: CallUpdate) -> list[ToolCallDelta]:
        index = self.num_calls - 1
        if update.name is not None:
            self.num_sent += 1
            return [ToolCallDelta(index, update.arguments, update.name, self._id)]
        if update.arguments:
            return [ToolCallDelta(index, update.arguments)]
        return []
