"""Structured outputs through the SDK: `response_format`, `structured_outputs` (extra_body) and
vLLM's deprecated `guided_*`, on chat and completions, with vLLM's errors.

The engine applies the grammar (engine/structured_output.py); the gateway's part is to turn the
request into one `StructuredOutputsParams` (gateway/structured.py) and to surface an invalid
constraint as a 400. Outputs are greedy, so each equals the offline engine with the same
constraint; a random model fills whitespace forever where a schema allows it, so most requests
ask for `disable_any_whitespace`.
"""

from __future__ import annotations

import json
import re

import jsonschema_rs
import openai
import pytest

from engine.sampling_params import SamplingParams, StructuredOutputsParams
from tests.gateway.qwen_gateway import (  # noqa: F401 (fixtures)
    QWEN_SERVED,
    qwen_fixture,
    qwen_gateway_fixture,
    reset_qwen_decode_fixture,
)

MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
        "sunny": {"type": "boolean"},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "sunny", "rank"],
    "additionalProperties": False,
}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


@pytest.fixture(scope="module")
def client(qwen_gateway):
    with qwen_gateway() as client:
        yield client


def _chat(client, max_tokens=60, **kwargs) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=QWEN_SERVED, messages=MESSAGES, temperature=0, max_tokens=max_tokens, **kwargs
    )


def _offline(qwen, max_tokens=60, **constraint) -> str:
    params = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**constraint),
    )
    return qwen.llm.chat(MESSAGES, params)[0].outputs[0].text


def test_response_format_json_schema_validates(qwen, client):
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    choice = _chat(client, response_format=response_format, extra_body=COMPACT).choices[0]
    assert choice.finish_reason == "stop"
    assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(choice.message.content))
    assert choice.message.content == _offline(qwen, json=SCHEMA, disable_any_whitespace=True)
    so = qwen.decode.record.requests[0].params.structured_outputs
    assert json.loads(so.json) == SCHEMA and so.disable_any_whitespace
    # Streamed, the same text.
    stream = client.chat.completions.create(
        model=QWEN_SERVED,
        messages=MESSAGES,
        temperature=0,
        max_tokens=60,
        stream=True,
        response_format=response_format,
        extra_body=COMPACT,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == choice.message.content


def test_response_format_json_object_parses(qwen, client):
    """Any JSON object. Left alone, the random model writes one endless key; a bias towards
    closing braces lets it finish, and only the grammar makes that `{}` rather than `}`."""
    tokenizer = qwen.model_info.tokenizer
    bias = {tokenizer.convert_tokens_to_ids(t): 100 for t in ("{}", "}")}
    choice = _chat(
        client,
        response_format={"type": "json_object"},
        logit_bias={str(k): v for k, v in bias.items()},
        extra_body=COMPACT,
    ).choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)
    assert qwen.decode.record.requests[0].params.structured_outputs.json_object
    params = SamplingParams(
        temperature=0,
        max_tokens=60,
        logit_bias=bias,
        structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    )
    assert choice.message.content == qwen.llm.chat(MESSAGES, params)[0].outputs[0].text


@pytest.mark.parametrize(
    "constraint, check",
    [
        ({"json": SCHEMA}, lambda t: jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(t))),
        ({"regex": r"[a-z]{3,8}@example\.(com|org)"}, None),
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        (
            {"grammar": 'root ::= num " + " num\nnum ::= [1-9] [0-9]?'},
            lambda t: re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]?", t),
        ),
    ],
    ids=["json", "regex", "choice", "grammar"],
)
def test_structured_outputs_kinds_constrain_the_output(qwen, client, constraint, check):
    body = {"structured_outputs": {**constraint, "disable_any_whitespace": True}}
    choice = _chat(client, extra_body=body).choices[0]
    text = choice.message.content
    assert choice.finish_reason == "stop", text
    if check is None:
        assert re.fullmatch(constraint["regex"], text), text
    else:
        assert check(text), text
    assert text == _offline(qwen, **constraint, disable_any_whitespace=True)


@pytest.mark.parametrize(
    "legacy, modern",
    [
        ({"guided_json": SCHEMA}, {"json": SCHEMA}),
        ({"guided_json": json.dumps(SCHEMA)}, {"json": json.dumps(SCHEMA)}),
        ({"guided_regex": "(yes|no), [0-9]"}, {"regex": "(yes|no), [0-9]"}),
        ({"guided_choice": ["up", "down"]}, {"choice": ["up", "down"]}),
        ({"guided_grammar": 'root ::= "a" | "b"'}, {"grammar": 'root ::= "a" | "b"'}),
    ],
    ids=["json", "json-text", "regex", "choice", "grammar"],
)
def test_legacy_guided_fields_equal_structured_outputs(qwen, client, legacy, modern):
    """vLLM maps the deprecated guided_* fields onto structured_outputs."""
    old = _chat(client, extra_body=legacy).choices[0].message.content
    new = _chat(client, extra_body={"structured_outputs": modern}).choices[0].message.content
    assert old == new
    first, second = (r.params.structured_outputs for r in qwen.decode.record.requests)
    assert first == second


def test_structural_tag_reaches_the_decode(qwen, client):
    """Free text until the model writes a trigger, then the tag's schema (the random model
    never writes one here: the point is that the engine accepts the tag)."""
    tag = {
        "structures": [{"begin": "<city>", "schema": SCHEMA, "end": "</city>"}],
        "triggers": ["<city>"],
    }
    _chat(client, max_tokens=5, extra_body={"structural_tag": json.dumps(tag)})
    _chat(client, max_tokens=5, response_format={"type": "structural_tag", **tag})
    legacy, response_format = (r.params.structured_outputs for r in qwen.decode.record.requests)
    assert json.loads(legacy.structural_tag) == tag
    assert json.loads(response_format.structural_tag) == {"type": "structural_tag", **tag}


def test_completions_take_response_format_and_structured_outputs(qwen, client):
    resp = client.completions.create(
        model=QWEN_SERVED,
        prompt="A city:",
        temperature=0,
        max_tokens=60,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "c", "schema": SCHEMA},
            },
            **COMPACT,
        },
    )
    assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(resp.choices[0].text))
    resp = client.completions.create(
        model=QWEN_SERVED,
        prompt="A colour:",
        temperature=0,
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["red", "green"]}},
    )
    assert resp.choices[0].text in ("red", "green")


@pytest.mark.parametrize(
    "body, param, message",
    [
        (
            {"structured_outputs": {"regex": "a+"}, "guided_choice": ["a"]},
            "guided_choice",
            "You can only use one kind of structured outputs constraint",
        ),
        (
            {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
            "structured_outputs",
            "You can only use one kind of structured outputs constraint",
        ),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
            "guided_regex",
            "You can only use one kind of structured outputs constraint",
        ),
        (
            {"structured_outputs": {"disable_any_whitespace": True}},
            "structured_outputs",
            "structured_outputs must set one constraint",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "needs json_schema.schema",
        ),
        (
            {"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}},
            None,
            "structured_outputs.whitespace_pattern: Extra inputs are not permitted",
        ),
        (
            {"guided_decoding_backend": "outlines", "guided_regex": "a+"},
            "guided_decoding_backend",
            "guided_decoding_backend is not currently supported (request-level structured "
            "output backend selection)",
        ),
        (
            {"guided_whitespace_pattern": " ", "guided_regex": "a+"},
            "guided_whitespace_pattern",
            "guided_whitespace_pattern is not currently supported",
        ),
    ],
)
def test_conflicting_or_unsupported_constraints_are_400(qwen, client, body, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, extra_body=body)
    assert message in info.value.body["message"]
    if param is not None:
        assert info.value.body["param"] == param
    assert qwen.decode.record.requests == []


@pytest.mark.parametrize(
    "body, message",
    [
        ({"structured_outputs": {"json": {"type": "foo"}}}, "Invalid JSON schema"),
        ({"guided_json": '{"type": '}, "Invalid JSON schema"),
        ({"structured_outputs": {"regex": "(a"}}, "Invalid regex"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "Invalid grammar"),
    ],
)
def test_invalid_constraints_are_400_from_the_engine(qwen, client, body, message):
    """The engine builds the grammar at admission; its ValueError is the decode's
    INVALID_ARGUMENT, which the gateway returns as a 400 with the engine's message."""
    with pytest.raises(openai.BadRequestError, match=message):
        _chat(client, extra_body=body)
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(
            model=QWEN_SERVED, messages=MESSAGES, max_tokens=5, stream=True, extra_body=body
        )
