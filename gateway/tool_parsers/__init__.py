"""Tool call parsers for `tool_choice: "auto"`, by `--tool-call-parser` name (vLLM's names).

`base.py` holds the contract; `hermes.py` and `llama3_json.py` the parsers; `forced.py` the
"required" and named-tool cases, which need no parser (structured outputs shape the output).
"""

from __future__ import annotations

from gateway.tool_parsers.base import ToolParser, ToolParserError
from gateway.tool_parsers.hermes import Hermes2ProToolParser
from gateway.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    Hermes2ProToolParser.name: Hermes2ProToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}


def check_tool_parser_name(name: str) -> str:
    """vLLM's startup error for an unknown `--tool-call-parser`."""
    if name not in TOOL_PARSERS:
        raise ValueError(
            f"invalid tool call parser: {name} (chose from {{ {','.join(TOOL_PARSERS)} }})"
        )
    return name


__all__ = ["TOOL_PARSERS", "ToolParser", "ToolParserError", "check_tool_parser_name"]
