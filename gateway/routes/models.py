"""`GET /v1/models`, `GET /v1/models/{model}` (vLLM's shape) and `GET /version`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from gateway import __version__
from gateway.deps import GatewayDep
from gateway.errors import model_not_found
from gateway.model_info import ModelInfo

router = APIRouter()


def _card(info: ModelInfo, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": info.created,
        "owned_by": "tandem",
        "root": info.root,
        "parent": None,
        "max_model_len": info.max_model_len,
    }


@router.get("/v1/models")
async def list_models(gw: GatewayDep) -> dict[str, Any]:
    data = [_card(gw.model, name) for name in gw.model.served_model_names]
    return {"object": "list", "data": data}


# `:path`: a hub id such as `org/name` is one model name (the SDK may send the slash as is).
@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, gw: GatewayDep) -> dict[str, Any]:
    if model not in gw.model.served_model_names:
        raise model_not_found(model)
    return _card(gw.model, model)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}
