"""Prometheus metrics of the gateway, served on an internal port only (`--metrics-port`).

vLLM's names where the meaning is the same (dashboards built for vLLM keep working), Tandem's
own `tandem:*` for the edge. Each app has its own `CollectorRegistry`, so several gateways in one
process (tests) do not collide. The exporter is prometheus-client's threaded HTTP server bound to
`metrics_host` (127.0.0.1 by default); the public app has no `/metrics` route at all.

The same internal port serves `/openapi.json` (gateway/openapi.py), for operators; the public
port does not.

Labels never carry keys or request data: `model_name`, `finished_reason`, `tenant` (a configured
name, so cardinality is bounded by the key file) and small fixed `reason` sets.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer

# Extra documents on the metrics port: path -> a function returning the JSON bytes.
Documents = dict[str, Callable[[], bytes]]

logger = logging.getLogger(__name__)

# vLLM's buckets for these two histograms.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        ProcessCollector(registry=r)
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests (per choice), by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency at the gateway, to the last byte.",
            ["model_name"],
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to the first streamed chunk (first tokens are in hand by then).",
            ["model_name"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.prepare = Histogram(
            "tandem:request_prepare_seconds",
            "Arrival at the gateway to the request ready for a decode (body read and parsed, "
            "quota reserved, prompt templated and tokenized); routing and the decode follow.",
            ["model_name"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefill tokens processed.", ["model_name"], registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens processed.", ["model_name"], registry=r
        )
        self.auth_failures = Counter(
            "tandem:auth_failures",
            "Requests refused with 401, by reason (missing, malformed, invalid).",
            ["reason"],
            registry=r,
        )
        self.quota_rejections = Counter(
            "tandem:quota_rejections",
            "Requests refused by a per-key window limit (429; 400: larger than tokens_per_min).",
            ["tenant", "reason"],
            registry=r,
        )
        self.degraded = Gauge(
            "tandem:degraded",
            "1 while Redis is unreachable and quotas run per gateway, in memory.",
            registry=r,
        )
        # The model's series, bound once: every request records five of them, and `labels()`
        # costs a lock and a lookup each time.
        self.of_model = ModelSeries(self, model_name)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start_server(
        self, host: str, port: int, documents: Documents | None = None
    ) -> tuple[str, int]:
        """Serve /metrics (and `documents`) on host:port (0: any free port); returns the
        bound address. prometheus-client's threaded WSGI server, quiet, in a daemon thread."""
        app = _with_documents(make_wsgi_app(self.registry), documents or {})

        class Server(ThreadingWSGIServer):
            address_family = _address_family(host, port)

        self._server = make_server(host, port, app, Server, handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        address = self._server.server_address[:2]
        logger.info("metrics on http://%s:%d/metrics (internal port)", *address)
        return address[0], address[1]

    def stop_server(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class ModelSeries:
    """The series of `metrics` labelled with one model name."""

    def __init__(self, metrics: GatewayMetrics, model_name: str):
        self.prompt_tokens = metrics.prompt_tokens.labels(model_name)
        self.generation_tokens = metrics.generation_tokens.labels(model_name)
        self.e2e_latency = metrics.e2e_latency.labels(model_name)
        self.ttft = metrics.ttft.labels(model_name)
        self.prepare = metrics.prepare.labels(model_name)
        self._success = metrics.request_success
        self._model_name = model_name
        self._success_by_reason: dict[str, Any] = {}

    def observe_request(
        self,
        num_prompt_tokens: int,
        num_completion_tokens: int,
        finish_reasons: list[str],
        e2e_s: float | None,
    ) -> None:
        """A finished request: its tokens, a success per finished choice, and its end-to-end
        latency when every choice finished."""
        if num_prompt_tokens:
            self.prompt_tokens.inc(num_prompt_tokens)
        if num_completion_tokens:
            self.generation_tokens.inc(num_completion_tokens)
        for reason in finish_reasons:
            self.request_success(reason).inc()
        if e2e_s is not None:
            self.e2e_latency.observe(e2e_s)

    def request_success(self, finished_reason: str) -> Any:
        child = self._success_by_reason.get(finished_reason)
        if child is None:
            child = self._success.labels(self._model_name, finished_reason)
            self._success_by_reason[finished_reason] = child
        return child


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def _address_family(host: str, port: int) -> socket.AddressFamily:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return infos[0][0]


def _with_documents(metrics_app: Callable, documents: Documents) -> Callable:
    """A WSGI app: GET of a document's path returns it as JSON, anything else goes to
    prometheus-client's app (/metrics)."""

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        make = documents.get(environ.get("PATH_INFO", ""))
        if make is None:
            return metrics_app(environ, start_response)
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET")])
            return [b""]
        body = make()
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        start_response("200 OK", headers)
        return [body] if environ["REQUEST_METHOD"] == "GET" else [b""]

    return app
