"""The engine loop: admit requests, step (schedule → run → update), report diffs.

Each `step()` returns only what changed: the new token of each request that produced one and
the finish reason of those that ended. Token-level stops (EOS, `stop_token_ids`, `max_tokens`,
`max_model_len`) are decided here; stop *strings* need text and are decided by the output
processor above, which then calls `abort_request`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.request import Request, RequestStatus
from engine.sampler import skip_sampler_step
from engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


@dataclass
class RemotePrefillAllocation:
    block_ids: list[int]  # the request's blocks, prompt block 0 first
    num_hit_tokens: int  # leading prompt tokens already cached here (not to be written)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        num_blocks = self.runner.determine_num_blocks()
        self.runner.init_kv_cache(num_blocks)
        self.runner.init_cuda_graphs()
        self.kv = KVCacheManager(
            num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._validate(request)
        self.scheduler.add_request(request)

    def _validate(self, request: Request) -> None:
        """Checks shared by every role; resolves `request.max_tokens`."""
        max_len = self.config.model.max_model_len
        vocab = self.config.model.vocab_size
        if request.num_prompt_tokens >= max_len:
            raise ValueError(
                f"The decoder prompt (length {request.num_prompt_tokens}) is longer than the "
                f"maximum model length of {max_len}. Make sure that `max_model_len` is no "
                "smaller than the number of text tokens plus one generated token."
            )
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (vocab_size={vocab}).")
        params = request.sampling_params
        limit = max_len - request.num_prompt_tokens
        request.max_tokens = limit if params.max_tokens is None else min(params.max_tokens, limit)

    def abort_request(self, request_id: str) -> bool:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        result = self.runner.execute(sched, self.kv)
        self.scheduler.update_after_step(sched)
        outputs = []
        for s in sched.scheduled:
            r = s.request
            out = None
            if r.request_id in result.prompt_logprobs:
                if not r.prompt_logprobs:
                    r.prompt_logprobs.append(None)
                r.prompt_logprobs.extend(result.prompt_logprobs[r.request_id])
            token = result.sampled.get(r.request_id)
            if token is None:
                continue
            r.append_output_token(token)
            out = EngineCoreOutput(r.request_id, [token], num_cached_tokens=r.num_cached_tokens)
            if r.request_id in result.logprobs:
                r.logprobs.append(result.logprobs[r.request_id])
                out.new_logprobs.append(result.logprobs[r.request_id])
            if r.num_output_tokens == 1 and r.wants_prompt_logprobs:
                out.prompt_logprobs = list(r.prompt_logprobs)
            status = self._check_stop(r, token)
            if status is not None:
                self.scheduler.finish_request(r, status)
                out.finish_reason, out.stop_reason = status.value, r.stop_reason
            outputs.append(out)
        return outputs

    def _check_stop(self, r: Request, token: int) -> RequestStatus | None:
        params = r.sampling_params
        if r.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in r.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                r.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if r.num_output_tokens >= r.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if r.num_tokens >= self.config.model.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- disaggregation: decode role -----------------------------------------------------
    def allocate_for_remote_prefill(self, request: Request) -> RemotePrefillAllocation | None:
        """Reserve blocks for the whole prompt (reusing this instance's prefix hits) so that a
        prefill elsewhere can write into them. None: no room now (refuse fast). The request is
        not scheduled until `add_remote_prefilled`."""
        self._validate(request)
        self.scheduler.check_admission(request)
        hits, num_hit = self.kv.get_computed_blocks(request)
        if not self.kv.allocate_slots(request, request.num_tokens - num_hit, hits):
            return None
        return RemotePrefillAllocation(list(self.kv.get_block_ids(request.request_id)), num_hit)

    def add_remote_prefilled(
        self,
        request: Request,
        first_token: int,
        logprobs: dict[int, float] | None,
        num_cached_tokens: int,
    ) -> EngineCoreOutput:
        """The prompt's KV is now in the request's blocks: publish them to the prefix cache,
        take the first token sampled remotely, and schedule the rest of the decode."""
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_cached_tokens = num_cached_tokens
        self.kv.cache_blocks(request)
        if request.generator is not None and not request.sampling_params.is_greedy:
            # The remote sampler drew the first token's noise from the same seed: skip it.
            skip_sampler_step(request.generator, self.config.model.vocab_size)
        request.append_output_token(first_token)
        out = EngineCoreOutput(
            request.request_id, [first_token], num_cached_tokens=num_cached_tokens
        )
        if logprobs is not None:
            request.logprobs.append(logprobs)
            out.new_logprobs.append(logprobs)
        status = self._check_stop(request, first_token)
        if status is not None:
            request.status = status
            self.kv.free(request)
            out.finish_reason, out.stop_reason = status.value, request.stop_reason
        else:
            self.scheduler.add_request(request, check_limits=False)
        return out

    def quarantine_blocks(self, request: Request) -> str:
        """A remote writer may still write this request's blocks: keep them out of use until
        `release_quarantine(key)` (writer acknowledged, declared dead, or lease expired)."""
        return self.kv.quarantine(request.request_id)

    def release_quarantine(self, key: str) -> None:
        self.kv.release_quarantine(key)

    # ---- disaggregation: prefill role ----------------------------------------------------
    def release_blocks(self, request: Request) -> None:
        """Prefill role: the KV of a finished `hold_blocks` request has been shipped."""
        assert request.hold_blocks and request.is_finished
        self.kv.free(request)

    # ---- introspection -------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage(),
            num_free_blocks=self.kv.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.prefix_stats.queries,
            prefix_cache_hits=self.kv.prefix_stats.hits,
        )
