"""Rolling restarts and scaling lose nothing: under a bounded load (32 concurrent streaming
completions), every prefill and then every decode is restarted one by one (SIGTERM: drain,
exit 0, a replacement registers in Redis), and one instance of each pool is added and then
removed. Every request completes in full: no error, no truncated stream."""

from __future__ import annotations

import asyncio
import threading
import time

import openai
import redis

from engine.registry import INSTANCES_KEY
from tandem.launcher import Child, Cluster
from tests.redis_server import redis_server  # noqa: F401  (the fixture)

FLAGS = ["--max-model-len", "256", "--num-gpu-blocks-override", "128"]
CONCURRENCY = 32
MAX_TOKENS = 16


class Load:
    """CONCURRENCY clients sending streaming completions back to back until stopped; each
    result is checked for completeness."""

    def __init__(self, base_url: str, model: str):
        self.base_url, self.model = base_url, model
        self.completed, self.failures = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive(), "the load did not finish"

    async def _run(self) -> None:
        client = openai.AsyncOpenAI(base_url=self.base_url, api_key="k", max_retries=0)
        await asyncio.gather(*(self._client(client, i) for i in range(CONCURRENCY)))

    async def _client(self, client: openai.AsyncOpenAI, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            prompt = f"worker {worker} request {n}: " + "tell me more " * (n % 5)
            try:
                stream = await client.completions.create(
                    model=self.model,
                    prompt=prompt,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                    timeout=60,
                )
                finish, usage = None, None
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                    usage = chunk.usage or usage
                if finish != "length" or usage is None or usage.completion_tokens != MAX_TOKENS:
                    self.failures.append(f"truncated: finish={finish} usage={usage}")
                else:
                    self.completed += 1
            except Exception as e:  # every failure is recorded; the test fails on any
                self.failures.append(f"{type(e).__name__}: {e}")


def _registered(client: redis.Redis) -> int:
    return len(client.smembers(INSTANCES_KEY))


def _await(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_rolling_restarts_and_scaling_lose_no_request(
    tiny_llama_path,
    redis_server,  # noqa: F811
):
    model = str(tiny_llama_path)
    svc = [model, *FLAGS, "--redis-url", redis_server.url]
    registry = redis.Redis.from_url(redis_server.url)
    cluster = Cluster(log_prefix=False)
    try:
        pools: dict[str, list[Child]] = {
            "prefill": [cluster.start("prefill", svc) for _ in range(2)],
            "decode": [cluster.start("decode", svc) for _ in range(2)],
        }
        gateway = cluster.start(
            "gateway",
            [
                "--model",
                model,
                "--port",
                "0",
                "--max-model-len",
                "256",
                "--redis-url",
                redis_server.url,
            ],
        )
        _await(lambda: _registered(registry) == 4, 30, "4 registered instances")
        load = Load(f"http://{gateway.address}/v1", model)
        load.start()
        _await(lambda: load.completed >= CONCURRENCY, 120, "the load to run")

        def replace(role: str, old: Child) -> Child:
            done = load.completed
            old.proc.terminate()  # SIGTERM: drain
            assert old.proc.wait(90) == 0, f"{role} did not drain cleanly"
            new = cluster.start(role, svc)
            _await(lambda: _registered(registry) == 4, 30, f"the new {role} to register")
            _await(lambda: load.completed >= done + CONCURRENCY, 120, "requests after it")
            return new

        for role in ("prefill", "decode"):
            pools[role] = [replace(role, child) for child in pools[role]]
        for role in ("prefill", "decode"):  # scale out, then in
            extra = cluster.start(role, svc)
            _await(lambda: _registered(registry) == 5, 30, f"the extra {role}")
            target = load.completed + CONCURRENCY
            _await(lambda t=target: load.completed >= t, 120, "requests with it")
            extra.proc.terminate()
            assert extra.proc.wait(90) == 0
            _await(lambda: _registered(registry) == 4, 30, f"the extra {role} to leave")
        load.stop()
    finally:
        cluster.stop(timeout_s=30)
    assert load.failures == [], load.failures[:5]
    assert load.completed >= 7 * CONCURRENCY
