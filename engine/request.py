"""The one request model: token ids and a count of how many of them have KV.

Every step closes the gap between `num_computed_tokens` and `num_tokens`: a fresh prompt, a
chunk of a long prompt, a prefix-cache hit (which jumps `num_computed_tokens` forward), a
decode step (gap of one) and a preempted request being recomputed are all the same thing.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.block_hash import BlockHash, hash_block_tokens
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured_output import StructuredRequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


PLACEHOLDER = -1  # an output token still on the GPU (async scheduling)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # time.monotonic() when the scheduler first queued it, and first scheduled it (left
    # WAITING; a preempted request keeps its first): vLLM's queue and prefill phases.
    queued_time: float | None = None
    first_scheduled_time: float | None = None

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens whose KV arrives from outside (decode role: written by a remote prefill).
    num_external_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit length at first scheduling
    block_hashes: list[BlockHash] = field(default_factory=list)
    generator: torch.Generator | None = None
    # Per output token: {token_id: logprob}; per prompt token (first is None) likewise.
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    max_tokens: int = 16  # resolved: min(params.max_tokens, max_model_len - prompt_len)
    # Prefill role: keep the blocks after finishing, until the KV has been shipped
    # (`EngineCore.release_blocks`); a finished request's blocks may still be read by a WRITE.
    hold_blocks: bool = False
    # Async scheduling: output tokens whose step is still on the GPU, held as PLACEHOLDER at
    # the end of output_token_ids (at most 2: the step being resolved and the next one).
    num_placeholders: int = 0
    # Structured outputs: the grammar's compile and matcher (set at admission by EngineCore).
    structured: StructuredRequest | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("The decoder prompt cannot be empty.")
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without concatenating the whole sequence (the model
        runner's per-step read: a decode row needs one token of a long prompt + output)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_prompt_tokens_left(self) -> int:
        """Prompt tokens still to compute (0 once the prompt is in the KV cache)."""
        return max(len(self.prompt_token_ids) - self.num_computed_tokens, 0)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known on the host (all but async placeholders)."""
        return self.num_tokens - self.num_placeholders

    def update_block_hashes(self, block_size: int) -> None:
        """Extend the hash chain over any block that became full (of known tokens)."""
        known = self.num_known_tokens
        if known // block_size > len(self.block_hashes):
            self.block_hashes = hash_block_tokens(
                self.all_token_ids[:known], block_size, self.cache_salt, self.block_hashes
            )
