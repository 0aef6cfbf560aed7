"""`--reasoning-parser deepseek_r1`: everything up to `</think>` is reasoning, whether or not the
output repeats the `<think>` its chat template put in the prompt (vLLM's
`DeepSeekR1ReasoningParser`); without `</think>` the whole output is reasoning."""

from __future__ import annotations

from gateway.reasoning.base import END, START, ReasoningParser, ThinkStreamer


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        if text.startswith(START):
            text = text[len(START) :]
        reasoning, tag, content = text.partition(END)
        return reasoning, (content or None) if tag else None

    def streamer(self) -> ThinkStreamer:
        return ThinkStreamer(opens_reasoning=True)
