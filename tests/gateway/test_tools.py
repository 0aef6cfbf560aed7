"""Tool calling: tools in the prompt, "auto" calls read by a parser, "required" and named calls
forced by structured outputs, streamed deltas in OpenAI's shape that reassemble to the
non-streamed calls.

The parsers are checked on texts first (fed in pieces of every size, they must give what the
whole text gives). End to end, a scripted decode streams an exact hermes output through the
Qwen tokenizer; "required" and named calls run on the real engine with its grammar.
"""

from __future__ import annotations

import json

import jsonschema_rs
import openai
import pytest

from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.tokenizer import load_tokenizer
from gateway.chat_output import load_parsers
from gateway.tool_parsers import TOOL_PARSERS, ToolParserError
from gateway.tool_parsers.base import ToolStreamer
from gateway.tool_parsers.forced import RequiredStreamer, extract_required, required_schema
from gateway.tool_parsers.json_stream import JsonScanner, canonical
from tests.fixtures.tiny_models import QWEN_IM_END_ID, QWEN_TOOL_CALL_ID
from tests.gateway.qwen_gateway import (  # noqa: F401 (fixtures)
    QWEN_SERVED,
    qwen_fixture,
    qwen_gateway_fixture,
    reset_qwen_decode_fixture,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


class _Vocab:
    def get_vocab(self) -> dict[str, int]:
        return {"<tool_call>": 1, "</tool_call>": 2}


def _streamed(streamer: ToolStreamer, text: str, size: int):
    """(content, [(name, arguments)], first deltas) from feeding `text` in `size` pieces."""
    content, calls, firsts = "", {}, {}
    pieces = [streamer.feed(text[i : i + size]) for i in range(0, len(text), size)]
    for delta in [*pieces, streamer.finish()]:
        content += delta.content
        for call in delta.tool_calls:
            if call.name is not None:
                assert call.index not in calls and call.id.startswith("chatcmpl-tool-")
                calls[call.index], firsts[call.index] = [call.name, ""], call
            calls[call.index][1] += call.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)]


def _agree(parser_name: str, text: str) -> None:
    parser = TOOL_PARSERS[parser_name](_Vocab())
    extracted = parser.extract_tool_calls(text)
    expected = [(c.name, c.arguments) for c in extracted.tool_calls]
    for size in (1, 2, 3, 5, 11, len(text) or 1):
        content, calls = _streamed(parser.streamer(), text, size)
        assert content == (extracted.content or ""), size
        assert calls == expected, size
    return extracted


@pytest.mark.parametrize(
    "text",
    [
        HERMES,
        '<tool_call>{"arguments": {"x": [1, 2.50, -0, 1e2, true, null, "é\\"\\n\\u00e9"]}, '
        '"name": "f"}</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {}}',  # the end tag never came
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',  # a string
        "No call here, just < and <tool_",
        "",
    ],
)
def test_hermes_extract_and_stream_agree(text):
    _agree("hermes", text)


def test_hermes_reads_calls_as_vllm_does():
    extracted = TOOL_PARSERS["hermes"](_Vocab()).extract_tool_calls(HERMES)
    assert extracted.tools_called and extracted.content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in extracted.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert extracted.tool_calls[0].arguments == '{"city": "Paris", "unit": "celsius"}'
    broken = TOOL_PARSERS["hermes"](_Vocab()).extract_tool_calls("<tool_call>{oops</tool_call>")
    assert not broken.tools_called and broken.content == "<tool_call>{oops</tool_call>"


@pytest.mark.parametrize(
    "text",
    [
        '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {}}',
        '{"name": "get_weather", "parameters": {"city": "Rome", "n": 3.0}}',
        "Hello there",
        "<|python",  # a prefix of the tag that never completed: content
    ],
)
def test_llama3_json_extract_and_stream_agree(text):
    _agree("llama3_json", text)


def test_llama3_json_reads_calls_as_vllm_does():
    text = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {}}'
    extracted = TOOL_PARSERS["llama3_json"](_Vocab()).extract_tool_calls(text)
    assert extracted.content is None
    assert [(c.name, c.arguments) for c in extracted.tool_calls] == [("f", '{"a": 1}'), ("g", "{}")]


@pytest.mark.parametrize(
    "text",
    [
        '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]',
        '[ {"name":"f","parameters":{"a":[1,{"b":null}]}} ,\n {"name":"g","parameters":{}} ]',
    ],
)
def test_required_extract_and_stream_agree(text):
    extracted = extract_required(text)
    assert extracted.tools_called
    expected = [(c.name, c.arguments) for c in extracted.tool_calls]
    for size in (1, 2, 7, len(text)):
        assert _streamed(RequiredStreamer(), text, size) == ("", expected)


def test_canonical_tokens_join_to_json_dumps():
    docs = [
        {"a": [1, 2.5, -0.0, 1e300, "x\ty", {"é": None}], "b": {}, "c": [], "d": True},
        ["\u2028", "\\", '"', 10**30, -3],
        "plain",
    ]
    for doc in docs:
        text = json.dumps(doc, indent=3, ensure_ascii=True)
        scanner = JsonScanner()
        tokens = [t for t, _ in scanner.scan(text)]
        last = scanner.finish()
        tokens += [last] if last is not None else []
        assert "".join(map(canonical, tokens)) == json.dumps(doc, ensure_ascii=False)


def test_required_schema_is_vllms():
    no_params = {"name": "ping"}
    defs = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {}}}
    schema = required_schema([WEATHER["function"], no_params, {"name": "d", "parameters": defs}])
    assert schema["type"] == "array" and schema["minItems"] == 1
    branches = schema["items"]["anyOf"]
    assert branches[0] == {
        "properties": {
            "name": {"type": "string", "enum": ["get_weather"]},
            "parameters": WEATHER["function"]["parameters"],
        },
        "required": ["name", "parameters"],
    }
    assert branches[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert schema["$defs"] == {"P": {}} and "$defs" not in branches[2]["properties"]["parameters"]
    other = {"name": "e", "parameters": {"$defs": {"P": {"type": "string"}}}}
    with pytest.raises(ValueError, match="Tool definition 'P' has multiple schemas"):
        required_schema([{"name": "d", "parameters": defs}, other])


# ---- end to end: the request side ----------------------------------------------------------


def test_tools_and_tool_messages_are_rendered_by_the_template(qwen, qwen_gateway):
    """Tools, an assistant turn with tool_calls (arguments as a JSON string) and a `tool`
    message reach Qwen3's template as transformers renders them (arguments as objects)."""
    qwen.decode.script = [QWEN_IM_END_ID]
    call = {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    with qwen_gateway() as client:
        client.chat.completions.create(
            model=QWEN_SERVED, messages=messages, tools=TOOLS, tool_choice="none"
        )
    with qwen_gateway(exclude_tools_when_tool_choice_none=True) as client:
        client.chat.completions.create(
            model=QWEN_SERVED, messages=messages, tools=TOOLS, tool_choice="none"
        )
    rendered, excluded = (r.prompt_token_ids for r in qwen.decode.record.requests)
    tokenizer = load_tokenizer(qwen.path)  # transformers' rendering is the reference
    as_template_sees_them = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {**call, "arguments": json.loads(call["arguments"])},
                }
            ],
        },
        messages[2],
    ]
    # vLLM renders `tool.model_dump()`: unset fields as null.
    tools = [
        {
            "type": "function",
            "function": {k: t["function"].get(k) for k in ("name", "description", "parameters")},
        }
        for t in TOOLS
    ]
    text = tokenizer.apply_chat_template(
        as_template_sees_them, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.decode(rendered) == text
    assert rendered == tokenizer.encode(text, add_special_tokens=False)
    assert "<tools>" in text and '"description": null' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text
    assert "<tools>" not in tokenizer.decode(excluded)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set."),
        ({"tools": TOOLS, "tool_choice": "any"}, "Invalid value for `tool_choice`: any!"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
            "Expected field `name` in `function` in `tool_choice`!",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "You can only either use constraints for structured outputs or tools, not both.",
        ),
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ],
)
def test_tool_usage_errors_are_vllms(qwen, qwen_gateway, body, message):
    with qwen_gateway() as client, pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=QWEN_SERVED, messages=MESSAGES, extra_body=body)
    assert message in info.value.body["message"]
    assert qwen.decode.record.requests == []


def test_auto_needs_the_flags(qwen, qwen_gateway):
    message = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'
    for flags in ({}, {"tool_call_parser": "hermes"}):
        with qwen_gateway(**flags) as client:
            for choice in ({}, {"tool_choice": "auto"}):  # tools alone mean "auto"
                with pytest.raises(openai.BadRequestError, match=message):
                    client.chat.completions.create(
                        model=QWEN_SERVED, messages=MESSAGES, tools=TOOLS, **choice
                    )


def test_startup_refusals(tiny_qwen3_path):
    from pydantic import ValidationError

    from gateway.__main__ import main, parse_args, settings_from_args

    with pytest.raises(ValidationError, match="--enable-auto-tool-choice requires --tool-call"):
        settings_from_args(parse_args(["--model", "m", "--enable-auto-tool-choice"]))
    with pytest.raises(ValidationError, match="invalid tool call parser: nope"):
        settings_from_args(parse_args(["--model", "m", "--tool-call-parser", "nope"]))
    # The tiny test tokenizer has no <tool_call> token: hermes cannot work with it.
    argv = ["--model", str(tiny_qwen3_path), "--port", "0", "--decode", "127.0.0.1:1"]
    with pytest.raises(SystemExit, match="Hermes 2 Pro Tool parser could not locate"):
        main([*argv, "--tool-call-parser", "hermes"])
    load_parsers.cache_clear()
    with pytest.raises(ToolParserError):
        load_parsers("hermes", None, _NoTags())


class _NoTags:
    def get_vocab(self) -> dict[str, int]:
        return {}


# ---- end to end: "auto" with hermes, on a scripted output ----------------------------------


def _stream_calls(client, **kwargs):
    """content, [(id, name, arguments)], finish_reason, and every tool call delta."""
    content, calls, deltas, finish = "", {}, [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                deltas.append(d)
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name  # the first delta
                    calls[d.index] = [d.id, d.function.name, ""]
                else:
                    assert d.id is None and d.function.name is None
                calls[d.index][2] += d.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, deltas


AUTO_HERMES = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}


def test_auto_hermes_calls_streamed_and_not(qwen, qwen_gateway):
    qwen.decode.script = qwen.encode(HERMES) + [QWEN_IM_END_ID]
    assert QWEN_TOOL_CALL_ID in qwen.decode.script  # `<tool_call>` is one token
    kwargs = dict(model=QWEN_SERVED, messages=MESSAGES, tools=TOOLS)
    with qwen_gateway(**AUTO_HERMES) as client:
        choice = client.chat.completions.create(**kwargs).choices[0]
        qwen.decode.script_interval_s = 0.02  # generated slower than streamed: one piece each
        content, calls, finish, deltas = _stream_calls(client, **kwargs)
    assert choice.finish_reason == "tool_calls" and finish == "tool_calls"
    assert choice.message.content == content == "Let me check.\n"
    expected = [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
        ("get_time", '{"zone": "CET"}'),
    ]
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == expected
    assert [(name, arguments) for _, name, arguments in calls] == expected
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert len(deltas) > 4  # arguments arrive in pieces, as they are generated


def test_hermes_keeps_special_tags_in_the_text():
    """Where the tags are special tokens, skipping special tokens would hide the calls."""

    class Special(_Vocab):
        all_special_tokens = ["<|im_end|>", "<tool_call>", "</tool_call>"]

    assert TOOL_PARSERS["hermes"](Special()).adjust_request() == {"skip_special_tokens": False}
    assert TOOL_PARSERS["hermes"](_Vocab()).adjust_request() == {}  # Qwen3: not special


def test_parallel_tool_calls_false_keeps_the_first(qwen, qwen_gateway):
    qwen.decode.script = qwen.encode(HERMES) + [QWEN_IM_END_ID]
    kwargs = dict(model=QWEN_SERVED, messages=MESSAGES, tools=TOOLS, parallel_tool_calls=False)
    with qwen_gateway(**AUTO_HERMES) as client:
        message = client.chat.completions.create(**kwargs).choices[0].message
        _, calls, _, _ = _stream_calls(client, **kwargs)
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert [name for _, name, _ in calls] == ["get_weather"]


def test_auto_without_a_call_is_plain_content(qwen, qwen_gateway):
    qwen.decode.script = qwen.encode("It is sunny <in> Paris.") + [QWEN_IM_END_ID]
    kwargs = dict(model=QWEN_SERVED, messages=MESSAGES, tools=TOOLS)
    with qwen_gateway(**AUTO_HERMES) as client:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, calls, finish, _ = _stream_calls(client, **kwargs)
    assert choice.message.content == content == "It is sunny <in> Paris."
    assert choice.message.tool_calls == [] and calls == []
    assert choice.finish_reason == finish == "stop"


# ---- end to end on the engine: structured outputs force the calls --------------------------


def _validates(schema: dict, arguments: str) -> bool:
    return jsonschema_rs.validator_for(schema).is_valid(json.loads(arguments))


def test_required_tool_choice_gives_calls_matching_the_schema(qwen, qwen_gateway):
    kwargs = dict(
        model=QWEN_SERVED,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=200,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    with qwen_gateway() as client:  # no parser flag needed
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, calls, finish, _ = _stream_calls(client, **kwargs)
    assert choice.finish_reason == finish == "tool_calls"
    assert choice.message.tool_calls and choice.message.content == ""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in choice.message.tool_calls:
        assert _validates(schemas[call.function.name], call.function.arguments)
    assert [(n, a) for _, n, a in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    so = qwen.decode.record.requests[0].params.structured_outputs
    assert json.loads(so.json) == required_schema([t["function"] for t in TOOLS])


def test_named_tool_choice_gives_that_tool_call(qwen, qwen_gateway):
    named = {"type": "function", "function": {"name": "get_time"}}
    kwargs = dict(
        model=QWEN_SERVED,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=named,
        temperature=0,
        max_tokens=100,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    with qwen_gateway() as client:
        choice = client.chat.completions.create(**kwargs).choices[0]
        _, calls, finish, _ = _stream_calls(client, **kwargs)
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and choice.finish_reason == finish == "stop"
    assert _validates(TIME["function"]["parameters"], call.function.arguments)
    assert [(n, a) for _, n, a in calls] == [("get_time", call.function.arguments)]
    # The same constraint on the offline engine gives the same arguments.
    so = StructuredOutputsParams(json=TIME["function"]["parameters"], disable_any_whitespace=True)
    params = SamplingParams(temperature=0, max_tokens=100, structured_outputs=so)
    offline = qwen.llm.chat(MESSAGES, params, chat_template_kwargs={"tools": TOOLS})
    assert call.function.arguments == offline[0].outputs[0].text


def test_auto_hermes_on_the_engine(qwen, qwen_gateway):
    """A call the engine generates (forced by a regex), read by the hermes parser."""
    regex = (
        r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
        r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>'
    )
    kwargs = dict(
        model=QWEN_SERVED,
        messages=MESSAGES,
        tools=TOOLS,
        temperature=0,
        max_tokens=100,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    with qwen_gateway(**AUTO_HERMES) as client:
        choice = client.chat.completions.create(**kwargs).choices[0]
        _, calls, _, _ = _stream_calls(client, **kwargs)
    params = SamplingParams(
        temperature=0,
        max_tokens=100,
        skip_special_tokens=False,
        structured_outputs=StructuredOutputsParams(regex=regex),
    )
    text = qwen.llm.chat(MESSAGES, params, chat_template_kwargs={"tools": TOOLS})[0].outputs[0].text
    expected = TOOL_PARSERS["hermes"](qwen.model_info.tokenizer).extract_tool_calls(text)
    assert expected.tools_called and choice.finish_reason == "tool_calls"
    pairs = [(c.name, c.arguments) for c in expected.tool_calls]
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == pairs
    assert [(n, a) for _, n, a in calls] == pairs
