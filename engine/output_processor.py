"""Turns engine-core token diffs into text: incremental detokenization and stop strings.

One `RequestState` per engine request (a child of an n>1 request is its own engine request).
When a stop string appears, the state finishes itself and reports the request id so the caller
aborts it in the core. The gateway reuses this class for streaming.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.detokenizer import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    StopStringMatcher,
    make_detokenizer,
)
from engine.outputs import EngineCoreOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the gateway uses this class and imports no transformers
    from transformers import PreTrainedTokenizerBase


@dataclass
class RequestState:
    request_id: str
    params: SamplingParams
    detok: IncrementalDetokenizer | FastIncrementalDetokenizer | None
    stop: StopStringMatcher | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0

    def add(self, out: EngineCoreOutput) -> str:
        """Apply one diff; returns the new text delta (stop-string safe)."""
        assert self.finish_reason is None, f"{self.request_id} already finished"
        self.token_ids.extend(out.new_token_ids)
        self.num_cached_tokens = out.num_cached_tokens
        for tok, lp in zip(out.new_token_ids, out.new_logprobs):
            self.logprobs.append(lp)
            self.cumulative_logprob += lp[tok]
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        delta = ""
        if self.detok is not None:
            new_ids = out.new_token_ids
            if (
                out.finish_reason == "stop"
                and new_ids
                and not self.params.include_stop_str_in_output
            ):
                # The engine stops on tokens only (EOS, stop_token_ids): like vLLM, the stop
                # token's text is not part of the output (it shows with skip_special_tokens
                # off), unless include_stop_str_in_output.
                new_ids = new_ids[:-1]
            delta = self.detok.update(new_ids)
            if out.finish_reason is not None:
                delta += self.detok.flush()
        if self.stop is not None:
            delta, hit = self.stop.feed(delta)
            if hit:
                self.finish_reason, self.stop_reason = "stop", self.stop.stop_str
            elif out.finish_reason is not None:
                delta += self.stop.flush()
        if self.finish_reason is None and out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        self.text += delta
        return delta


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        detok = None
        if self.tokenizer is not None:
            detok = make_detokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        stop = None
        if params.stop:
            if detok is None:
                raise ValueError("Stop strings need a tokenizer; use stop_token_ids instead.")
            stop = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        state = RequestState(request_id, params, detok, stop)
        self.states[request_id] = state
        return state

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestState], list[str]]:
        """Returns the states that changed and the ids the core must abort (stop strings)."""
        changed, to_abort = [], []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:  # aborted meanwhile
                continue
            state.add(out)
            changed.append(state)
            if state.finish_reason is not None and out.finish_reason is None:
                to_abort.append(out.request_id)
        return changed, to_abort

    def pop(self, request_id: str) -> RequestState | None:
        return self.states.pop(request_id, None)
