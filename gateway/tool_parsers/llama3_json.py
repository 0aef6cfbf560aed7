"""`--tool-call-parser llama3_json` (vLLM's `Llama3JsonToolParser`): Llama 3.1 / 3.2 JSON calls.

The output is a tool call when it starts with `<|python_tag|>` or `{`: then it is JSON objects
`{"name": ..., "parameters": {...}}` (or `"arguments"`) separated by `;`, and nothing else.
Any other output is content. (`<|python_tag|>` is a special token: it reaches the text only
with `skip_special_tokens` off; the parser reads the output either way.)
"""

from __future__ import annotations

import json
import logging

from gateway.tool_parsers.base import (
    CallsStreamer,
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolParser,
    ToolStreamer,
)

logger = logging.getLogger(__name__)

BOT = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if not (text.startswith(BOT) or text.startswith("{")):
            return ExtractedToolCalls(False, [], text)
        decoder = json.JSONDecoder()
        i = len(BOT) if text.startswith(BOT) else 0
        calls = []
        try:
            while True:
                while i < len(text) and text[i] in _SEPARATORS:
                    i += 1
                if i == len(text):
                    break
                call, i = decoder.raw_decode(text, i)
                arguments = call["arguments"] if "arguments" in call else call["parameters"]
                if not isinstance(call["name"], str):
                    raise TypeError("a tool call's name must be a string")
                calls.append(ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, KeyError, TypeError):
            logger.warning("llama3_json: the tool calls do not parse; returning them as content")
            return ExtractedToolCalls(False, [], text)
        if not calls:
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, calls, None)

    def streamer(self) -> ToolStreamer:
        return Llama3JsonStreamer()


class Llama3JsonStreamer(CallsStreamer):
    """States: "start" (undecided: the text so far could begin `<|python_tag|>`), "content",
    "separator" (between calls), "call", "broken" (the rest is dropped)."""

    log_name = "llama3_json"

    def __init__(self) -> None:
        super().__init__("start", ("arguments", "parameters"))

    def feed(self, text: str) -> StreamDelta:
        self.buf += text
        out = StreamDelta()
        while self.buf:
            if self.state == "start":
                if self.buf.startswith(BOT):
                    self.buf, self.state = self.buf[len(BOT) :], "separator"
                elif self.buf.startswith("{"):
                    self.state = "separator"
                elif BOT.startswith(self.buf):
                    break  # wait: it may still become the tag
                else:
                    self.state = "content"
            elif self.state == "content":
                out.content, self.buf = out.content + self.buf, ""
            elif self.state == "separator":
                rest = self.buf.lstrip(_SEPARATORS)
                if not rest:
                    self.buf = ""
                elif rest[0] == "{":
                    self.buf, self.state = rest, "call"
                    self.calls.start()
                else:
                    logger.warning("llama3_json: text between streamed tool calls; dropped")
                    self.buf, self.state = "", "broken"
            elif self.state == "call":
                self._feed_call(out, "separator")
            else:  # broken
                self.buf = ""
        return out

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self.state == "start":  # a proper prefix of the tag: plain text after all
            out.content, self.buf = self.buf, ""
        elif self.state == "call":
            self._finish_call(out)
        return out
