"""No request field is silently ignored: each one the request models declare is implemented
(with a test, named here, that shows its effect), refused with a 400 naming it when set to a
value that would change something (`UNSUPPORTED`), or documented as having no effect by the
API's own definition (`NO_EFFECT`). A field added to a model without being classified, or a
refused field without an example value here, fails `test_every_field_is_classified`.
"""

from __future__ import annotations

import importlib
import logging

import httpx
import openai
import pytest

from gateway.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from tests.gateway.conftest import SERVED_NAME

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MODELS: dict[str, type[SamplingFields]] = {
    CHAT: ChatCompletionRequest,
    COMPLETIONS: CompletionRequest,
}
BASE = {
    CHAT: {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    COMPLETIONS: {"model": SERVED_NAME, "prompt": "Hi", "max_tokens": 1},
}

# Implemented fields → tests (module::function under tests/gateway) showing their effect.
_REACH_DECODE = "test_chat::test_extra_body_fields_reach_the_decode"
IMPLEMENTED_SHARED = {
    "model": ["test_errors::test_unknown_model_is_404"],
    "n": [
        "test_chat::test_n2_with_seed_is_reproducible",
        "test_completions::test_batch_of_text_prompts_with_n",
    ],
    "stop": ["test_chat::test_stop_string_cuts_text", "test_completions::test_stop_string"],
    "seed": ["test_chat::test_n2_with_seed_is_reproducible"],
    "max_tokens": ["test_completions::test_text_prompt_matches_offline"],
    "temperature": [_REACH_DECODE, "test_chat::test_greedy_matches_offline"],
    "top_p": [_REACH_DECODE],
    "presence_penalty": [_REACH_DECODE],
    "frequency_penalty": [_REACH_DECODE],
    "stream": ["test_chat::test_stream_matches_offline_with_usage"],
    "stream_options": [
        "test_completions::test_stream_with_usage",
        "test_completions::test_no_usage_chunk_unless_asked",
    ],
    "top_k": [_REACH_DECODE],
    "min_p": [_REACH_DECODE],
    "repetition_penalty": [_REACH_DECODE],
    "min_tokens": [_REACH_DECODE],
    "ignore_eos": [_REACH_DECODE],
    "stop_token_ids": [_REACH_DECODE],
    "skip_special_tokens": ["test_field_effects::test_skip_special_tokens"],
    "include_stop_str_in_output": ["test_chat::test_include_stop_str_in_output"],
    "priority": [_REACH_DECODE],
    "cache_salt": [
        "test_security::test_auth_off_keeps_vllm_cache_salt",
        "test_security::test_cache_salt_is_the_tenants",
    ],
    "logit_bias": [
        "test_eval_path::test_logit_bias_forces_a_token",
        "test_eval_path::test_logit_bias_reaches_the_decode_clamped",
    ],
    # Structured outputs (test_structured_outputs.py).
    "response_format": [
        "test_structured_outputs::test_response_format_json_object_parses",
        "test_structured_outputs::test_response_format_json_schema_validates",
        "test_structured_outputs::test_completions_take_response_format_and_structured_outputs",
    ],
    "structured_outputs": [
        "test_structured_outputs::test_structured_outputs_kinds_constrain_the_output",
        "test_structured_outputs::test_completions_take_response_format_and_structured_outputs",
    ],
    "guided_json": ["test_structured_outputs::test_legacy_guided_fields_equal_structured_outputs"],
    "guided_regex": ["test_structured_outputs::test_legacy_guided_fields_equal_structured_outputs"],
    "guided_choice": [
        "test_structured_outputs::test_legacy_guided_fields_equal_structured_outputs"
    ],
    "guided_grammar": [
        "test_structured_outputs::test_legacy_guided_fields_equal_structured_outputs"
    ],
    "structural_tag": ["test_structured_outputs::test_structural_tag_reaches_the_decode"],
}
IMPLEMENTED = {
    CHAT: {
        **IMPLEMENTED_SHARED,
        "messages": ["test_chat::test_greedy_matches_offline"],
        "max_completion_tokens": ["test_chat::test_stream_matches_offline_with_usage"],
        "logprobs": ["test_chat::test_logprobs"],
        "top_logprobs": ["test_chat::test_logprobs"],
        "add_generation_prompt": ["test_field_effects::test_add_generation_prompt"],
        "prompt_logprobs": ["test_eval_path::test_prompt_logprobs_chat"],
        "chat_template_kwargs": ["test_field_effects::test_chat_template_kwargs"],
        "add_special_tokens": ["test_field_effects::test_chat_add_special_tokens"],
        # Tools and reasoning (test_tools.py, test_reasoning.py).
        "tools": [
            "test_tools::test_tools_and_tool_messages_are_rendered_by_the_template",
            "test_tools::test_required_tool_choice_gives_calls_matching_the_schema",
        ],
        "tool_choice": [
            "test_tools::test_required_tool_choice_gives_calls_matching_the_schema",
            "test_tools::test_named_tool_choice_gives_that_tool_call",
            "test_tools::test_auto_hermes_calls_streamed_and_not",
            "test_tools::test_auto_needs_the_flags",
        ],
        "parallel_tool_calls": ["test_tools::test_parallel_tool_calls_false_keeps_the_first"],
        "include_reasoning": ["test_reasoning::test_include_reasoning_false_drops_it"],
        "reasoning_effort": ["test_reasoning::test_reasoning_effort_reaches_the_template"],
    },
    COMPLETIONS: {
        **IMPLEMENTED_SHARED,
        "prompt": ["test_completions::test_text_prompt_matches_offline"],
        "logprobs": ["test_completions::test_logprobs"],
        "add_special_tokens": ["test_field_effects::test_add_special_tokens"],
        "prompt_logprobs": ["test_eval_path::test_prompt_logprobs_completions"],
        "echo": [
            "test_eval_path::test_echo_prepends_the_prompt",
            "test_eval_path::test_echo_logprobs_equal_transformers",
            "test_eval_path::test_max_tokens_zero_with_echo_returns_the_prompt_only",
        ],
    },
}

# For every UNSUPPORTED field, values that must be refused ...
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
REFUSED_EXAMPLES = {
    "echo": [True, 1],  # chat (completions implement it)
    "guided_decoding_backend": ["outlines", "guidance"],
    "guided_whitespace_pattern": [" "],
    "use_beam_search": [True],
    "length_penalty": [0.5],
    "allowed_token_ids": [[5, 6]],
    "bad_words": [["the"]],
    "logits_processors": [["pkg.Processor"]],
    "truncate_prompt_tokens": [5],
    "spaces_between_special_tokens": [False],
    "return_tokens_as_token_ids": [True],
    "return_token_ids": [True],
    "request_id": ["mine"],
    "kv_transfer_params": [{"do_remote_prefill": True}],
    "vllm_xargs": [{"a": 1}],
    # chat
    "functions": [[{"name": "f", "parameters": {}}]],
    "function_call": ["auto", {"name": "f"}],
    "continue_final_message": [True],
    "chat_template": ["{{ 'x' }}"],
    "documents": [[{"title": "t", "text": "d"}]],
    "mm_processor_kwargs": [{"a": 1}],
    "audio": [{"voice": "alloy", "format": "wav"}],
    "modalities": [["text", "audio"]],
    "prediction": [{"type": "content", "content": "x"}],
    "web_search_options": [{}],
    "verbosity": ["low"],
    "moderation": [{"model": "omni-moderation-latest"}],
    "store": [True],
    "service_tier": ["flex", "priority"],
    # completions
    "suffix": ["the end", ""],
    "best_of": [2, 3],
    "prompt_embeds": ["AAAA"],
}
# ... and values that change nothing, so are accepted (besides null, always accepted).
NOOP_EXAMPLES = {
    "echo": False,
    "guided_decoding_backend": "xgrammar",
    "use_beam_search": False,
    "length_penalty": 1,
    "bad_words": [],
    "spaces_between_special_tokens": True,
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "functions": [],
    "function_call": "none",
    "continue_final_message": False,
    "modalities": ["text"],
    "store": False,
    "service_tier": "auto",
    "best_of": 1,
}
NO_EFFECT_EXAMPLES = {
    "user": "user-1234",
    "metadata": {"team": "qa"},
    "safety_identifier": "hashed-user",
    "prompt_cache_key": "conversation-7",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit"},
}

REFUSED_CASES = [
    (path, field, value)
    for path, model in MODELS.items()
    for field in model.UNSUPPORTED
    for value in REFUSED_EXAMPLES.get(field, [None])  # None: missing, reported below
]


def _post(url: str, path: str, **fields) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={**BASE[path], **fields}, timeout=30)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_every_field_is_classified(path):
    model = MODELS[path]
    implemented, refused, no_effect = (
        set(IMPLEMENTED[path]),
        set(model.UNSUPPORTED),
        set(model.NO_EFFECT),
    )
    assert not implemented & refused and not implemented & no_effect and not refused & no_effect
    unclassified = set(model.model_fields) - implemented - refused - no_effect
    assert not unclassified, (
        f"{model.__name__} fields {sorted(unclassified)} are neither implemented (add them to "
        "IMPLEMENTED here with a test showing their effect) nor refused/no-effect (add them to "
        f"{model.__name__}.UNSUPPORTED or NO_EFFECT in gateway/protocol.py)"
    )
    stale = (implemented | refused | no_effect) - set(model.model_fields)
    assert not stale, f"classified but not fields of {model.__name__}: {sorted(stale)}"
    missing = refused - set(REFUSED_EXAMPLES)
    assert not missing, f"add values that must be refused to REFUSED_EXAMPLES: {sorted(missing)}"
    assert no_effect <= set(NO_EFFECT_EXAMPLES)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_implemented_fields_name_existing_tests(path):
    for field, tests in IMPLEMENTED[path].items():
        assert tests, field
        for test in tests:
            module, function = test.split("::")
            mod = importlib.import_module(f"tests.gateway.{module}")
            assert callable(getattr(mod, function, None)), f"{field}: no test {test}"


@pytest.mark.parametrize("path, field, value", REFUSED_CASES)
def test_refused_fields_are_400_naming_the_field(gateway_url, fake, path, field, value):
    assert field in REFUSED_EXAMPLES, f"no refused example for {field}"
    resp = _post(gateway_url, path, **{field: value})
    assert resp.status_code == 400, (field, value, resp.text)
    error = resp.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == field
    assert error["message"].startswith(f"{field} is not currently supported")
    assert fake.record.requests == []


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_noop_values_of_refused_fields_are_accepted(gateway_url, fake, path):
    model = MODELS[path]
    nulls = {field: None for field in model.UNSUPPORTED}
    assert _post(gateway_url, path, **nulls).status_code == 200
    noops = {k: v for k, v in NOOP_EXAMPLES.items() if k in model.UNSUPPORTED}
    resp = _post(gateway_url, path, **noops)
    assert resp.status_code == 200, resp.text
    assert len(fake.record.requests) == 2


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_no_effect_fields_change_nothing(gateway_url, fake, path):
    model = MODELS[path]
    greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    plain = _post(gateway_url, path, **greedy)
    extras = {k: v for k, v in NO_EFFECT_EXAMPLES.items() if k in model.NO_EFFECT}
    assert extras
    tagged = _post(gateway_url, path, **greedy, **extras)
    assert plain.status_code == tagged.status_code == 200, tagged.text
    assert plain.json()["choices"] == tagged.json()["choices"]
    first, second = fake.record.requests
    assert first.params == second.params and first.prompt_token_ids == second.prompt_token_ids


def test_best_of_must_match_n_of_one(gateway_url):
    resp = _post(gateway_url, COMPLETIONS, best_of=1, n=2)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "best_of"


def test_sdk_raises_bad_request_naming_the_field(client):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError, match="functions is not currently supported"):
        client.chat.completions.create(
            model=SERVED_NAME, messages=messages, functions=[_TOOL["function"]]
        )
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SERVED_NAME, prompt="x", suffix="!")
    assert info.value.body["message"].startswith("suffix is not currently supported")
    with pytest.raises(openai.BadRequestError, match="echo is not currently supported"):
        client.chat.completions.create(
            model=SERVED_NAME, messages=messages, extra_body={"echo": True}
        )
    with pytest.raises(openai.BadRequestError, match="best_of is not currently supported"):
        client.completions.create(model=SERVED_NAME, prompt="x", best_of=2)
    with pytest.raises(openai.BadRequestError, match="guided_decoding_backend is not curr"):
        client.completions.create(
            model=SERVED_NAME, prompt="x", extra_body={"guided_decoding_backend": "outlines"}
        )


@pytest.mark.parametrize(
    "key", ["chat_template", "tools", "add_generation_prompt", "tokenize", "messages"]
)
def test_chat_template_kwargs_cannot_smuggle_refused_or_gateway_fields(gateway_url, fake, key):
    resp = _post(gateway_url, CHAT, chat_template_kwargs={key: "{{ 'x' }}"})
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert "chat_template_kwargs" in message and repr(key) in message
    assert fake.record.requests == []


def test_unknown_fields_are_ignored_with_a_warning(gateway_url, fake, caplog):
    """vLLM's behaviour for names it does not know: newer SDKs keep working."""
    with caplog.at_level(logging.WARNING, logger="gateway.protocol"):
        resp = _post(gateway_url, COMPLETIONS, some_future_option=1, x_trace="abc")
    assert resp.status_code == 200, resp.text
    warnings = [r.getMessage() for r in caplog.records if r.name == "gateway.protocol"]
    assert any("'some_future_option', 'x_trace'" in w and "ignored" in w for w in warnings)
