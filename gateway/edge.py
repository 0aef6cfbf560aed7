"""The gateway's edge as one object: keys, metrics and quotas, their middlewares and lifecycle.

`build_state` makes one `Edge` from settings; `create_app` installs its middlewares and starts
and stops it in the lifespan (the Redis client and the metrics exporter need a running loop /
thread, and must close with the app). Middleware order, outermost first:
access log → CORS (only with configured origins) → `EdgeMiddleware` (allowlist, body size,
auth) → load shedding → the completion routes' fast path (gateway/fast_routes.py) → routes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from gateway.allowlist import OPTIONAL_ROUTES, ROUTES, EdgeMiddleware
from gateway.auth import KeyStore, Principal, anonymous
from gateway.bookkeeping import Bookkeeping
from gateway.config import GatewaySettings
from gateway.metrics import Documents, GatewayMetrics
from gateway.quota_service import QuotaService

logger = logging.getLogger(__name__)


@dataclass
class Edge:
    settings: GatewaySettings
    keys: KeyStore
    anonymous: Principal
    metrics: GatewayMetrics
    quota: QuotaService
    metrics_address: tuple[str, int] | None = None  # where /metrics listens, once started
    # Served next to /metrics (create_app adds /openapi.json): operators' documents.
    internal_documents: Documents = field(default_factory=dict)
    # Access-log lines and metric observations, written in batches (gateway/bookkeeping.py).
    bookkeeping: Bookkeeping = field(default_factory=Bookkeeping)

    @classmethod
    def from_settings(cls, settings: GatewaySettings, model_name: str) -> Edge:
        keys = KeyStore.from_settings(settings)
        if not keys.is_enabled:
            logger.warning(
                "AUTH IS OFF: no API keys configured (TANDEM_API_KEYS / TANDEM_API_KEYS_FILE); "
                "every request is served without a key"
            )
        metrics = GatewayMetrics(model_name)
        return cls(settings, keys, anonymous(settings), metrics, QuotaService(settings, metrics))

    def public_paths(self) -> frozenset[str]:
        """Reachable without a key when keys are configured; everything else needs one."""
        paths: set[str] = {"/version"}  # no secret, no backend: the liveness probes' path
        if self.settings.public_health:
            paths.add("/health")
        if self.settings.public_models:
            paths.update(("/v1/models", "/v1/models/{model}"))
        return frozenset(paths)

    def routes(self) -> dict[str, frozenset[str]]:
        """The allowlist: the OpenAI routes, plus the tokenizer ones when turned on."""
        if self.settings.enable_tokenizer_endpoints:
            return {**ROUTES, **OPTIONAL_ROUTES}
        return ROUTES

    def install(self, app: FastAPI) -> None:
        """Add the edge middlewares (call before adding the access log, which wraps them)."""
        app.add_middleware(
            EdgeMiddleware,
            keys=self.keys,
            anonymous=self.anonymous,
            public_paths=self.public_paths(),
            max_body_bytes=self.settings.max_request_body_bytes,
            metrics=self.metrics,
            routes=self.routes(),
        )
        if self.settings.cors_origins:
            app.add_middleware(
                CORSMiddleware,
                allow_origins=self.settings.cors_origins,
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
                allow_credentials=False,  # keys travel in headers, not cookies
            )

    async def start(self) -> None:
        await self.quota.start()
        if self.settings.metrics_port is not None:
            self.metrics_address = self.metrics.start_server(
                self.settings.metrics_host, self.settings.metrics_port, self.internal_documents
            )

    async def close(self) -> None:
        self.bookkeeping.flush()  # the last requests' lines and metrics
        self.metrics.stop_server()
        await self.quota.close()
