"""SamplingParams and logprobs to and from their protos: one converter for the gateway, the
prefill and the decode services (pure Python: the gateway imports it without torch)."""

from __future__ import annotations

import json

from engine.sampling_params import SamplingParams, StructuredOutputsParams
from protos import common_pb2


def sampling_params_to_proto(sp: SamplingParams) -> common_pb2.SamplingParams:
    """Token-level fields only: stop strings stay at the gateway. `max_tokens` must be resolved
    (the gateway caps it to max_model_len before sending)."""
    assert sp.max_tokens is not None, "max_tokens is resolved before a request is sent"
    return common_pb2.SamplingParams(
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=max(sp.top_k, 0),
        min_p=sp.min_p,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        seed=sp.seed,
        max_tokens=sp.max_tokens,
        min_tokens=sp.min_tokens,
        stop_token_ids=list(sp.stop_token_ids or []),
        ignore_eos=sp.ignore_eos,
        logprobs=sp.logprobs,
        logit_bias=dict(sp.logit_bias or {}),
        prompt_logprobs=sp.prompt_logprobs,
        structured_outputs=(
            None
            if sp.structured_outputs is None
            else structured_outputs_to_proto(sp.structured_outputs)
        ),
    )


def sampling_params_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError (vLLM's messages) for invalid values."""
    return SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens,
        min_tokens=p.min_tokens,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        logit_bias=dict(p.logit_bias) or None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        structured_outputs=(
            structured_outputs_from_proto(p.structured_outputs)
            if p.HasField("structured_outputs")
            else None
        ),
    )


def structured_outputs_to_proto(so: StructuredOutputsParams) -> common_pb2.StructuredOutputs:
    msg = common_pb2.StructuredOutputs(
        disable_any_whitespace=so.disable_any_whitespace,
        reasoning_start_token_id=so.reasoning_start_token_id,
        reasoning_end_token_id=so.reasoning_end_token_id,
    )
    kind = so.kind
    if kind == "json":
        msg.json = so.json if isinstance(so.json, str) else json.dumps(so.json)
    elif kind == "choice":
        msg.choice.choices.extend(so.choice or [])
    elif kind == "json_object":
        msg.json_object = bool(so.json_object)
    else:
        setattr(msg, kind, getattr(so, kind))
    return msg


def structured_outputs_from_proto(msg: common_pb2.StructuredOutputs) -> StructuredOutputsParams:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_outputs names no constraint (json, regex, choice, ...).")
    value = list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    return StructuredOutputsParams(
        **{kind: value},
        disable_any_whitespace=msg.disable_any_whitespace,
        reasoning_start_token_id=(
            msg.reasoning_start_token_id if msg.HasField("reasoning_start_token_id") else None
        ),
        reasoning_end_token_id=(
            msg.reasoning_end_token_id if msg.HasField("reasoning_end_token_id") else None
        ),
    )


def logprobs_to_proto(lp: dict[int, float]) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(token_ids=list(lp), logprobs=list(lp.values()))


def logprobs_from_proto(p: common_pb2.TokenLogprobs) -> dict[int, float]:
    return dict(zip(p.token_ids, p.logprobs))
