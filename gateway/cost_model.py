"""Scoring (P, D) choices by predicted time to first token; remote prefill on P or local on D.

Every term is in seconds, from what instances measure and report (`InstanceStatus`) plus the
work this gateway routed to them since their last report (`Candidate.num_pending_*`). With L the
prompt length and hit_X the prompt tokens instance X already caches:

    rate_P            P's measured prefill throughput (tokens/s), `default_prefill_tokens_per_s`
                      until it has one; rate = D's own measured rate (engine/kv_events.py fits
                      it from its mixed steps), else the P pool's mean (the same model)
    ttft_remote(P, D) = queue_P / rate_P + (L - hit_P) / rate_P              queue + compute at P
                        + (L - hit_D) * kv_bytes_per_token / link_bytes_per_s  KV over the link
                        + remote_overhead_s                                    the extra hop
    cost_remote(P, D) = ttft_remote(P, D) + work_weight * (L - hit_P) / rate_P
                        + decoding_P * (L - hit_P) / rate_P    stall of P's streams (kv_both)
    cost_local(D)     = (queue_D + L - hit_D) / rate * decode_time_weight     queue + compute at D
                        + outstanding_D * (L - hit_D) / rate                   stall of D's streams
                        + work_weight * (L - hit_D) / rate
                        + local_overhead_s                                     the hop and D's step
    decode_cost(D)    = outstanding_D * decode_slot_s, +inf when D lacks free blocks
    queue_X           = pending_X: every prompt token queued at X (reported + routed since).
                        Work that fits in the next step with the new prompt is batched with
                        it, but a step takes as long as its tokens take: the first token comes
                        after all of it (counting only what exceeded one step's budget
                        predicted TTFTs 2.3 x too low on the H200, see bench/README.md)

The work term is the delay a choice imposes on the requests queued behind it: TTFT alone is
myopic (it would send a request to an idle P that must recompute a prefix, rather than to a P
holding it with a little work queued, and the pool pays for the miss on every later turn).

Local prefill is chosen when cost_local + local_min_gain_s < min_P cost_remote: D keeps decoding
unless prefilling there saves real time (D holds most of the prefix, or every P is backed up).
`decode_time_weight` > 1 because a second of prefill on D is a second its batch does not decode.

Calibration (`Calibration`): link_bytes_per_s and the overheads start at the constants
below and follow what finished requests measured (D's `Timings`: the KV bytes and the part of the
transfer P waited for after computing, and the gateway's own TTFT), so the model tracks the real
link and hop instead of trusting guesses; the prefill rates are the instances' own measurements.

Hot-spot protection: an instance's cache hits count only while its outstanding requests exceed
the least-loaded candidate's by at most `hot_spot_max_gap`; beyond that it is scored as if it
held nothing and ranked after every instance within the gap. A hot prefix then spreads over idle
instances instead of queueing on one (its requests are cheap in tokens, so token queues alone
would keep choosing the holder).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from gateway.registry import Instance


@dataclass(frozen=True)
class CostParams:
    default_prefill_tokens_per_s: float = 4000.0
    link_bytes_per_s: float = 2e9
    remote_overhead_s: float = 0.003
    local_overhead_s: float = 0.003
    decode_time_weight: float = 2.0
    work_weight: float = 1.0
    local_min_gain_s: float = 0.02
    decode_slot_s: float = 0.001
    hot_spot_max_gap: int = 4
    allow_local: bool = True  # False: remote prefill whenever a prefill is healthy

    def __post_init__(self) -> None:
        assert self.default_prefill_tokens_per_s > 0 and self.link_bytes_per_s > 0
        assert self.hot_spot_max_gap >= 0 and self.decode_time_weight >= 1.0


@dataclass(frozen=True)
class Candidate:
    """One instance as the scorer sees it for one prompt."""

    instance: Instance
    num_hit_tokens: int = 0
    num_outstanding: int = 0  # waiting + running, plus requests routed since its last report
    num_pending_tokens: int = 0  # prompt tokens queued for prefill, likewise
    prefill_tokens_per_s: float = 0.0  # 0.0: not measured
    kv_bytes_per_token: float = 0.0
    has_room: bool = True  # a decode with enough free blocks for the prompt (or unknown)
    num_decoding: int = 0  # as a prefill: streams it also decodes (a kv_both instance)


@dataclass(frozen=True)
class Decision:
    """One route: `prefills` in the order D should try them; () = prefill locally on D."""

    decode: Candidate
    prefills: tuple[Candidate, ...]
    reason: str
    cost_s: float


def pool_rate(prefills: Sequence[Candidate], params: CostParams) -> float:
    measured = [p.prefill_tokens_per_s for p in prefills if p.prefill_tokens_per_s > 0]
    return sum(measured) / len(measured) if measured else params.default_prefill_tokens_per_s


def hot_flags(pool: Sequence[Candidate], max_gap: int) -> list[bool]:
    """Which instances are more than `max_gap` outstanding requests above the least loaded."""
    if not pool:
        return []
    least = min(c.num_outstanding for c in pool)
    return [c.num_outstanding - least > max_gap for c in pool]


def capped_hits(pool: Sequence[Candidate], max_gap: int) -> list[int]:
    """Hits that count for scoring: zero for hot instances."""
    return [0 if hot else c.num_hit_tokens for c, hot in zip(pool, hot_flags(pool, max_gap))]


def ttft_remote(
    p: Candidate, p_hit: int, d: Candidate, d_hit: int, num_tokens: int, params: CostParams
) -> float:
    rate = p.prefill_tokens_per_s or params.default_prefill_tokens_per_s
    compute_s = (p.num_pending_tokens + num_tokens - p_hit) / rate
    transfer_s = (num_tokens - d_hit) * d.kv_bytes_per_token / params.link_bytes_per_s
    return compute_s + transfer_s + params.remote_overhead_s


def cost_remote(
    p: Candidate, p_hit: int, d: Candidate, d_hit: int, num_tokens: int, params: CostParams
) -> float:
    rate = p.prefill_tokens_per_s or params.default_prefill_tokens_per_s
    compute_s = (num_tokens - p_hit) / rate
    # A kv_both P also decodes: its streams wait for this prefill as a local one's would.
    stall_s = p.num_decoding * compute_s
    return (
        ttft_remote(p, p_hit, d, d_hit, num_tokens, params)
        + compute_s * params.work_weight
        + stall_s
    )


def cost_local(d: Candidate, d_hit: int, num_tokens: int, rate: float, params: CostParams) -> float:
    compute_s = (num_tokens - d_hit) / rate
    queue_s = d.num_pending_tokens / rate
    stall_s = d.num_outstanding * compute_s
    work_s = compute_s * params.work_weight
    return (
        (queue_s + compute_s) * params.decode_time_weight
        + stall_s
        + work_s
        + params.local_overhead_s
    )


def decode_cost(d: Candidate, params: CostParams) -> float:
    return d.num_outstanding * params.decode_slot_s if d.has_room else math.inf


def plan_routes(
    decodes: Sequence[Candidate],
    prefills: Sequence[Candidate],
    num_tokens: int,
    params: CostParams,
) -> list[Decision]:
    """One decision per decode, best first (ties: fewer outstanding, then registry order)."""
    rate = pool_rate(prefills, params)
    p_hits = capped_hits(prefills, params.hot_spot_max_gap)
    d_hits = capped_hits(decodes, params.hot_spot_max_gap)
    scored = []
    for i, (d, d_hit) in enumerate(zip(decodes, d_hits)):
        decision = _decide(d, d_hit, prefills, p_hits, num_tokens, rate, params)
        total_s = decision.cost_s + decode_cost(d, params)
        scored.append((total_s, d.num_outstanding, i, decision))
    scored.sort(key=lambda s: s[:3])
    return [s[3] for s in scored]


def _decide(
    d: Candidate,
    d_hit: int,
    prefills: Sequence[Candidate],
    p_hits: Sequence[int],
    num_tokens: int,
    rate: float,
    params: CostParams,
) -> Decision:
    rate = d.prefill_tokens_per_s or rate
    local_s = cost_local(d, d_hit, num_tokens, rate, params)
    # A kv_both instance is in both pools: prefilling "remotely" on itself is its local prefill.
    others = [j for j, p in enumerate(prefills) if p.instance.instance_id != d.instance.instance_id]
    if len(others) < len(prefills):
        prefills, p_hits = [prefills[j] for j in others], [p_hits[j] for j in others]
    if not prefills:
        return Decision(d, (), "no_prefill", local_s)
    hot = hot_flags(prefills, params.hot_spot_max_gap)
    order = _rank_prefills(d, d_hit, prefills, p_hits, hot, num_tokens, params)
    _, best_s, _, best_j, best = order[0]
    if params.allow_local and local_s + params.local_min_gain_s < best_s:
        reason = "local_prefix" if d_hit > p_hits[best_j] else "local_busy"
        return Decision(d, (), reason, local_s)
    raw = [c.num_hit_tokens for c in prefills]
    uncapped = _rank_prefills(d, d_hit, prefills, raw, [False] * len(prefills), num_tokens, params)
    if uncapped[0][-1] is not best and uncapped[0][-1].num_hit_tokens > 0:
        reason = "hot_spot"  # the cap moved this request off the prefix holder
    elif best.num_hit_tokens > 0:
        reason = "cache_hit"
    else:
        reason = "load"
    return Decision(d, tuple(o[-1] for o in order), reason, best_s)


def _rank_prefills(d, d_hit, prefills, p_hits, hot, num_tokens, params) -> list[tuple]:
    """(is_hot, cost_s, outstanding, index, prefill), best first."""
    return sorted(
        (is_hot, cost_remote(p, hit, d, d_hit, num_tokens, params), p.num_outstanding, j, p)
        for j, (p, hit, is_hot) in enumerate(zip(prefills, p_hits, hot))
    )


def ttft_local(d: Candidate, d_hit: int, num_tokens: int, rate: float, params: CostParams) -> float:
    """Predicted seconds to the first token when D prefills itself: its queue, then the prompt,
    then the hop and D's step around it."""
    rate = d.prefill_tokens_per_s or rate
    return (d.num_pending_tokens + num_tokens - d_hit) / rate + params.local_overhead_s


class Calibration:
    """The link and hop costs, recalibrated from finished requests (an EMA per term).

    From a remote prefill's `Timings` (D's view) and the gateway's own TTFT:
    - exposed transfer = (P's reply time - P's compute time) + (P's reply -> KV seen at D): the
      transfer time the request waited for; link_bytes_per_s = KV bytes / exposed transfer,
      from transfers of at least `min_bytes` (small ones measure latency, not bandwidth);
    - hop = TTFT at the gateway - P's reply time - the KV wait: gateway -> D -> P and back.
    From a local prefill: local_overhead_s = TTFT at the gateway - the predicted queue and
    compute at D (the hop and D's step around the prefill; it also absorbs a biased rate).
    """

    def __init__(self, params: CostParams, ema: float = 0.2, min_bytes: int = 1 << 20):
        self.params, self.ema, self.min_bytes = params, ema, min_bytes
        self._measured: set[str] = set()  # terms measured at least once

    def observe_remote(self, ttft_s: float, timings) -> CostParams:
        exposed_s = timings.remote_server_s - timings.remote_compute_s + timings.kv_wait_s
        hop_s = ttft_s - timings.remote_server_s - timings.kv_wait_s
        p = self.params
        link, overhead = p.link_bytes_per_s, p.remote_overhead_s
        if timings.kv_transfer_bytes >= self.min_bytes and exposed_s > 0:
            link = self._fold("link", link, timings.kv_transfer_bytes / max(exposed_s, 1e-5))
        if hop_s > 0:
            overhead = self._fold("hop", overhead, hop_s)
        self.params = replace(p, link_bytes_per_s=link, remote_overhead_s=overhead)
        return self.params

    def observe_local(self, ttft_s: float, predicted_compute_s: float) -> CostParams:
        overhead = self._fold("local", self.params.local_overhead_s, ttft_s - predicted_compute_s)
        self.params = replace(self.params, local_overhead_s=max(overhead, 0.0))
        return self.params

    def _fold(self, term: str, old: float, new: float) -> float:
        if term not in self._measured:  # the first measurement replaces the constant
            self._measured.add(term)
            return new
        return old + self.ema * (new - old)
