"""The gateway's long-lived objects and the FastAPI dependency that hands them to routes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from gateway.clients import DecodeClients
from gateway.config import GatewaySettings
from gateway.dispatch import Dispatcher
from gateway.logprobs import TokenTexts
from gateway.model_info import ModelInfo
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


def get_state(request: Request) -> GatewayState:
    return request.app.state.gateway


GatewayDep = Annotated[GatewayState, Depends(get_state)]
