"""`--reasoning-parser qwen3`: Qwen3 opens its reasoning itself, `<think>...</think>answer`.

Output that does not start with `<think>` is all content (thinking disabled with
`enable_thinking: false`, whose template closes an empty block in the prompt). Output that
starts with `<think>` and never closes it (cut by max_tokens) is all reasoning.
"""

from __future__ import annotations

from gateway.reasoning.base import END, START, ReasoningParser, ThinkStreamer


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        if not text.startswith(START):
            return None, text
        reasoning, tag, content = text[len(START) :].partition(END)
        return reasoning, (content or None) if tag else None

    def streamer(self) -> ThinkStreamer:
        return ThinkStreamer(opens_reasoning=False)
