"""Continuous-batching scheduler: one token budget per step, no prefill or decode phase.

Each step, running requests go first (a decode needs one token, a half-prefilled prompt its
next chunk), then waiting requests in policy order, each taking what is left of
`max_num_batched_tokens` under `max_num_seqs`. When the block pool runs dry, the newest (or,
with the priority policy, the least important) running request is preempted: its blocks are
freed and it is recomputed later, from the prefix cache where its blocks survived.

Speculative decoding (engine/spec_decode.py): a decoding request may take 1 + k tokens, its
last sampled token and k drafts, within the budget and its max_tokens. Drafts never preempt
anyone: when their slots do not fit, the request decodes one token. After the step the
rejected drafts are rolled back (`update_after_step`): their KV slots stay the request's and
are rewritten when those positions come again.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.request import Request, RequestStatus
from engine.spec_decode import NgramProposer, SpecDecodeStats


class SchedulerFullError(RuntimeError):
    """Raised at admission when the queue limits are reached: refuse fast, never queue forever."""


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # the drafts included
    # Speculative decoding: the last len(draft_token_ids) of the new tokens are these guesses.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def reaches_end(self) -> bool:
        """After this step the request has KV for all its tokens and samples a new one."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens + len(
            self.draft_token_ids
        )


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """FCFS is arrival order; priority orders by (priority, arrival). Preempted go first."""

    def __init__(self, policy: str):
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()
        self.num_holding_kv = 0  # waiting requests whose prompt KV is in their blocks

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def __iter__(self):
        if self.policy == "fcfs":
            return iter(self._fifo)
        return (entry[-1] for entry in sorted(self._heap))

    def num_prompt_tokens_left(self, max_requests: int) -> int:
        """Prompt tokens the next `max_requests` waiting requests (in scheduling order) have
        still to compute (before prefix hits)."""
        if self.policy == "fcfs":
            requests = itertools.islice(self._fifo, max_requests)
        else:
            requests = (e[-1] for e in heapq.nsmallest(max_requests, self._heap))
        return sum(r.num_prompt_tokens_left for r in requests)

    def add(self, request: Request, front: bool = False) -> None:
        self.num_holding_kv += request.num_computed_tokens > 0
        if self.policy == "fcfs":
            (self._fifo.appendleft if front else self._fifo.append)(request)
        else:
            key = (request.priority, request.arrival_time, next(self._tiebreak), request)
            heapq.heappush(self._heap, key)

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][-1]

    def first_holding_kv(self) -> Request | None:
        """The first request (in scheduling order) whose prompt KV already sits in its blocks
        (written by a remote prefill), if any waits."""
        if not self.num_holding_kv:
            return None
        if self.policy == "fcfs":  # they join at the front: found after at most the preempted
            return next((r for r in self._fifo if r.num_computed_tokens > 0), None)
        held = (e for e in self._heap if e[-1].num_computed_tokens > 0)
        return min(held, default=(None,))[-1]

    def pop(self) -> Request:
        request = self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[-1]
        self.num_holding_kv -= request.num_computed_tokens > 0
        return request

    def remove(self, request: Request) -> None:
        self.num_holding_kv -= request.num_computed_tokens > 0
        if self.policy == "fcfs":
            self._fifo.remove(request)
        else:
            self._heap = [e for e in self._heap if e[-1] is not request]
            heapq.heapify(self._heap)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        drafter: NgramProposer | None = None,
    ):
        self.config = config
        self.kv = kv_cache_manager
        self.drafter = drafter
        self.spec_stats = SpecDecodeStats()
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Work done, for throughput estimates (engine/kv_events.py): steps, and prompt tokens
        # computed here (KV that arrived from a remote prefill is not computed here).
        self.num_steps = 0
        self.num_prompt_tokens_computed = 0

    # ---- admission -----------------------------------------------------------------------
    def add_request(self, request: Request, check_limits: bool = True) -> None:
        if check_limits:
            self.check_admission(request)
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        self.requests[request.request_id] = request
        if request.queued_time is None:
            request.queued_time = time.monotonic()
        self.waiting.add(request, front=request.num_computed_tokens > 0)

    def check_admission(self, request: Request, reserved: Collection[Request] = ()) -> None:
        """Refuse fast past the queue limits. `reserved`: requests that hold blocks for a
        remote prefill and will queue here once it is done; they count as queued."""
        cfg = self.config
        num_queued = len(self.waiting) + len(reserved)
        if cfg.max_num_queued_reqs is not None and num_queued >= cfg.max_num_queued_reqs:
            raise SchedulerFullError(
                f"Request {request.request_id} refused: {num_queued} requests are already "
                f"queued (max_num_queued_reqs={cfg.max_num_queued_reqs}). Retry later."
            )
        if cfg.max_num_queued_tokens is not None:
            queued = sum(r.num_tokens for r in self.waiting) + sum(r.num_tokens for r in reserved)
            if queued + request.num_tokens > cfg.max_num_queued_tokens:
                raise SchedulerFullError(
                    f"Request {request.request_id} refused: {queued} tokens are queued and this "
                    f"request adds {request.num_tokens} (max_num_queued_tokens="
                    f"{cfg.max_num_queued_tokens}). Retry later."
                )

    def finish_request(
        self, request: Request, status: RequestStatus, free_blocks: bool = True
    ) -> None:
        """Finish (or abort) a request wherever it is; frees its blocks (unless the caller
        frees them later: a launched step may still write them)."""
        assert status.is_finished
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.is_finished:
            self.waiting.remove(request)
        request.status = status
        if free_blocks and not request.hold_blocks:
            self.kv.free(request)
        self.requests.pop(request.request_id, None)
        if self.drafter is not None:
            self.drafter.forget(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # A request's share of one step (its prompt's next chunk); no cap: the whole budget.
        cap = self.config.long_prefill_token_threshold or budget
        # Prompt tokens this step may still take (all requests together): capped while any
        # running request decodes, so that its next token waits for at most this much prefill.
        prefill_budget = prefill_chunk = budget  # all requests' prompt tokens; one request's
        if self.config.max_prefill_tokens_while_decoding and any(
            r.num_computed_tokens >= r.num_prompt_tokens for r in self.running
        ):
            prefill_budget, prefill_chunk = self._prefill_budget_while_decoding()
        scheduled_ids: set[str] = set()

        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if request.num_output_tokens >= request.max_tokens:
                # Async scheduling: its last token is in the step in flight (a placeholder);
                # it finishes when that step is read. Scheduling it again would make this
                # step synchronous, delaying every other row's token by a step.
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget, cap)
            assert num_new > 0, f"running request {request.request_id} has nothing to compute"
            prefilling = request.num_computed_tokens < request.num_prompt_tokens
            if prefilling:
                num_new = min(num_new, prefill_budget, prefill_chunk)
                if num_new == 0:
                    continue
            drafts = self._drafts(request, min(budget, cap)) if num_new == 1 else []
            if drafts:
                out.scheduled.append(ScheduledRequest(request, 1 + len(drafts), drafts))
                scheduled_ids.add(request.request_id)
                budget -= 1 + len(drafts)
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self._choose_victim(exclude=scheduled_ids)
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue
            out.scheduled.append(ScheduledRequest(request, num_new))
            scheduled_ids.add(request.request_id)
            budget -= num_new
            if prefilling:
                prefill_budget -= num_new

        # No new admissions in a step that had to preempt: the pool is under pressure.
        while not out.preempted_ids and budget > 0 and len(self.waiting) > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            # A request whose KV a remote prefill wrote holds its blocks and needs no new one
            # to start: it goes first. Behind a head that cannot get blocks it would wait for
            # as long as nothing frees any; with nothing running, forever (a request that
            # preempted itself, at the head, ahead of two such prompts: reproduced in
            # tests/decode_svc/test_remote_admission.py).
            request = self.waiting.first_holding_kv() or self.waiting.peek()
            if request.num_computed_tokens > 0:
                # Decode role: the prompt's KV was written from outside into blocks it holds.
                hit_blocks, num_hit = [], request.num_computed_tokens
            else:
                hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            is_prompt = num_hit < request.num_prompt_tokens
            if is_prompt:  # within the step's prefill budget
                if prefill_budget == 0:
                    break
                num_new = min(num_new, prefill_budget, prefill_chunk)
            num_new = min(num_new, budget, cap)
            if not self.kv.allocate_slots(request, num_new, hit_blocks):
                break
            if request is self.waiting.peek():
                self.waiting.pop()
            else:
                self.waiting.remove(request)
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            if is_prompt:
                prefill_budget -= num_new
        # Decodes first (stable): attention backends give the leading one-token rows their
        # decode kernel (engine/attention.py, `AttentionMetadata.num_decodes`).
        out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        return out

    def _prefill_budget_while_decoding(self) -> tuple[int, int]:
        """(prompt tokens of all requests together, of any one request) in a step that also
        decodes. All together: `max_prefill_tokens_while_decoding`, raised to
        1/`prefill_backlog_steps` of the prompt tokens that could run now (before prefix hits),
        up to the step's whole budget: a backlog clears in about that many steps instead of at a
        fixed rate the arrivals outrun. What could run now: the running requests' prompts still
        to compute, and the waiting requests that fit in the free `max_num_seqs` slots.
        Requests queued beyond those slots cannot start however large the budget, so they do
        not count: counting them would hold the budget at `max_num_batched_tokens` for as long
        as an overload lasts, every step a long prefill chunk the decodes wait behind.

        The steps scale with the free fraction of the slots (at least one). In a steady state the
        prompts admitted per step equal the requests finishing, and with a fixed number of steps
        that takes a waiting queue proportional to the running batch: at 256 closed-loop
        streams, ~57 waited while ~79 slots were free (bench/README.md, 2026-12-07). With fewer
        steps as the batch fills, that queue shrinks and the batch runs nearer `max_num_seqs`;
        with most slots free (light load, bursts into an idle engine) the rule is unchanged.

        One request: no more than the unscaled rule gives all of them. So the scaled budget
        starts more prompts in a step, never a longer chunk of one: a long prompt admitted
        into a nearly full batch is spread over steps as before, instead of one step of up to
        `max_num_batched_tokens` that every decode waits behind."""
        config = self.config
        cap = config.max_prefill_tokens_while_decoding
        if not config.prefill_backlog_steps:
            return cap, cap
        free_slots = max(config.max_num_seqs - len(self.running), 0)
        backlog = self.waiting.num_prompt_tokens_left(free_slots) + sum(
            r.num_prompt_tokens_left for r in self.running
        )
        steps = max(1, -(-config.prefill_backlog_steps * free_slots // config.max_num_seqs))

        def share(num_steps: int) -> int:
            return max(cap, min(-(-backlog // num_steps), config.max_num_batched_tokens))

        return share(steps), share(config.prefill_backlog_steps)

    def _drafts(self, request: Request, max_num_new: int) -> list[int]:
        """Draft tokens for a decoding request, their slots allocated; [] when there is no
        drafter, no match, no room in the step or the request's max_tokens, or when their
        blocks would leave fewer free blocks than running requests (drafts never cause a
        preemption)."""
        if self.drafter is None:
            return []
        max_drafts = min(max_num_new - 1, request.max_tokens - request.num_output_tokens - 1)
        drafts = self.drafter.propose(request, max_drafts)
        if not drafts:
            return []
        bs = self.kv.block_size
        end = request.num_tokens + len(drafts)
        num_extra_blocks = cdiv(end, bs) - len(self.kv.get_block_ids(request.request_id))
        if self.kv.num_free_blocks - max(num_extra_blocks, 0) < len(self.running):
            return []
        if not self.kv.allocate_slots(request, 1 + len(drafts)):
            return []
        return drafts

    def _choose_victim(self, exclude: set[str]) -> Request:
        candidates = [r for r in self.running if r.request_id not in exclude] or self.running
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request, front=True)

    def update_after_step(
        self, out: SchedulerOutput, num_accepted: dict[str, int] | None = None
    ) -> None:
        """Advance computed counts and publish newly full blocks to the prefix cache.
        `num_accepted`: per request scheduled with drafts, how many the verify step accepted;
        the KV of the others is rolled back (not counted as computed)."""
        self.num_steps += 1
        for s in out.scheduled:
            r = s.request
            self.num_prompt_tokens_computed += min(s.num_new_tokens, r.num_prompt_tokens_left)
            r.num_computed_tokens += s.num_new_tokens
            if s.draft_token_ids:
                assert num_accepted is not None, "a verify step comes with its accepted counts"
                accepted = num_accepted[r.request_id]
                self.spec_stats.observe(len(s.draft_token_ids), accepted)
                r.num_computed_tokens -= len(s.draft_token_ids) - accepted
            self.kv.cache_blocks(r)
