"""Request bodies of the OpenAI API, with vLLM's extra sampling fields.

Every field a request model declares is one of three kinds, and a client never gets a 200 for a
value the gateway would silently ignore (tests/gateway/test_request_fields.py walks
`model_fields` and fails on a field that is none of them):
  implemented: it has an effect, shown by a test that file names;
  `UNSUPPORTED`: a real OpenAI / vLLM parameter not implemented yet; accepted only at a value
    that changes nothing (unset, empty, false, ...), anything else is a 400 naming it;
  `NO_EFFECT`: accepted at any well-typed value because, by the API's own definition, it does
    not change the completion (an end-user id, cache hints).
Fields no model declares are ignored with a warning log, as vLLM does, so newer SDKs keep working.

Input is strict: no bool for an int, no "0.5" for a float, no "yes" for a bool; NaN and
±Infinity are refused; integers stay within the proto's int32 (seed: int64); no string anywhere in
the body may hold a lone UTF-16 surrogate (JSON can spell "\\ud800", UTF-8 cannot carry it).
`None` means "not set by the client": the model's generation_config.json then supplies the
default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

logger = logging.getLogger(__name__)

# A validation context key: True when the body's strings are known to be valid UTF-8 (parsed by
# jiter, which refuses lone surrogates), so `_find_lone_surrogate`'s walk is skipped.
UTF8_CHECKED = "utf8_checked"

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
Int32 = Annotated[int, Field(ge=_INT32_MIN, le=_INT32_MAX)]
Int64 = Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)]  # vLLM bounds `seed` the same way

# strict: JSON types as declared (pydantic's lax mode would take true for 1 and "0.5" for 0.5).
_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


@dataclass(frozen=True)
class Unsupported:
    """A parameter the gateway does not implement: the values that change nothing are accepted,
    any other is refused with "`name` is not currently supported" (vLLM's wording)."""

    noop_values: tuple[Any, ...] = (None,)
    allowed: str = "leave it unset"  # how to send the request instead, for the message
    what: str = ""  # what is missing, for the message
    is_noop: Callable[[Any, Any], bool] | None = None  # (value, request); overrides noop_values

    def accepts(self, value: Any, request: Any) -> bool:
        if self.is_noop is not None:
            return self.is_noop(value, request)
        # Compare types too: JSON's 0 and 1 are not false and true.
        return any(type(value) is type(v) and value == v for v in self.noop_values)

    def message(self, name: str) -> str:
        what = f" ({self.what})" if self.what else ""
        return f"{name} is not currently supported{what}; {self.allowed}."


_TOOLS = "OpenAI's deprecated functions API; use tools and tool_choice"
_UNSET_OR_FALSE = Unsupported((None, False), "leave it unset or false")


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# --- Structured outputs and tools (gateway/structured.py, gateway/chat_tools.py use them).
class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`. `strict` changes nothing: the output always follows the
    schema (vLLM ignores it too)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # `schema` shadows pydantic
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`; vLLM's `structural_tag` type carries its own keys
    (`format`, or the legacy `structures` and `triggers`), kept as extras."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` body: one constraint plus options. Keys vLLM's other
    backends read (`whitespace_pattern`, `disable_additional_properties`, ...) are refused:
    the engine runs xgrammar only."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatCompletionTool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    type: Literal["function"] = "function"
    function: FunctionDefinition


class SamplingFields(BaseModel):
    """Fields shared by chat and completions."""

    model_config = _STRICT

    model: str | None = None
    n: Int32 = 1
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extra-body fields.
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int32 = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int32] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int32 = 0
    cache_salt: str | None = None

    # token id (a string, as JSON keys are) -> bias added to its logit; checked and clamped to
    # [-100, 100] by the route (gateway/extra_params.py), as vLLM does.
    logit_bias: dict[str, float] | None = None
    # vLLM: logprobs of every prompt token after the first, plus the top-k (-1: whole vocab).
    prompt_logprobs: Int32 | None = None
    # Structured outputs (gateway/structured.py): at most one constraint from these fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's deprecated spellings of structured_outputs' json, regex, choice, grammar, tag.
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | None = None

    # NO_EFFECT
    user: str | None = None

    # UNSUPPORTED: typed Any so that any value reaches the check and its message.
    echo: Any = None  # completions implement it (CompletionRequest); chat's echo is refused
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    truncate_prompt_tokens: Any = None
    spaces_between_special_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    request_id: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None

    NO_EFFECT: ClassVar[dict[str, str]] = {
        "user": "an end-user id for the provider's abuse monitoring; vLLM ignores it too",
    }
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = {
        "echo": _UNSET_OR_FALSE,
        # vLLM v1 refuses request-level backend selection; the engine's
        # --structured-outputs-config.backend decides (xgrammar).
        "guided_decoding_backend": Unsupported(
            (None, "auto", "xgrammar"),
            'leave it unset, "auto" or "xgrammar"',
            "request-level structured output backend selection",
        ),
        "guided_whitespace_pattern": Unsupported(
            what="xgrammar has no whitespace pattern; use structured_outputs "
            '{"disable_any_whitespace": true}'
        ),
        "use_beam_search": _UNSET_OR_FALSE,
        "length_penalty": Unsupported((None, 1, 1.0), "leave it unset or 1", "beam search only"),
        "allowed_token_ids": Unsupported(),
        "bad_words": Unsupported((None, []), "leave it unset or empty"),
        "logits_processors": Unsupported(),
        "truncate_prompt_tokens": Unsupported(),
        # The gateway's tokenizers are fast ones, whose decode has no such switch.
        "spaces_between_special_tokens": Unsupported((None, True), "leave it unset or true"),
        "return_tokens_as_token_ids": _UNSET_OR_FALSE,
        "return_token_ids": _UNSET_OR_FALSE,
        "request_id": Unsupported(what="the gateway names requests itself"),
        "kv_transfer_params": Unsupported(),
        "vllm_xargs": Unsupported(),
    }

    @model_validator(mode="before")
    @classmethod
    def _check_raw_body(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, dict):
            # UTF8_CHECKED: the caller parsed the body with jiter, which refuses lone surrogates.
            if not (info.context and info.context.get(UTF8_CHECKED)):
                problem = _find_lone_surrogate(data)
                if problem is not None:
                    raise ValueError(problem)
            ignored = [k for k in data if k not in cls.model_fields]
            if ignored:
                names = ", ".join(repr(k[:64]) for k in sorted(ignored)[:20])
                logger.warning(
                    "The following fields were present in the request but ignored: %s", names
                )
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self

    @model_validator(mode="after")
    def _check_prompt_logprobs(self) -> SamplingFields:
        # vLLM's checks and messages; vLLM lets prompt_logprobs=0 through with stream=True and
        # then drops it, which would be a silent ignore here: any value is refused.
        if self.prompt_logprobs is not None:
            if self.stream:
                raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
            if self.prompt_logprobs < 0 and self.prompt_logprobs != -1:
                raise ValueError("`prompt_logprobs` must be a positive value or -1.")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt token the engine must compute; None: no prompt logprobs."""
        return self.prompt_logprobs

    def unsupported_field(self, allowed: frozenset[str] = frozenset()) -> tuple[str, str] | None:
        """The first field set to a value the gateway would ignore: (name, 400 message).
        `allowed`: fields this gateway's flags turn on (`chat_template`)."""
        for name, rule in self.UNSUPPORTED.items():
            if name in allowed:
                continue
            if name in self.model_fields_set and not rule.accepts(getattr(self, name), self):
                return name, rule.message(name)
        return None


# Content part types read as text -> the key holding their text.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The dict a chat template sees; text parts are joined with newlines (as vLLM does).
        vLLM also reads the Responses API's `input_text` / `output_text` parts and an
        assistant's `refusal` parts as text; any other part (images, audio) is a 400."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                kind = part.get("type")
                key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
                if key is None:
                    raise ValueError(f"Unsupported content part type: {kind!r}.")
                text = part.get(key)
                if not isinstance(text, str):
                    raise ValueError(f"A content part of type {kind!r} needs a string {key!r}.")
                texts.append(text)
            message["content"] = "\n".join(texts)
        elif self.content is None:
            message["content"] = ""
        return message


# Keys of chat_template_kwargs the gateway decides itself, or that would smuggle in what the
# request fields refuse (tool definitions). `chat_template` is checked with the gateway's flag
# (`preprocess.request_chat_template`).
_RESERVED_TEMPLATE_KWARGS = (
    "tools",
    "documents",
    "messages",
    "conversation",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    add_generation_prompt: bool = True
    # vLLM's: special tokens (a BOS) added to the rendered template, on top of its own.
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Tools and reasoning (gateway/chat_tools.py, gateway/chat_output.py). `tool_choice` is
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}, checked
    # with vLLM's messages by `chat_tools.check_tool_usage`.
    tools: list[ChatCompletionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: only the first call is returned
    include_reasoning: bool = True  # false: no reasoning_content (the parser still splits)
    # A variable of the chat template (templates that read it, such as gpt-oss's, use it).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    # NO_EFFECT
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None

    # UNSUPPORTED
    functions: Any = None
    function_call: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    moderation: Any = None
    store: Any = None
    service_tier: Any = None

    NO_EFFECT: ClassVar[dict[str, str]] = {
        **SamplingFields.NO_EFFECT,
        "metadata": "tags for stored completions; nothing is stored (`store` is refused)",
        "safety_identifier": "an end-user id for the provider's abuse monitoring",
        "prompt_cache_key": "a cache-routing hint; routing here follows the cached blocks",
        "prompt_cache_retention": "a cache-lifetime hint; the prefix cache evicts by LRU",
        "prompt_cache_options": "cache breakpoint hints; the prefix cache is automatic",
    }
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = {
        **SamplingFields.UNSUPPORTED,
        "functions": Unsupported((None, []), "leave it unset or empty", _TOOLS),
        "function_call": Unsupported((None, "none"), 'leave it unset or "none"', _TOOLS),
        "continue_final_message": _UNSET_OR_FALSE,
        "chat_template": Unsupported(
            what="the model's own template is used unless the gateway runs with "
            "--trust-request-chat-template"
        ),
        "documents": Unsupported(),
        "mm_processor_kwargs": Unsupported(what="the model takes text only"),
        "audio": Unsupported(what="the model takes and produces text only"),
        "modalities": Unsupported((None, ["text"]), 'leave it unset or ["text"]'),
        "prediction": Unsupported(),
        "web_search_options": Unsupported(),
        "verbosity": Unsupported(),
        "moderation": Unsupported(),
        "store": Unsupported((None, False), "leave it unset or false", "nothing is stored"),
        "service_tier": Unsupported(
            (None, "auto", "default"), 'leave it unset, "auto" or "default"'
        ),
    }

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None:
            if self.top_logprobs < 0:
                raise ValueError("`top_logprobs` must be a positive value.")
            if self.top_logprobs > 0 and not self.logprobs:
                raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        return self

    @model_validator(mode="after")
    def _check_template_kwargs(self) -> ChatCompletionRequest:
        for key in _RESERVED_TEMPLATE_KWARGS:
            if key in (self.chat_template_kwargs or {}):
                raise ValueError(
                    f"chat_template_kwargs may not set {key!r}: the gateway sets it, or it is a "
                    "feature that is not supported; remove it from chat_template_kwargs."
                )
        return self

    def requested_max_tokens(self) -> int | None:
        # vLLM: `max_completion_tokens` supersedes the deprecated `max_tokens`.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _best_of_is_noop(best_of: Any, req: Any) -> bool:
    return best_of is None or (type(best_of) is int and best_of == 1 and req.n == 1)


class CompletionRequest(SamplingFields):
    # A string, a list of strings, token ids, or a list of token-id lists (smart-mode union).
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Int32 | None = None
    add_special_tokens: bool = True
    # The prompt text comes first in each choice's text (and its tokens in `logprobs`).
    echo: bool | None = False

    # UNSUPPORTED
    suffix: Any = None
    best_of: Any = None
    prompt_embeds: Any = None

    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = {
        **{k: v for k, v in SamplingFields.UNSUPPORTED.items() if k != "echo"},
        "suffix": Unsupported(),
        "best_of": Unsupported(
            allowed="leave it unset (or 1 with n=1) and use n for several completions",
            is_noop=_best_of_is_noop,
        ),
        "prompt_embeds": Unsupported(what="prompts are text or token ids"),
    }

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty.")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The request as a list of prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def is_echo_only(self) -> bool:
        """vLLM's echo_without_generation: `echo` with `max_tokens=0` returns the prompt (and
        its logprobs) alone; the engine runs one token, which the response leaves out."""
        return bool(self.echo) and self.max_tokens == 0

    def requested_max_tokens(self) -> int | None:
        return 1 if self.is_echo_only else self.max_tokens

    def num_prompt_logprobs(self) -> int | None:
        # vLLM: with echo, the prompt's tokens get the logprobs asked for the output.
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs


def _find_lone_surrogate(body: dict[str, Any]) -> str | None:
    """Where the body holds a string UTF-8 cannot encode, as a 400 message; None if nowhere."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if _surrogate_at(key) is not None:
                    return _surrogate_message(f"a key of {path or 'the body'}", key)
                stack.append((f"{path}.{key[:64]}" if path else key[:64], item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str) and _surrogate_at(value) is not None:
            return _surrogate_message(path, value)
    return None


def _surrogate_at(text: str) -> int | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _surrogate_message(where: str, text: str) -> str:
    i = _surrogate_at(text)
    assert i is not None
    return (
        f"{where} contains a lone UTF-16 surrogate (\\u{ord(text[i]):04x} at character {i}); "
        "strings must be valid Unicode: send the character itself, or a \\uD800-\\uDBFF escape "
        "directly followed by a \\uDC00-\\uDFFF one."
    )
