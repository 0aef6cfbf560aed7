"""`GET /v1/models` (vLLM's shape) and `GET /version`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from gateway import __version__
from gateway.deps import GatewayDep

router = APIRouter()


@router.get("/v1/models")
async def list_models(gw: GatewayDep) -> dict[str, Any]:
    info = gw.model
    data = [
        {
            "id": name,
            "object": "model",
            "created": info.created,
            "owned_by": "tandem",
            "root": info.root,
            "parent": None,
            "max_model_len": info.max_model_len,
        }
        for name in info.served_model_names
    ]
    return {"object": "list", "data": data}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}
