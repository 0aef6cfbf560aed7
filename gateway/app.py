"""The FastAPI application: builds the gateway's state and wires routes and handlers."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway import __version__, openapi
from gateway.access_log import AccessLogMiddleware
from gateway.clients import DecodeClients
from gateway.config import GatewaySettings
from gateway.deps import GatewayState
from gateway.dispatch import Dispatcher
from gateway.edge import Edge
from gateway.errors import install_handlers
from gateway.fast_routes import FastRoutes
from gateway.kv_router import KVRouter, RoutingCollector
from gateway.logprobs import TokenTexts
from gateway.model_info import ModelInfo, load_model_info
from gateway.registry import InstanceRegistry
from gateway.router import Router
from gateway.routes import chat, completions, health, models, tokenize
from gateway.routing import build_registry, build_router
from gateway.shedding import Shedder, SheddingMiddleware

logger = logging.getLogger(__name__)


def build_state(
    settings: GatewaySettings,
    *,
    model: ModelInfo | None = None,
    registry: InstanceRegistry | None = None,
    router: Router | None = None,
) -> GatewayState:
    """Defaults come from settings; tests and later policies inject their own pieces."""
    model = model or load_model_info(settings)
    edge = Edge.from_settings(settings, model.name)
    registry = registry or build_registry(settings)
    router = router or build_router(settings, registry)
    clients = DecodeClients()
    return GatewayState(
        settings=settings,
        model=model,
        registry=registry,
        router=router,
        clients=clients,
        dispatcher=Dispatcher(router, clients, model.tokenizer, edge.bookkeeping.defer),
        token_texts=TokenTexts(model.tokenizer),
        edge=edge,
    )


def create_app(
    settings: GatewaySettings, state: GatewayState | None = None, *, fast_routes: bool = True
) -> FastAPI:
    """`fast_routes=False`: the completion routes go through FastAPI's routing too (what the
    tests hold gateway/fast_routes.py to)."""
    state = state or build_state(settings)
    shedder = Shedder(settings, state.edge.metrics)
    state.preprocessor.num_in_flight = lambda: shedder.num_inflight

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.edge.start()
        await state.registry.start()  # routing: registry refresh, index feeds
        await state.router.start()
        shedder.start()
        yield
        shedder.close()
        # What the last requests deferred (the router's calibration and route log among it)
        # runs before the router closes its route log.
        state.edge.bookkeeping.flush()
        await state.router.close()
        await state.registry.close()
        await state.edge.close()
        await state.clients.close()

    # No docs/openapi routes: the public port serves the API and nothing else. The schema is
    # at /openapi.json on the internal metrics port (gateway/openapi.py).
    app = FastAPI(
        title="Tandem gateway",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        # FastAPI's own OpenTelemetry (0.165+) looks up three providers on every request even
        # when none is configured (~5 us a request); the gateway exports Prometheus metrics
        # (docs/operations.md), not OpenTelemetry.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.gateway = state
    for module in (chat, completions, models, health):
        app.include_router(module.router)
    if settings.enable_tokenizer_endpoints:
        app.include_router(tokenize.router)
    install_handlers(app)
    openapi.install(app)
    state.edge.internal_documents["/openapi.json"] = lambda: openapi.schema_bytes(app)
    if isinstance(state.router, KVRouter):  # route decisions, local prefills, degraded mode
        state.edge.metrics.registry.register(RoutingCollector(state.router))
    if fast_routes:  # added first: innermost, the middlewares added next run for it too
        endpoints = {
            "/v1/chat/completions": chat.create_chat_completion,
            "/v1/completions": completions.create_completion,
        }
        app.add_middleware(
            FastRoutes, state=state, endpoints=endpoints, handlers=app.exception_handlers
        )
    # Overload: 503 before a body is parsed (inside the edge: unknown paths stay 404s).
    app.add_middleware(SheddingMiddleware, shedder=shedder)
    state.edge.install(app)  # allowlist, auth, CORS: inside the access log
    app.add_middleware(AccessLogMiddleware, bookkeeping=state.edge.bookkeeping)
    return app
