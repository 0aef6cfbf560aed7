"""Request fields → the engine's `StructuredOutputsParams` (vLLM's `to_sampling_params` rules).

A constraint may come from one of:
  `structured_outputs` {json | regex | choice | grammar | json_object | structural_tag};
  `response_format` {json_object | json_schema | structural_tag} (`text` constrains nothing);
  vLLM's deprecated `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and
    `structural_tag`, which it maps onto structured_outputs;
  `tool_choice` "required" or a named tool (the calls' schema, `gateway/tool_parsers/forced.py`).
`structured_outputs` may carry options only (`disable_any_whitespace`) next to another source,
as vLLM allows. Two constraints are a 400: vLLM's validators refuse most such pairs and
silently let one win over the other in the rest; here none is silently dropped.

With a reasoning parser the constraint starts after the reasoning: its `<think>` / `</think>`
ids go along, and the engine leaves the tokens up to the end of the reasoning free.
"""

from __future__ import annotations

import json
from typing import Any

from engine.sampling_params import StructuredOutputsParams
from gateway.errors import bad_request
from gateway.protocol import ResponseFormat, SamplingFields
from gateway.reasoning import ReasoningParser

_LEGACY = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "structural_tag": "structural_tag",
}
_TOOLS_AND_CONSTRAINT = (
    "You can only either use constraints for structured outputs or tools, not both."
)


def structured_outputs_params(
    req: SamplingFields,
    tool_schema: dict[str, Any] | None = None,
    reasoning: ReasoningParser | None = None,
) -> StructuredOutputsParams | None:
    """The request's one constraint, or None; a 400 naming the field for a bad one."""
    sources: list[tuple[str, dict[str, Any]]] = []  # (field, constraint kwargs)
    options: dict[str, Any] = {}
    so = req.structured_outputs
    if so is not None:
        options["disable_any_whitespace"] = so.disable_any_whitespace
        kinds = {
            kind: value
            for kind, value in (
                ("json", so.json_),
                ("regex", so.regex),
                ("choice", so.choice),
                ("grammar", so.grammar),
                ("json_object", so.json_object or None),  # false: no constraint
                ("structural_tag", _as_json_text(so.structural_tag)),
            )
            if value is not None
        }
        if kinds:
            sources.append(("structured_outputs", kinds))
    if req.response_format is not None and req.response_format.type != "text":
        sources.append(("response_format", _from_response_format(req.response_format)))
    for name, kind in _LEGACY.items():
        value = getattr(req, name)
        if value is not None:
            sources.append((name, {kind: value}))
    if tool_schema is not None:
        sources.append(("tool_choice", {"json": tool_schema}))

    if not sources:
        if so is not None:
            raise bad_request(
                "structured_outputs must set one constraint: json, regex, choice, grammar, "
                "json_object or structural_tag.",
                "structured_outputs",
            )
        return None
    if len(sources) > 1:
        names = [name for name, _ in sources]
        if "tool_choice" in names:
            raise bad_request(_TOOLS_AND_CONSTRAINT, "tool_choice")
        raise bad_request(
            "You can only use one kind of structured outputs constraint, but "
            f"{' and '.join(names)} each set one.",
            names[1],
        )
    field, kwargs = sources[0]
    if reasoning is not None:
        options["reasoning_start_token_id"] = reasoning.start_token_id
        options["reasoning_end_token_id"] = reasoning.end_token_id
    try:
        return StructuredOutputsParams(**kwargs, **options)
    except ValueError as e:
        raise bad_request(str(e), field) from e


def _from_response_format(rf: ResponseFormat) -> dict[str, Any]:
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise bad_request(
                "response_format of type 'json_schema' needs json_schema.schema.",
                "response_format",
            )
        return {"json": rf.json_schema.json_schema}
    assert rf.type == "structural_tag", rf.type
    # vLLM passes the whole object on; the engine reads `format` or `structures`/`triggers`.
    return {
        "structural_tag": json.dumps(rf.model_dump(exclude={"json_schema"}), ensure_ascii=False)
    }


def _as_json_text(value: str | dict[str, Any] | None) -> str | None:
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else value


def structured_extra(
    req: SamplingFields,
    tool_schema: dict[str, Any] | None = None,
    reasoning: ReasoningParser | None = None,
) -> dict[str, Any]:
    """`make_jobs(extra=...)`: the constraint, when the request sets one."""
    so = structured_outputs_params(req, tool_schema, reasoning)
    return {} if so is None else {"structured_outputs": so}
