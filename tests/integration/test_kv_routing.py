"""KV-aware routing with real processes and a real Redis: 2 prefill + 2 decode services
registering themselves (`--redis-url`, 0.2 s heartbeats), a gateway discovering them (in this
process, so the test can read its registry and counters). Routing quality against an oracle and
round robin, measured by the prefills' own prefix-cache counters; pools that change under load;
Redis dying and coming back."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
import time

import openai
import pytest
import redis.asyncio
import uvicorn

from engine.sampling_params import SamplingParams
from gateway.app import build_state, create_app
from gateway.config import GatewaySettings
from gateway.index import IndexTarget
from gateway.redis_index import RedisBlockIndex
from gateway.registry import StaticRegistry
from gateway.router import RoundRobinRouter
from tandem.launcher import Cluster
from tests.integration.services import collect, decode_stub, generate_request, get_load
from tests.integration.services import prefill_stub as p_stub
from tests.redis_server import RedisServer

FLAGS = ["--max-model-len", "256", "--num-gpu-blocks-override", "512", "--heartbeat-s", "0.2"]
TTL_S = 0.6  # 3 heartbeats
GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
NUM_CONVERSATIONS, NUM_TURNS = 6, 4


@contextlib.contextmanager
def serve(app):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    _wait(lambda: server.started, 10)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class KVCluster:
    def __init__(self, model: str, redis_server: RedisServer):
        self.model, self.redis = model, redis_server
        self.cluster = Cluster(log_prefix=False)
        self.state = None  # the in-process gateway's, once it runs
        self.url = ""
        self.prefills = [self.start("prefill") for _ in range(2)]
        self.decodes = [self.start("decode") for _ in range(2)]

    def start(self, role: str):
        extra = ["--no-enable-prefix-caching"] if role == "decode" else []  # P hits only
        return self.cluster.start(role, [self.model, *FLAGS, *extra, "--redis-url", self.redis.url])

    def client(self) -> openai.AsyncOpenAI:
        """One per event loop (httpx pools are bound to the loop that made them)."""
        return openai.AsyncOpenAI(base_url=self.url, api_key="x", max_retries=0, timeout=30)

    def loads(self, children, stub):
        return asyncio.run(aloads(children, stub))


async def aloads(children, stub) -> list:
    return [await get_load(stub(c.address)) for c in children]


@pytest.fixture(scope="module")
def kv(tiny_qwen3_path, tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    c = None
    try:
        c = KVCluster(str(tiny_qwen3_path), server)
        # Remote prefill only: the policies compared here place prompts on prefills. Under
        # "auto" a loaded machine can make a decode's local prefill look cheaper; that prompt
        # is then cached at no prefill, and the round cannot settle. The likely cause (not
        # observed) of one failure in a clean-clone run beside a CPU-bound job.
        settings = GatewaySettings(
            model=c.model,
            max_model_len=256,
            redis_url=server.url,
            registry_refresh_s=0.1,
            prefill_policy="remote",
        )
        c.state = build_state(settings)
        with serve(create_app(settings, c.state)) as c.url:
            _wait(lambda: len(c.state.registry.prefills()) == 2, 5)
            yield c
    finally:
        if c is not None:
            c.cluster.stop()
        server.kill()


def _wait(check, timeout_s: float, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s} s"
        time.sleep(0.05)


def conversations(seed: int) -> list[list[list[int]]]:
    """Per conversation, the prompt of each turn: the whole history resent, growing."""
    rng = random.Random(seed)
    out = []
    for _ in range(NUM_CONVERSATIONS):
        history, turns = [], []
        for turn in range(NUM_TURNS):
            if turn:
                history += [rng.randrange(3, 2000) for _ in range(10)]  # the assistant's reply
            history += [rng.randrange(3, 2000) for _ in range(30 if turn else 40)]  # the user
            turns.append(list(history))
        out.append(turns)
    return out


def hit_rate(kv: KVCluster, run) -> float:
    before = kv.loads(kv.prefills, p_stub)
    run()
    after = kv.loads(kv.prefills, p_stub)
    hits = sum(a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before))
    queries = sum(a.prefix_cache_queries - b.prefix_cache_queries for a, b in zip(after, before))
    return hits / queries


def play(kv: KVCluster, workload, send_round) -> None:
    """Turn by turn, each round's conversations in a shuffled order, sent concurrently; the next
    turn starts once the round has settled (the user reads the answer meanwhile)."""
    rng = random.Random(7)
    for turn in range(NUM_TURNS):
        order = rng.sample(range(NUM_CONVERSATIONS), NUM_CONVERSATIONS)
        batch = [(c, workload[c][turn]) for c in order]
        asyncio.run(send_round(batch))
        settle(kv, [prompt for _, prompt in batch], time.time())


def settle(kv: KVCluster, prompts: list[list[int]], done_s: float) -> None:
    """Wait until every prompt's blocks are in the index at some prefill, and every prefill
    reported itself idle in a snapshot taken after `done_s` (wall clock): the gateway then counts
    none of the round as pending work, and routes the next turn on what the round cached."""
    registry = kv.state.registry
    margin_s = kv.state.router.pending.margin_s

    def indexed() -> bool:
        counts = asyncio.run(index_lookups(kv, prompts))
        return all(n == (len(p) - 1) // 16 for p, n in zip(prompts, counts))

    def reported_idle() -> bool:
        statuses = [registry.status(p) for p in registry.prefills()]
        return all(
            s is not None and s.as_of_s > done_s + margin_s and s.num_outstanding == 0
            for s in statuses
        )

    # Bounds for a loaded machine (events and reports arrive within tens of ms when it is quiet).
    _wait(indexed, 30, "every prompt of the round in the index at some prefill")
    _wait(reported_idle, 30, "an idle load report from every prefill after the round")


async def index_lookups(kv: KVCluster, prompts: list[list[int]]) -> list[int]:
    """Per prompt, the most leading blocks any prefill holds."""
    index = RedisBlockIndex(redis.asyncio.Redis.from_url(kv.redis.url))
    targets = [IndexTarget(p.instance_id, p.epoch, 16) for p in kv.state.registry.prefills()]
    try:
        return [max((await index.lookup(p, None, targets)).values(), default=0) for p in prompts]
    finally:
        await index.close()


def test_kv_routing_reaches_the_oracles_hit_rate(kv):
    p_addrs = [p.address for p in kv.prefills]
    d_addr = kv.decodes[0].address

    def direct(choose):  # call D with the prefill a policy chose, as the gateway would
        async def send_round(batch):
            stub = decode_stub(d_addr)
            # D is registered in Redis: like the gateway, name each prefill with its sealed record.
            sealed = {p.address: p.registration for p in kv.state.registry.prefills()}
            reqs = []
            for c, prompt in batch:
                address = await choose(c)
                req = generate_request(f"{time.monotonic_ns()}-{c}", prompt, GREEDY, [address])
                req.prefill[0].registration = sealed[address]
                reqs.append(req)
            results = await asyncio.gather(*(collect(stub, r) for r in reqs))
            assert all(final is not None for _, final, _ in results)

        return send_round

    async def via_gateway(batch):
        kw = dict(model=kv.model, max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
        async with kv.client() as client:
            await asyncio.gather(*(client.completions.create(prompt=p, **kw) for _, p in batch))

    async def oracle(c: int) -> str:  # conversation c lives on one prefill, from its first turn
        return p_addrs[c % 2]

    rr = RoundRobinRouter(StaticRegistry([d_addr], p_addrs))

    async def round_robin(c: int) -> str:
        return (await rr.plan([]))[0].prefills[0].address

    rates = {
        "oracle": hit_rate(kv, lambda: play(kv, conversations(1), direct(oracle))),
        "round_robin": hit_rate(kv, lambda: play(kv, conversations(2), direct(round_robin))),
        "kv": hit_rate(kv, lambda: play(kv, conversations(3), via_gateway)),
    }
    print(f"prefix-cache hit rates: {rates}; decisions {kv.state.router.stats}")
    assert rates["kv"] >= 0.9 * rates["oracle"], rates
    assert rates["kv"] >= rates["round_robin"] + 0.1, rates
    assert kv.state.router.stats.route_decisions["cache_hit"] >= 12


def test_pool_grows_and_shrinks_without_a_gateway_restart(kv):
    registry, router = kv.state.registry, kv.state.router
    d3 = kv.start("decode")
    _wait(lambda: len(registry.decodes()) == 3, 2)

    async def burst(n: int):
        kw = dict(model=kv.model, max_tokens=2, temperature=0)
        async with kv.client() as client:
            calls = (client.completions.create(prompt=[5, i], **kw) for i in range(n))
            await asyncio.gather(*calls)

    asyncio.run(burst(9))
    (load,) = kv.loads([d3], decode_stub)
    assert load.num_requests_total > 0, "the new decode got traffic"

    planned = []
    plan = router.plan

    async def spy(*args):
        routes = await plan(*args)
        planned.append({r.decode.address for r in routes})
        return routes

    router.plan = spy

    first_chunk = asyncio.Event()  # past it the stream is mid-stream: a kill is an error

    async def long_stream():
        async with kv.client() as client:
            stream = await client.completions.create(
                model=kv.model,
                prompt=[7, 8, 9],
                max_tokens=200,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for _ in stream:
                first_chunk.set()

    async def running_decode(task, timeout_s: float = 10.0):
        """The decode that runs the stream, as soon as one does."""
        deadline = time.monotonic() + timeout_s
        while True:
            loads = await aloads(kv.decodes + [d3], decode_stub)
            busy = [c for c, ld in zip(kv.decodes + [d3], loads) if ld.num_running]
            if busy:
                return busy[0]
            assert not task.done() and time.monotonic() < deadline, "the stream never ran"
            await asyncio.sleep(0.02)

    async def kill_mid_stream():
        task = asyncio.ensure_future(long_stream())
        await asyncio.wait_for(first_chunk.wait(), 10)  # before it, D's death is retried
        victim = await running_decode(task)
        victim.proc.kill()
        with pytest.raises(openai.APIError):  # a clean error event, not a hang
            await task
        return victim

    victim = asyncio.run(kill_mid_stream())
    t_killed = time.monotonic()
    _wait(lambda: victim.address not in {d.address for d in registry.decodes()}, 2)
    assert time.monotonic() - t_killed < TTL_S + 1.0  # TTL + registry refresh + slack
    planned.clear()
    asyncio.run(burst(8))  # every request succeeds (gather raises otherwise) ...
    assert planned and all(victim.address not in p for p in planned)  # ... none routed to it
    router.plan = plan
    kv.decodes = [c for c in kv.decodes + [d3] if c is not victim]


def test_redis_dies_and_comes_back(kv):
    router = kv.state.router
    prompt = list(range(500, 700))

    async def ask(n=1):
        kw = dict(model=kv.model, max_tokens=2, temperature=0)
        async with kv.client() as client:
            calls = (client.completions.create(prompt=prompt, **kw) for _ in range(n))
            await asyncio.gather(*calls)

    asyncio.run(ask())
    kv.redis.kill()
    before = router.stats.route_decisions["degraded"]
    asyncio.run(ask(4))  # degraded routing: still served
    assert router.is_degraded and router.stats.route_decisions["degraded"] > before
    # The registry saw Redis gone too, so its coming back is a recovery (not a first read).
    _wait(lambda: not kv.state.registry.is_available, 2)
    kv.redis.start()  # empty: the services re-publish their registrations and caches

    async def lookup():
        index = RedisBlockIndex(redis.asyncio.Redis.from_url(kv.redis.url))
        targets = [IndexTarget(p.instance_id, p.epoch, 16) for p in kv.state.registry.prefills()]
        try:
            return await index.lookup(prompt, None, targets)
        finally:
            await index.close()

    _wait(lambda: max(asyncio.run(lookup()).values(), default=0) == (len(prompt) - 1) // 16, 5)
    _wait(lambda: not router.is_degraded, 2)
    before = router.stats.route_decisions["cache_hit"]
    asyncio.run(ask())
    assert router.stats.route_decisions["cache_hit"] == before + 1
