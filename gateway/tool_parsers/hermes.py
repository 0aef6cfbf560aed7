"""`--tool-call-parser hermes` (vLLM's `Hermes2ProToolParser`): Hermes, Qwen2.5, Qwen3.

Calls are JSON objects in tags, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
the text before the first tag is the content, text between or after the calls is dropped. The
closing tag of the last call may be missing (generation stopped right after its JSON).
"""

from __future__ import annotations

import json
import logging
import re

from gateway.tool_parsers.base import (
    CallsStreamer,
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolParser,
    ToolParserError,
    ToolStreamer,
    held_prefix_len,
    vocab_has,
)

logger = logging.getLogger(__name__)

START, END = "<tool_call>", "</tool_call>"
_CALLS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class Hermes2ProToolParser(ToolParser):
    name = "hermes"

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        if not vocab_has(tokenizer, START, END):
            raise ToolParserError(
                "Hermes 2 Pro Tool parser could not locate tool call start/end tokens in the "
                "tokenizer!"
            )

    def adjust_request(self) -> dict:
        """Some models mark the tags special: skipping special tokens would hide the calls.
        vLLM turns skipping off for every model; here only where a tag is special, because the
        detokenizer would also keep the text of the stop token (vLLM drops it)."""
        special = set(getattr(self.tokenizer, "all_special_tokens", ()))
        return {"skip_special_tokens": False} if {START, END} & special else {}

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if START not in text:
            return ExtractedToolCalls(False, [], text)
        try:
            calls = []
            for closed, unclosed in _CALLS.findall(text):
                call = json.loads(closed or unclosed)
                if not isinstance(call["name"], str):
                    raise TypeError("a tool call's name must be a string")
                arguments = json.dumps(call["arguments"], ensure_ascii=False)
                calls.append(ToolCall(call["name"], arguments))
        except (ValueError, KeyError, TypeError):
            logger.warning("hermes: the tool calls do not parse; returning them as content")
            return ExtractedToolCalls(False, [], text)
        content = text[: text.find(START)]
        return ExtractedToolCalls(True, calls, content or None)

    def streamer(self) -> ToolStreamer:
        return HermesStreamer()


class HermesStreamer(CallsStreamer):
    """States: "content" (before the first tag), "call" (inside a call's JSON), "closing"
    (after the JSON, up to `</tool_call>`), "between" (dropped text up to the next tag),
    "broken" (a call did not parse: the rest is dropped, as vLLM's streaming does)."""

    log_name = "hermes"

    def __init__(self) -> None:
        super().__init__("content", ("arguments",))

    def feed(self, text: str) -> StreamDelta:
        self.buf += text
        out = StreamDelta()
        while self.buf:
            if self.state == "content":
                i = self.buf.find(START)
                if i < 0:
                    keep = held_prefix_len(self.buf, START)
                    out.content += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep :]
                    break
                out.content += self.buf[:i]
                self._open(i + len(START))
            elif self.state == "call":
                self._feed_call(out, "closing")
            elif self.state in ("closing", "between"):
                tag = END if self.state == "closing" else START
                i = self.buf.find(tag)
                if i < 0:
                    self.buf = self.buf[len(self.buf) - held_prefix_len(self.buf, tag) :]
                    break
                if self.state == "closing":
                    self.buf, self.state = self.buf[i + len(END) :], "between"
                else:
                    self._open(i + len(START))
            else:  # broken
                self.buf = ""
        return out

    def _open(self, offset: int) -> None:
        self.buf, self.state = self.buf[offset:], "call"
        self.calls.start()

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self.state == "content":
            out.content, self.buf = self.buf, ""
        elif self.state == "call":
            self._finish_call(out)
        return out
