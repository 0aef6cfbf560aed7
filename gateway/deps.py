"""The gateway's long-lived objects and the FastAPI dependency that hands them to routes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from gateway.auth import Principal
from gateway.clients import DecodeClients
from gateway.config import GatewaySettings
from gateway.dispatch import Dispatcher
from gateway.edge import Edge
from gateway.logprobs import TokenTexts
from gateway.model_info import ModelInfo
from gateway.offload import Preprocessor
from gateway.registry import InstanceRegistry
from gateway.router import Router


@dataclass
class GatewayState:
    settings: GatewaySettings
    model: ModelInfo
    registry: InstanceRegistry
    router: Router
    clients: DecodeClients
    dispatcher: Dispatcher
    token_texts: TokenTexts
    edge: Edge
    preprocessor: Preprocessor = None  # type: ignore[assignment]  # built from settings

    def __post_init__(self) -> None:
        if self.preprocessor is None:
            s = self.settings
            self.preprocessor = Preprocessor(s.preprocess_workers, s.tokenize_timeout_s)


# Dependencies are `async def` on purpose: FastAPI runs plain `def` dependencies in a worker
# thread, a hand-off per dependency per request that showed up as tail latency.
async def get_state(request: Request) -> GatewayState:
    return request.app.state.gateway


GatewayDep = Annotated[GatewayState, Depends(get_state)]


async def get_principal(request: Request) -> Principal:
    """Set by `EdgeMiddleware` for every request it lets through (anonymous when auth is off)."""
    return request.scope["state"]["principal"]


PrincipalDep = Annotated[Principal, Depends(get_principal)]
