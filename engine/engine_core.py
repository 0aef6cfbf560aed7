"""The engine loop: admit requests, step (schedule → run → update), report diffs.

Each `step()` returns only what changed: the new token of each request that produced one and
the finish reason of those that ended. Token-level stops (EOS, `stop_token_ids`, `max_tokens`,
`max_model_len`) are decided here; stop *strings* need text and are decided by the output
processor above, which then calls `abort_request`.

Async scheduling (steady greedy decode under CUDA graphs): `step()` launches decode step N+1
before reading step N's tokens, then resolves step N while N+1 runs, so the host's scheduling,
stop checks and output work overlap the GPU. A launched step appends a `PLACEHOLDER` to each
of its requests (the scheduler then sees the token as present); the graph reads the unread
token on the device. Resolving fills the placeholders and applies the stops; a request that
stops at N has one wasted row in N+1, whose output is dropped, and its blocks are freed only
once N+1 is done (nothing may reuse a block that a running step still writes). A request
whose last token (max_tokens) is in the step in flight is not scheduled again. A step that
cannot be launched ahead (rows with logprobs, logit bias or penalties, prompt logprobs, a pool
that might preempt; prompt chunks or sampled rows with `async_mixed_steps` / `async_sampling`
off) resolves the pending step first and returns its tokens at once; the step itself runs
synchronously at the next call, so that no stream's token waits for it.

Structured outputs: a constrained request waits in `compiling` (known to the scheduler by id,
not queued) until its grammar is compiled off this thread; `step()` then activates its matcher
(feeding any output it already has: a decode resuming a remote prefill's first token) and
queues it. Each sampled token advances the matcher; a token the grammar rejects fails that
request, never the loop. Greedy grammar rows pipeline too, in a split step: the forward of
N+1 is launched first (it needs only step N's tokens, on the device), then step N is resolved
(its tokens advance the matchers), and only then is N+1's sampling launched, behind the
bitmask the matchers fill now. The host's grammar work overlaps N+1's forward, and every mask
is the one the synchronous engine would build: exact.

Speculative decoding (`config.speculative`, engine/spec_decode.py): the scheduler gives a
decoding request drafts and the runner verifies them in the same forward pass; a step then
yields several tokens for the request, to which the stops apply one by one, in order (nothing
after a stop is reported). It needs the host to know each step's tokens before the next is
scheduled, so async scheduling is off, and verify steps (several tokens per request) run
eagerly, not in the one-token decode graphs; steps without drafts still replay the graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.model_runner import LaunchedStep, ModelRunner
from engine.outputs import EngineCoreOutput
from engine.request import PLACEHOLDER, Request, RequestStatus
from engine.sampler import skip_sampler_step
from engine.scheduler import Scheduler, SchedulerFullError, SchedulerOutput
from engine.spec_decode import NgramProposer, SpecDecodeStats
from engine.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

COMPILE_WAIT_S = 0.005  # an idle engine waits this long on a grammar compile per step


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
    spec_decode: SpecDecodeStats | None = None  # None: speculative decoding is off


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        num_blocks = self.runner.determine_num_blocks()
        self.runner.init_kv_cache(num_blocks)
        self.runner.warm_up_kernels()
        self.runner.init_cuda_graphs()
        self.kv = KVCacheManager(
            num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        drafter = NgramProposer(config.speculative) if config.speculative is not None else None
        self.scheduler = Scheduler(config.scheduler, self.kv, drafter)
        # Decode role: requests holding blocks for a remote prefill, not yet scheduled.
        self.reserved: dict[str, Request] = {}
        # Remote prefills waiting for free blocks, in arrival order (FIFO): a decode short of
        # KV queues them as the scheduler queues local prompts, instead of refusing.
        self.awaiting_blocks: dict[str, Request] = {}
        self._pending: LaunchedStep | None = None  # async scheduling: launched, not read
        # Async scheduling: a step scheduled while one was in flight that must run
        # synchronously; it runs at the next call, once the in-flight step's tokens are out.
        self._deferred: SchedulerOutput | None = None
        self.structured = StructuredOutputManager(config.model, config.device)
        # Constrained requests whose grammar is compiling (in `scheduler.requests`, not queued).
        self.compiling: dict[str, Request] = {}

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._validate(request)
        if request.structured is None:
            self.scheduler.add_request(request)
            return
        self.scheduler.check_admission(request, list(self.compiling.values()))
        self._park(request)

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
        if request.priority != 0 and self.config.scheduler.policy != "priority":
            # vLLM's check and message: under FCFS a priority would be accepted and ignored.
            raise ValueError(
                f"Got priority {request.priority} but Priority scheduling is not enabled."
            )
        params = request.sampling_params
        if params.logit_bias:
            bad = [t for t in params.logit_bias if not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. "
                    f"Vocabulary size: {vocab}"
                )
        limit = max_len - request.num_prompt_tokens
        request.max_tokens = limit if params.max_tokens is None else min(params.max_tokens, limit)
        if params.structured_outputs is not None and request.structured is None:
            # Last: starts the compile (ValueError here if the constraint is invalid).
            request.structured = self.structured.start(params.structured_outputs)

    def abort_request(self, request_id: str) -> bool:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or self._pending is not None
            or bool(self.compiling)
        )

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Finish a request; while a launched step may still write its KV, free its blocks
        only once that step is done."""
        if self.compiling.pop(request.request_id, None) is not None:
            self.scheduler.requests.pop(request.request_id, None)
            request.status = status
            if not request.hold_blocks:
                self.kv.free(request)  # a decode's blocks, written by a remote prefill
            return
        pending = self._pending
        if pending is None or request.hold_blocks or not pending.holds(request.request_id):
            self.scheduler.finish_request(request, status)
            return
        self.scheduler.finish_request(request, status, free_blocks=False)
        pending.deferred_free.append(request)

    # ---- structured outputs: waiting for the grammar --------------------------------------
    def _park(self, request: Request) -> None:
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        self.scheduler.requests[request.request_id] = request  # found by abort and load
        self.compiling[request.request_id] = request

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Queue the requests whose grammar is ready; report those that cannot go on."""
        if not self.scheduler.has_unfinished_requests() and self._pending is None:
            # Nothing else to do: wait for a compile instead of spinning.
            futures = [r.structured.compiled for r in self.compiling.values()]
            wait(futures, timeout=COMPILE_WAIT_S, return_when=FIRST_COMPLETED)
        outputs = []
        for r in [r for r in self.compiling.values() if r.structured.is_ready]:
            try:
                ok = r.structured.activate(r.prompt_token_ids, r.output_token_ids)
                error = None if ok else f"the grammar rejects its output {r.output_token_ids}"
            except Exception as e:  # noqa: BLE001 - the compile failed: this request's failure
                error = f"its grammar failed to compile: {e}"
            if error is None and not r.structured.is_terminated:
                del self.compiling[r.request_id], self.scheduler.requests[r.request_id]
                self.scheduler.add_request(r, check_limits=False)
                continue
            status = RequestStatus.FINISHED_STOPPED if error is None else self._fail(r, error)
            self._finish(r, status)
            outputs.append(EngineCoreOutput(r.request_id, finish_reason=status.value))
        return outputs

    @staticmethod
    def _fail(r: Request, error: str) -> RequestStatus:
        logger.error("Request %s failed: %s", r.request_id, error)
        return RequestStatus.FINISHED_ABORTED

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        admitted = self._admit_compiled() if self.compiling else []
        return admitted + self._step()

    def _step(self) -> list[EngineCoreOutput]:
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            # Requests finished or aborted since it was scheduled drop out; their blocks are
            # already free (nothing was launched for them).
            deferred.scheduled = [s for s in deferred.scheduled if not s.request.is_finished]
            if deferred.scheduled:
                return self._execute(deferred)
        pending, self._pending = self._pending, None
        if pending is not None and not self._may_pipeline():
            return self._resolve(pending)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return self._resolve(pending) if pending is not None else []
        if self._fits_async(sched):
            if all(s.num_new_tokens == 1 for s in sched.scheduled):
                launched = self.runner.launch_decode(sched, self.kv, pending)
            else:
                launched = self.runner.launch_mixed(sched, self.kv, pending)
            for r, _ in launched.rows:  # the rows that sample a token (not a prompt's chunk)
                r.append_output_token(PLACEHOLDER)
                r.num_placeholders += 1
            self.scheduler.update_after_step(sched)
            self._pending = launched
            try:
                return self._resolve(pending) if pending is not None else []
            finally:  # even if resolving raised: the pending step is always a sampled one
                if not launched.is_sampled:
                    # Grammar rows: their matchers have just taken step N's tokens (or a stop
                    # or a rejection made the row a wasted one); N+1's masks follow from them.
                    self.runner.launch_sampling(launched)
        if pending is not None:
            # The step in flight is read first; its tokens go out now, and this step runs at
            # the next call. Running it here would hold them back for a whole step: every
            # stream would see an inter-token gap of two steps, then one of zero.
            outputs = self._resolve(pending)
            self._deferred = sched
            return outputs
        return self._execute(sched)

    def _may_pipeline(self) -> bool:
        """Launching before resolving needs a scheduler that cannot preempt (every running
        request may need one new block) and, unless mixed steps launch ahead too, admits
        nothing new (no one waits, or max_num_seqs are running): a step with new prompts
        would run synchronously after all."""
        sch = self.scheduler
        admits = len(sch.waiting) > 0 and len(sch.running) < sch.config.max_num_seqs
        if admits and not self.runner.async_mixed_steps:
            return False
        return self.kv.num_free_blocks >= len(sch.running)

    def _fits_async(self, sched) -> bool:
        if sched.preempted_ids:  # the pool ran dry: resolve first (a victim may be in flight)
            return False
        if not self._may_pipeline() or not self.runner.can_launch_async(sched):
            return False
        # The launched token must be one the request may still produce; a prefill-role request
        # ships its blocks as soon as they count as computed, so it only ever runs in sync; a
        # first output token that carries prompt logprobs (a prompt whose last chunk is one
        # token) runs in sync, where `_execute` attaches them.
        return all(
            s.request.num_output_tokens < s.request.max_tokens
            and not s.request.hold_blocks
            and not (s.request.wants_prompt_logprobs and s.request.num_output_tokens == 0)
            for s in sched.scheduled
        )

    def _resolve(self, launched: LaunchedStep) -> list[EngineCoreOutput]:
        """Read a launched step's tokens (waiting for it) and apply them: the grammars take
        them, then the stops, as in `_execute`."""
        tokens = launched.tokens()
        for r in launched.deferred_free:  # finished while this step ran: now it is done
            self.kv.free(r)
        outputs = []
        for (r, idx), token in zip(launched.rows, tokens):
            if r.is_finished:  # stopped at the previous step or aborted: a wasted row
                continue
            r.output_token_ids[idx] = token
            r.num_placeholders -= 1
            if r.structured is not None and not r.structured.advance(token):
                status = self._fail(r, f"the grammar rejects sampled token {token}")
                self._finish_at(r, idx, status)
                outputs.append(EngineCoreOutput(r.request_id, finish_reason=status.value))
                continue  # as in `_execute`: the rejected token is not reported
            out = EngineCoreOutput(r.request_id, [token], num_cached_tokens=r.num_cached_tokens)
            status = self._check_stop(r, token, num_output=idx + 1)
            if status is not None:
                self._finish_at(r, idx, status)
                out.finish_reason, out.stop_reason = status.value, r.stop_reason
            outputs.append(out)
        return outputs

    def _finish_at(self, r: Request, idx: int, status: RequestStatus) -> None:
        """Finish a request whose output ends at index idx: drop the placeholder after it."""
        del r.output_token_ids[idx + 1 :]  # the next step's placeholder, if any
        r.num_placeholders = 0
        self._finish(r, status)

    def _execute(self, sched) -> list[EngineCoreOutput]:
        """One synchronous step: run, sample, apply (a verify step's tokens one by one)."""
        result = self.runner.execute(sched, self.kv)
        num_accepted = {
            s.request.request_id: len(result.sampled[s.request.request_id]) - 1
            for s in sched.scheduled
            if s.draft_token_ids
        }
        self.scheduler.update_after_step(sched, num_accepted)
        outputs = []
        for s in sched.scheduled:
            r = s.request
            if r.request_id in result.prompt_logprobs:
                if not r.prompt_logprobs:
                    r.prompt_logprobs.append(None)
                r.prompt_logprobs.extend(result.prompt_logprobs[r.request_id])
            tokens = result.sampled.get(r.request_id)
            if tokens is None:
                continue
            logprobs = result.logprobs.get(r.request_id)
            out = EngineCoreOutput(r.request_id, num_cached_tokens=r.num_cached_tokens)
            for i, token in enumerate(tokens):
                r.append_output_token(token)
                if r.structured is not None and not r.structured.advance(token):
                    status = self._fail(r, f"the grammar rejects sampled token {token}")
                    self.scheduler.finish_request(r, status)
                    out.finish_reason = status.value  # the rejected token is not reported
                    break
                out.new_token_ids.append(token)
                if logprobs is not None:
                    r.logprobs.append(logprobs[i])
                    out.new_logprobs.append(logprobs[i])
                if r.num_output_tokens == 1 and r.wants_prompt_logprobs:
                    out.prompt_logprobs = list(r.prompt_logprobs)
                status = self._check_stop(r, token, r.num_output_tokens)
                if status is not None:  # the tokens after a stop are dropped
                    self.scheduler.finish_request(r, status)
                    out.finish_reason, out.stop_reason = status.value, r.stop_reason
                    break
            outputs.append(out)
        return outputs

    def _check_stop(self, r: Request, token: int, num_output: int) -> RequestStatus | None:
        """Stops after `token`, the request's num_output-th output token."""
        params = r.sampling_params
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in r.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                r.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if r.structured is not None and r.structured.is_terminated:
            return RequestStatus.FINISHED_STOPPED  # the grammar took its stop token (ignore_eos)
        if num_output >= r.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if r.num_prompt_tokens + num_output >= self.config.model.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- disaggregation: decode role -----------------------------------------------------
    def allocate_for_remote_prefill(
        self, request: Request, max_blocks_per_salt: int | None = None
    ) -> RemotePrefillAllocation | None:
        """Reserve blocks for the whole prompt and the slot of its first decoded token (reusing
        this instance's prefix hits) so that a prefill elsewhere can write into them (the
        prompt's blocks). None: no room now; the request then waits in
        `awaiting_blocks` (FIFO: only its head may take blocks) and the caller asks again when
        blocks are freed (`awaiting_in_order`), or gives up with `stop_awaiting`. The request is
        not scheduled until `add_remote_prefilled`; until then it is `reserved`. Waiting and
        reserved requests count against the queue limits, and the blocks reserved for one
        cache salt (one tenant) stay under `max_blocks_per_salt` (SchedulerFullError past
        either)."""
        self._validate(request)
        if request.request_id not in self.awaiting_blocks:
            queued = [*self.reserved.values(), *self.awaiting_blocks.values()]
            self.scheduler.check_admission(request, queued)
        try:
            alloc = self._reserve_for_remote_prefill(request, max_blocks_per_salt)
        except SchedulerFullError:
            self.awaiting_blocks.pop(request.request_id, None)
            raise
        if alloc is None:
            self.awaiting_blocks.setdefault(request.request_id, request)
        else:
            self.awaiting_blocks.pop(request.request_id, None)
        return alloc

    def awaiting_in_order(self) -> Iterator[Request]:
        """The remote prefills in line for blocks, first first, each only while the free
        blocks could hold its prompt and first decode slot (checked again before each: the
        caller reserves as it goes, with `allocate_for_remote_prefill`)."""
        for request in list(self.awaiting_blocks.values()):
            if request.request_id not in self.awaiting_blocks:
                continue  # left the line meanwhile
            if self.kv.num_free_blocks < self._blocks_to_reserve(request):
                return
            yield request

    def stop_awaiting(self, request_id: str) -> None:
        self.awaiting_blocks.pop(request_id, None)

    def _blocks_to_reserve(self, request: Request) -> int:
        """A remote prefill's blocks before prefix hits: its prompt and its first decode slot."""
        return cdiv(request.num_tokens + 1, self.config.cache.block_size)

    def _reserve_for_remote_prefill(
        self, request: Request, max_blocks_per_salt: int | None
    ) -> RemotePrefillAllocation | None:
        head = next(iter(self.awaiting_blocks), request.request_id)
        if head != request.request_id:
            return None  # behind others in line
        hits, num_hit = self.kv.get_computed_blocks(request)
        if max_blocks_per_salt is not None:
            held = sum(
                len(self.kv.get_block_ids(r.request_id))
                for r in self.reserved.values()
                if r.cache_salt == request.cache_salt
            )
            needed = self._blocks_to_reserve(request) - len(hits)
            if held + needed > max_blocks_per_salt:
                raise SchedulerFullError(
                    f"Request {request.request_id} refused: its tenant already holds {held} KV "
                    f"blocks in remote prefills and this prompt needs {needed} more (at most "
                    f"{max_blocks_per_salt} per tenant). Retry later."
                )
        # The prompt's blocks and the slot of the first token decoded here: without it, prompts
        # that filled the cache exactly were written by P and then waited forever for a block
        # for their next token, with nothing running that could free one.
        if not self.kv.allocate_slots(request, request.num_tokens + 1 - num_hit, hits):
            return None
        self.reserved[request.request_id] = request
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
        self.reserved.pop(request.request_id, None)
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
        status = self._check_stop(request, first_token, request.num_output_tokens)
        if status is not None:
            request.status = status
            self.kv.free(request)
            out.finish_reason, out.stop_reason = status.value, request.stop_reason
        elif request.structured is not None:
            # Queued once its grammar is ready and has taken the first token (`step`).
            self._park(request)
        else:
            self.scheduler.add_request(request, check_limits=False)
        return out

    def quarantine_blocks(self, request: Request) -> str:
        """A remote writer may still write this request's blocks: keep them out of use until
        `release_quarantine(key)` (writer acknowledged or known dead)."""
        self.reserved.pop(request.request_id, None)
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
            num_waiting=len(self.scheduler.waiting)
            + len(self.compiling)
            + len(self.awaiting_blocks),
            kv_cache_usage=self.kv.usage(),
            num_free_blocks=self.kv.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.prefix_stats.queries,
            prefix_cache_hits=self.kv.prefix_stats.hits,
            spec_decode=self.scheduler.spec_stats.snapshot() if self.config.speculative else None,
        )
