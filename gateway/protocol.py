"""Request bodies of the OpenAI API, with vLLM's extra sampling fields.

Unknown fields are ignored (as vLLM does) so newer SDKs keep working. `None` means "not set by
the client": the model's generation_config.json then supplies the default.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

# vLLM bounds `seed` to a signed 64-bit integer (the proto field is int64).
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(BaseModel):
    """Fields shared by chat and completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extra-body fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The dict a chat template sees; text parts are joined with newlines (as vLLM does)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise ValueError(f"Unsupported content part type: {part.get('type')!r}.")
                texts.append(str(part.get("text", "")))
            message["content"] = "\n".join(texts)
        elif self.content is None:
            message["content"] = ""
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None:
            if self.top_logprobs < 0:
                raise ValueError("`top_logprobs` must be a positive value.")
            if self.top_logprobs > 0 and not self.logprobs:
                raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        return self

    def requested_max_tokens(self) -> int | None:
        # vLLM: `max_completion_tokens` supersedes the deprecated `max_tokens`.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    # A string, a list of strings, token ids, or a list of token-id lists (smart-mode union).
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    add_special_tokens: bool = True

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
