"""`GET /health`: 200 when at least one decode answers, else 503.

Public (by default), so it reports counts only, never instance addresses. With Redis configured,
`quota_backend` says where quotas are kept: "memory" with status "degraded" means Redis is
unreachable and each gateway enforces its own limits until it returns (still a 200: requests are
served). Probe results also feed the router's health marks, so a decode that came back is used
again before its cooldown ends.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway.deps import GatewayDep
from gateway.router import Outcome

router = APIRouter()


@router.get("/health")
async def health(gw: GatewayDep) -> JSONResponse:
    decodes = list(gw.registry.decodes())
    timeout_s = gw.settings.health_timeout_s
    outcomes = await asyncio.gather(*(gw.clients.probe(d, timeout_s) for d in decodes))
    for decode, outcome in zip(decodes, outcomes):
        gw.router.report(decode, outcome)
    num_reachable = sum(o is Outcome.OK for o in outcomes)
    quota = gw.edge.quota
    status = "degraded" if quota.is_degraded else "ok"
    body = {
        "status": status if num_reachable else "unavailable",
        "num_decodes": len(decodes),
        "num_decodes_reachable": num_reachable,
    }
    if gw.settings.redis_url:
        body["quota_backend"] = quota.backend_name
    if num_reachable:
        return JSONResponse(body)
    headers = {"Retry-After": str(gw.settings.retry_after_s)}
    return JSONResponse(body, status_code=503, headers=headers)
