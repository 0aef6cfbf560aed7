"""The request side of tool calling: which mode a chat request is in, and what the chat template
is given.

Modes, as vLLM decides them (`check_tool_usage` keeps its checks and messages):
  "none": tools unset, or `tool_choice: "none"` (the tools are still rendered into the prompt,
    unless the gateway runs with --exclude-tools-when-tool-choice-none);
  "auto": the default when tools are given; needs --enable-auto-tool-choice and a
    --tool-call-parser, which reads the calls out of free text;
  "required" / "named": structured outputs force the calls' JSON (`tool_parsers/forced.py`).
The template gets the tools as vLLM's `tool.model_dump()` dicts, and assistant messages'
`tool_calls[].function.arguments` parsed from their JSON string into objects, as vLLM and
transformers' tool-use templates expect.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from gateway.config import GatewaySettings
from gateway.errors import bad_request
from gateway.protocol import ChatCompletionRequest, ChatMessage
from gateway.tool_parsers import ToolParser
from gateway.tool_parsers.forced import named_schema, required_schema

_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


@dataclass(frozen=True)
class ToolMode:
    kind: Literal["none", "auto", "required", "named"]
    parser: ToolParser | None = None  # "auto"
    name: str | None = None  # "named": the function
    schema: dict[str, Any] | None = None  # "required" / "named": the constraint
    parallel_tool_calls: bool = True


def check_tool_usage(req: ChatCompletionRequest) -> str | dict[str, Any]:
    """The effective tool_choice, with vLLM's `check_tool_usage` rules and 400 messages."""
    choice, tools = req.tool_choice, req.tools
    if choice is None:
        return "auto" if tools else "none"
    if choice == "none":
        return choice
    if tools is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice == "required" and not tools:
        return "none"  # OpenAI: "required" with no tools behaves like "none"
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type", "function") != "function" or not isinstance(function, dict):
            raise bad_request(
                f"Invalid value for `function`: `{function}` in `tool_choice`! {_NAMED_USAGE}",
                "tool_choice",
            )
        if "name" not in function:
            raise bad_request(
                f"Expected field `name` in `function` in `tool_choice`! {_NAMED_USAGE}",
                "tool_choice",
            )
        name = function["name"]
        if not isinstance(name, str) or not name:
            raise bad_request(
                f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_NAMED_USAGE}",
                "tool_choice",
            )
        if all(t.function.name != name for t in tools):
            raise bad_request(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                "tool_choice",
            )
        return choice
    if choice not in ("auto", "required"):
        raise bad_request(
            f'Invalid value for `tool_choice`: {str(choice)[:64]}! Only named tools, "none", '
            '"auto" or "required" are supported.',
            "tool_choice",
        )
    return choice


def resolve_tool_mode(
    req: ChatCompletionRequest, settings: GatewaySettings, parser: ToolParser | None
) -> ToolMode:
    choice = check_tool_usage(req)
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return ToolMode("none")
    functions = [t.function.model_dump() for t in req.tools or []]
    if choice == "auto":
        if not (settings.enable_auto_tool_choice and parser is not None):
            raise bad_request(AUTO_NEEDS_FLAGS, "tool_choice")
        if not req.tools:  # vLLM parses only when tools are given
            return ToolMode("none")
        return ToolMode("auto", parser=parser, parallel_tool_calls=parallel)
    if choice == "required":
        try:
            schema = required_schema(functions)
        except ValueError as e:
            raise bad_request(str(e), "tools") from e
        return ToolMode("required", schema=schema, parallel_tool_calls=parallel)
    assert isinstance(choice, dict)
    name = choice["function"]["name"]
    function = next(f for f in functions if f["name"] == name)
    return ToolMode("named", name=name, schema=named_schema(function))


def template_request(
    req: ChatCompletionRequest, settings: GatewaySettings
) -> ChatCompletionRequest:
    """The request as `preprocess.tokenize_chat` should render it: tools and reasoning_effort
    as template variables (through `chat_template_kwargs`, which it passes to the template),
    tool call arguments parsed. Unchanged when there is nothing to add."""
    kwargs = dict(req.chat_template_kwargs or {})
    exclude = req.tool_choice == "none" and settings.exclude_tools_when_tool_choice_none
    if req.tools is not None and not exclude:
        kwargs["tools"] = [t.model_dump() for t in req.tools]
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    messages = [_parsed_tool_calls(m, i) for i, m in enumerate(req.messages)]
    if kwargs == (req.chat_template_kwargs or {}) and all(
        a is b for a, b in zip(messages, req.messages)
    ):
        return req
    # model_copy: `chat_template_kwargs` may not hold "tools" when a client sends it.
    return req.model_copy(update={"chat_template_kwargs": kwargs, "messages": messages})


def _parsed_tool_calls(message: ChatMessage, index: int) -> ChatMessage:
    calls = (message.model_extra or {}).get("tool_calls")
    if message.role != "assistant" or calls is None:
        return message
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise bad_request(f"{where} must be a list of tool call objects.", "messages")
    parsed = []
    for call in calls:
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{where}: each call needs function.name.", "messages")
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                arguments = json.loads(arguments)
            except ValueError as e:
                raise bad_request(
                    f"{where}: function.arguments is not valid JSON: {e}", "messages"
                ) from e
        elif not arguments:
            arguments = {}  # vLLM: missing or empty arguments are {}
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return ChatMessage.model_validate({**message.model_dump(), "tool_calls": parsed})
