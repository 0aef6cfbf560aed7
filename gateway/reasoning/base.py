"""The contract of a reasoning parser (vLLM's `ReasoningParser`), for `<think>...</think>` models.

A parser splits a choice's text into `reasoning_content` and `content`, two ways that agree:
  `extract_reasoning(text)`: the whole text (non-streamed responses) -> (reasoning, content),
    None for a part that is absent;
  `streamer()`: a per-choice `ThinkStreamer` fed the text as it comes (`feed`, then `finish`
    once) -> (reasoning delta, content delta) pairs, never sending text that could still be
    the start of a tag it looks for.
The tags are the tokenizer's single tokens: `__init__` raises `ReasoningParserError` when they
are missing, and `start_token_id` / `end_token_id` go to the engine in `StructuredOutputsParams`
so that a constraint applies only to what follows the reasoning.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from gateway.tool_parsers.base import held_prefix_len

START, END = "<think>", "</think>"


class ReasoningParserError(ValueError):
    """The parser cannot work with this tokenizer."""


class ThinkStreamer:
    """States: "start" (the text so far could still begin with `<think>`), "reasoning",
    "content". `opens_reasoning`: without a leading `<think>` the output is reasoning anyway
    (DeepSeek-R1, whose template opens the block in the prompt) rather than content (Qwen3)."""

    def __init__(self, opens_reasoning: bool) -> None:
        self.opens_reasoning = opens_reasoning
        self.state = "start"
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        if self.state == "start":
            if self.buf.startswith(START):
                self.buf, self.state = self.buf[len(START) :], "reasoning"
            elif START.startswith(self.buf):
                return "", ""  # still undecided
            else:
                self.state = "reasoning" if self.opens_reasoning else "content"
        if self.state == "reasoning":
            i = self.buf.find(END)
            if i < 0:
                cut = len(self.buf) - held_prefix_len(self.buf, END)
                reasoning, self.buf = self.buf[:cut], self.buf[cut:]
                return reasoning, ""
            reasoning, self.buf = self.buf[:i], self.buf[i + len(END) :]
            self.state = "content"
        content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The output ended: text held back belongs to the part it was in."""
        held, self.buf = self.buf, ""
        if self.state == "reasoning" or (self.state == "start" and self.opens_reasoning):
            return held, ""
        return "", held


class ReasoningParser(ABC):
    name: ClassVar[str]
    start_token: ClassVar[str] = START
    end_token: ClassVar[str] = END

    def __init__(self, tokenizer: Any) -> None:
        vocab = tokenizer.get_vocab()
        self.start_token_id: int | None = vocab.get(self.start_token)
        self.end_token_id: int | None = vocab.get(self.end_token)
        if self.start_token_id is None or self.end_token_id is None:
            raise ReasoningParserError(
                f"{type(self).__name__} reasoning parser could not locate think start/end tokens "
                "in the tokenizer!"
            )

    @abstractmethod
    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]: ...

    @abstractmethod
    def streamer(self) -> ThinkStreamer: ...
