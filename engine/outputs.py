"""What the engine reports, as plain dataclasses (no torch: the gateway imports this module).

`EngineCoreOutput` is the core's per-step diff; `RequestOutput` / `CompletionOutput` are what
the offline API returns, shaped like vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineCoreOutput:
    """One request's diff from one engine step: the tokens it produced, and why it ended."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finished: bool = False
    num_cached_tokens: int = 0
