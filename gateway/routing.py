"""Which registry, index and router the gateway runs, from its settings.

| settings                              | registry         | index                     |
|---------------------------------------|------------------|---------------------------|
| `redis_url`, no `--decode/--prefill`  | `RedisRegistry`  | `RedisBlockIndex`         |
| `--decode/--prefill` (Redis or not)   | `StaticRegistry` | `WatchedIndex` (embedded) |

The router is `KVRouter` over those, or `RoundRobinRouter` with `router="round_robin"`. Explicit
instance lists win over discovery: Redis may be configured for quotas alone.
"""

from __future__ import annotations

import logging

from gateway.config import GatewaySettings
from gateway.registry import InstanceRegistry, StaticRegistry
from gateway.router import RoundRobinRouter, Router

logger = logging.getLogger(__name__)

# Lookups wait at most this long for Redis: a request is waiting (then: route by load).
INDEX_TIMEOUT_S = 0.25


def _no_retry():
    """redis-py retries 10 times with backoff by default: seconds of a request waiting on a
    dead Redis. Our callers have their own fallbacks (last snapshot, load-only routing)."""
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return Retry(NoBackoff(), 0)


def uses_discovery(settings: GatewaySettings) -> bool:
    return bool(settings.redis_url) and not (settings.decode or settings.prefill)


def build_registry(settings: GatewaySettings) -> InstanceRegistry:
    if uses_discovery(settings):
        import redis.asyncio

        from gateway.redis_registry import RedisRegistry

        client = redis.asyncio.Redis.from_url(
            settings.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0, retry=_no_retry()
        )
        return RedisRegistry(client, refresh_s=settings.registry_refresh_s)
    return StaticRegistry(settings.decode, settings.prefill)


def build_router(settings: GatewaySettings, registry: InstanceRegistry) -> Router:
    cooldown_s = settings.unhealthy_cooldown_s
    if settings.router == "round_robin":
        return RoundRobinRouter(registry, cooldown_s=cooldown_s)
    from gateway.cost_model import CostParams
    from gateway.kv_router import KVRouter, RouteLog

    params = CostParams(allow_local=settings.prefill_policy == "auto")
    log = RouteLog(settings.route_log) if settings.route_log else None
    kw = dict(params=params, cooldown_s=cooldown_s, route_log=log)

    if uses_discovery(settings):
        import redis.asyncio

        from gateway.redis_index import RedisBlockIndex

        client = redis.asyncio.Redis.from_url(
            settings.redis_url,
            socket_timeout=INDEX_TIMEOUT_S,
            socket_connect_timeout=INDEX_TIMEOUT_S,
            retry=_no_retry(),
        )
        return KVRouter(registry, RedisBlockIndex(client), **kw)
    if isinstance(registry, StaticRegistry):
        from gateway.kv_watch import WatchedIndex

        return KVRouter(registry, WatchedIndex(registry), **kw)
    return KVRouter(registry, None, **kw)  # load only
