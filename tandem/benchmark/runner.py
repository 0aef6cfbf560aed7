"""One load point: requests released at seeded arrival times, at most `max_concurrency` in
flight, every one streamed through `client.send_request` on one clock.

Arrivals are vLLM's: with `request_rate` r and `burstiness` k, gaps are Gamma(shape k,
scale 1/(r k)) (k = 1: a Poisson process; k < 1 burstier; k = inf evenly spaced), then scaled
so that the last request arrives at n / r exactly; r = inf sends everything at once. A request
whose turn comes while `max_concurrency` are in flight waits for a slot; its clock starts when
it is sent, as in vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.benchmark.client import (
    Clock,
    RequestOutput,
    build_payload,
    new_session,
    send_request,
)
from tandem.benchmark.datasets import SampleRequest


@dataclass(frozen=True)
class LoadPoint:
    request_rate: float = math.inf  # requests per second
    burstiness: float = 1.0
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        assert self.request_rate > 0, "request rate must be positive (inf: all at once)"
        assert self.burstiness > 0, "burstiness must be positive"
        assert self.max_concurrency is None or self.max_concurrency >= 1


@dataclass(frozen=True)
class Target:
    """Where and how to send: the same for every request of a run."""

    api_url: str
    backend: str
    model: str
    headers: dict[str, str]
    ignore_eos: bool = False
    extra_body: dict[str, Any] | None = None


def arrival_offsets_s(
    num_requests: int, request_rate: float, burstiness: float, seed: int
) -> list[float]:
    """Send time of each request, in seconds after the first could go."""
    if request_rate == math.inf:
        return [0.0] * num_requests
    if burstiness == math.inf:
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(
            shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests
        )
    offsets = np.cumsum(gaps)
    # vLLM's normalisation: the sum of random gaps misses n / r by a few %; rescale so that
    # every seed offers the same mean rate and throughput figures stay comparable.
    offsets *= (num_requests / request_rate) / offsets[-1]
    return offsets.tolist()


async def run_load(
    target: Target,
    requests: list[SampleRequest],
    point: LoadPoint,
    *,
    seed: int = 0,
    clock: Clock = time.perf_counter,
    session=None,
    on_done: Callable[[RequestOutput], None] | None = None,
) -> tuple[list[RequestOutput], float]:
    """Send `requests` under `point`: (outputs in request order, duration in seconds).
    `session`: an aiohttp-like session to send through (tests pass an in-memory stub);
    default: a new `client.new_session`, closed at the end."""
    offsets = arrival_offsets_s(len(requests), point.request_rate, point.burstiness, seed)
    slots = (
        asyncio.Semaphore(point.max_concurrency)
        if point.max_concurrency
        else contextlib.nullcontext()
    )
    own_session = session is None
    session = session or new_session(point.max_concurrency)

    async def one(request: SampleRequest) -> RequestOutput:
        payload = build_payload(
            target.backend, target.model, request, target.ignore_eos, target.extra_body
        )
        async with slots:
            out = await send_request(
                session,
                target.api_url,
                target.backend,
                payload,
                target.headers,
                request.prompt_len,
                clock,
            )
        if on_done is not None:
            on_done(out)
        return out

    try:
        start = clock()
        tasks = []
        for request, offset_s in zip(requests, offsets):
            wait_s = start + offset_s - clock()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            tasks.append(asyncio.create_task(one(request)))
        outputs = await asyncio.gather(*tasks)
        duration_s = clock() - start
    finally:
        if own_session:
            await session.close()
    return list(outputs), duration_s
