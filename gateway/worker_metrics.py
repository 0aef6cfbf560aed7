"""One Prometheus endpoint for the N workers of `tandem gateway --workers N`.

Each worker keeps its own registry (custom collectors like the router's read live state, which
prometheus-client's multiprocess mode cannot do) and serves it on a loopback port of its own.
The parent serves `--metrics-port`: at every scrape it reads each ready worker's /metrics and
returns all of their series, each with a `worker` label (the worker's index: a restarted worker
continues its series, and Prometheus sees a counter reset). Queries that `sum` or
`histogram_quantile(sum by (le) ...)` over a pool read the same with one worker or many. A
worker that does not answer (restarting) is missing from that scrape. Other paths
(/openapi.json) are answered by the first ready worker, as every worker serves the same app.
"""

from __future__ import annotations

import logging
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from gateway.workers import Worker

logger = logging.getLogger(__name__)
SCRAPE_TIMEOUT_S = 5.0


def _fetch(address: str, path: str) -> tuple[int, str, bytes]:
    """GET http://address/path: (status, content type, body)."""
    url = f"http://{address}{path}"
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def merge(texts: dict[int, str]) -> list[Metric]:
    """Workers' exposition texts (index -> text) as one list of families, `worker` labelled."""
    families: dict[str, Metric] = {}
    for index, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            label = str(index)
            merged.samples += [
                s._replace(labels={**s.labels, "worker": label}) for s in family.samples
            ]
    return list(families.values())


class _WorkersCollector:
    def __init__(self, workers: Sequence[Worker | None]):
        self.workers = workers

    def collect(self) -> Iterator[Metric]:
        texts = {}
        for worker in list(self.workers):
            if worker is None or worker.metrics_address is None or not worker.ready.is_set():
                continue
            try:
                status, _, body = _fetch(worker.metrics_address, "/metrics")
            except OSError as e:  # restarting, or too busy to answer in time
                logger.debug("worker %d metrics: %s", worker.index, e)
                continue
            if status == 200:
                texts[worker.index] = body.decode()
        yield from merge(texts)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


class MetricsServer:
    """The parent's metrics port (a prometheus-client threaded WSGI server in a daemon thread)."""

    def __init__(self, workers: Sequence[Worker | None]):
        self.workers = workers
        self.registry = CollectorRegistry()
        self.registry.register(_WorkersCollector(workers))
        self._server: ThreadingWSGIServer | None = None

    def start(self, host: str, port: int) -> tuple[str, int]:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)

        class Server(ThreadingWSGIServer):
            address_family = infos[0][0]

        app = self._app(make_wsgi_app(self.registry))
        self._server = make_server(host, port, app, Server, handler_class=_QuietHandler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        address = self._server.server_address[:2]
        return address[0], address[1]

    def _app(self, metrics_app: Callable) -> Callable:
        def app(environ: dict, start_response: Callable) -> list[bytes]:
            path = environ.get("PATH_INFO", "")
            if path == "/metrics":
                return metrics_app(environ, start_response)
            ready = [w for w in self.workers if w is not None and w.ready.is_set()]
            address = next((w.metrics_address for w in ready if w.metrics_address), None)
            if address is None or environ.get("REQUEST_METHOD") != "GET":
                start_response("503 Service Unavailable", [("Content-Length", "0")])
                return [b""]
            try:
                status, content_type, body = _fetch(address, path)
            except OSError:
                start_response("503 Service Unavailable", [("Content-Length", "0")])
                return [b""]
            headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
            start_response(f"{status} {'OK' if status == 200 else 'Error'}", headers)
            return [body]

        return app

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
