"""Prometheus metrics of a prefill or decode service, on an internal port (never a public one).

Names follow vLLM where the meaning is the same (`vllm:num_requests_running`, ...); Tandem's own
are prefixed `tandem:`. Gauges and counters are read from the engine at scrape time (the
scheduler and block pool are only read, and their sizes are single attribute reads); latency
histograms are observed by the decode service as tokens stream, the inter-token latency once
per engine step that gives a request tokens, timed at the engine (as vLLM's iteration stats),
however many steps a slow consumer reads at once.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

REGISTRY = CollectorRegistry()
_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "vllm:time_to_first_token_seconds",
    "Time to first token (decode service).",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
INTER_TOKEN_LATENCY = Histogram(
    "vllm:inter_token_latency_seconds",
    "Time between a request's engine steps that gave it tokens (decode service).",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
# vLLM's split of a request's time to first token inside the engine: queued (WAITING, until it
# is first scheduled) and prefill (first scheduled to first token). Observed by the decode
# service with its first token, for the prompts it prefills itself: after a remote prefill
# the first token is the prefill's, out before this engine schedules the request.
REQUEST_QUEUE_TIME = Histogram(
    "vllm:request_queue_time_seconds",
    "Histogram of time spent in WAITING phase for request.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
REQUEST_PREFILL_TIME = Histogram(
    "vllm:request_prefill_time_seconds",
    "Histogram of time spent in PREFILL phase for request.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)


def observe_phases(request, first_token_time: float) -> None:
    """`REQUEST_QUEUE_TIME` and `REQUEST_PREFILL_TIME` of a request whose first token came at
    `first_token_time` (time.monotonic()), if the scheduler scheduled it before."""
    scheduled = request.first_scheduled_time
    if scheduled is None or request.queued_time is None:
        return
    REQUEST_QUEUE_TIME.observe(scheduled - request.queued_time)
    REQUEST_PREFILL_TIME.observe(max(first_token_time - scheduled, 0.0))


KV_TRANSFER_SECONDS = Histogram(
    "tandem:kv_transfer_seconds",
    "Prefill start to KV written at the decode side.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)


# A remote prefill's parts at the decode, observed with its first token (what the decode's TTFT
# of such a request is made of, besides the hop into the engine): from the Generate call to the
# Prefill call (blocks reserved, waiting in line for them), the Prefill call itself, and that
# call less the prefill's own time from receipt to reply (the two gRPC hops and the wait of
# either event loop: what neither engine sees).
REMOTE_PREFILL_SETUP_SECONDS = Histogram(
    "tandem:remote_prefill_setup_seconds",
    "Decode: Generate call to Prefill call (KV blocks reserved).",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
REMOTE_PREFILL_RPC_SECONDS = Histogram(
    "tandem:remote_prefill_rpc_seconds",
    "Decode: the Prefill call, sent to answered.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
REMOTE_PREFILL_TRANSIT_SECONDS = Histogram(
    "tandem:remote_prefill_transit_seconds",
    "Decode: the Prefill call less the prefill's own receipt-to-reply time.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)


class EngineCollector(Collector):
    def __init__(self, engine, servicer, role: str, instance_id: str):
        self.engine, self.servicer = engine, servicer
        self.labels = {
            "role": role,
            "instance": instance_id,
            "model_name": engine.core.config.model.model,
        }

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def collect(self):
        s = self.engine.core.stats()
        yield self._gauge(
            "vllm:num_requests_running", "Requests in the running batch.", s.num_running
        )
        yield self._gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", s.kv_cache_usage
        )
        yield self._counter("vllm:num_preemptions", "Preemptions by recompute.", s.num_preemptions)
        yield self._counter(
            "vllm:prefix_cache_queries", "Prefix-cache queries (tokens).", s.prefix_cache_queries
        )
        yield self._counter(
            "vllm:prefix_cache_hits", "Prefix-cache hits (tokens).", s.prefix_cache_hits
        )
        if s.spec_decode is not None:
            yield from self._spec_decode(s.spec_decode)
        yield self._gauge(
            "tandem:engine_alive", "1 while the engine loop runs.", float(self.engine.is_alive)
        )
        yield self._counter(
            "tandem:engine_hook_errors",
            "Exceptions raised by engine-loop hooks (KV transfer polls, KV events); logged.",
            self.engine.num_hook_errors,
        )
        for name, value in getattr(self.servicer, "metric_counters", lambda: {})().items():
            yield self._counter(f"tandem:{name}", f"{name.replace('_', ' ')}.", value)

    def _spec_decode(self, stats):
        """vLLM's speculative-decoding counters (exported only when speculation is on)."""
        for name, doc, value in (
            ("num_drafts", "Verify rows (a request with drafts in a step).", stats.num_drafts),
            ("num_draft_tokens", "Draft tokens verified.", stats.num_draft_tokens),
            ("num_accepted_tokens", "Draft tokens accepted.", stats.num_accepted_tokens),
        ):
            yield self._counter(f"vllm:spec_decode_{name}", doc, value)
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0: the first).",
            labels=[*self.labels, "position"],
        )
        for pos, count in enumerate(stats.accepted_per_pos):
            per_pos.add_metric([*self.labels.values(), str(pos)], count)
        yield per_pos


def start_metrics_server(
    engine, servicer, role: str, instance_id: str, host: str, port: int
) -> int:
    """Serve /metrics on host:port (0 = any free port); returns the bound port."""
    REGISTRY.register(EngineCollector(engine, servicer, role, instance_id))
    server, _ = start_http_server(port, addr=host, registry=REGISTRY)
    return server.server_port
