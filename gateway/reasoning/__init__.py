"""Reasoning parsers, by `--reasoning-parser` name (vLLM's names); `base.py` holds the contract."""

from __future__ import annotations

from gateway.reasoning.base import ReasoningParser, ReasoningParserError
from gateway.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from gateway.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
}


def check_reasoning_parser_name(name: str) -> str:
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"invalid reasoning parser: {name} (choose from {', '.join(REASONING_PARSERS)})"
        )
    return name


__all__ = [
    "REASONING_PARSERS",
    "ReasoningParser",
    "ReasoningParserError",
    "check_reasoning_parser_name",
]
