"""Fixtures: the real offline engine behind fake decodes, and the gateway served by uvicorn.

One engine, two fake decodes and one gateway are shared by the module's tests (startup costs
seconds); `reset_fakes` puts the fakes' knobs back before each test. Tests that need their own
topology (unreachable instances, a refusing pool) start an extra gateway with `gateway_for`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import openai
import pytest
import uvicorn

from engine import LLM
from gateway.app import build_state, create_app
from gateway.config import GatewaySettings
from gateway.model_info import load_model_info
from tests.gateway.fake_decode import FakeDecode, start_fake_decode

MAX_MODEL_LEN = 256
SERVED_NAME = "tiny-qwen3"


class LockedLLM:
    """The one offline engine, shared by tests and the fakes' server threads: `LLM` is
    single-threaded, so every `generate`/`chat` holds the lock (a fake may still be generating
    for the previous test when the next one starts)."""

    def __init__(self, llm: LLM):
        self._llm, self.lock = llm, threading.Lock()

    def generate(self, *args, **kwargs):
        with self.lock:
            return self._llm.generate(*args, **kwargs)

    def chat(self, *args, **kwargs):
        with self.lock:
            return self._llm.chat(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._llm, name)


@pytest.fixture(scope="session")
def llm(tiny_qwen3_path) -> LockedLLM:
    return LockedLLM(LLM(str(tiny_qwen3_path), max_model_len=MAX_MODEL_LEN))


@pytest.fixture(scope="session")
def fakes(llm) -> Iterator[list[tuple[FakeDecode, str]]]:
    started = [start_fake_decode(llm, threading.Lock()) for _ in range(2)]
    yield [(servicer, address) for _, servicer, address in started]
    for server, _, _ in started:
        server.stop(grace=None)


@pytest.fixture(autouse=True)
def reset_fakes(fakes) -> None:
    for servicer, _ in fakes:
        servicer.reset()


@pytest.fixture(scope="session")
def model_info(tiny_qwen3_path):
    settings = GatewaySettings(
        model=str(tiny_qwen3_path), served_model_name=[SERVED_NAME], max_model_len=MAX_MODEL_LEN
    )
    return load_model_info(settings)


@contextlib.contextmanager
def serve(app) -> Iterator[str]:
    """Run `app` with uvicorn in a thread on a free loopback port; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "gateway did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="session")
def gateway_for(tiny_qwen3_path, model_info):
    """`with gateway_for(decode=[...]) as url:` — a gateway over the given instances."""

    @contextlib.contextmanager
    def start(**overrides) -> Iterator[str]:
        settings = GatewaySettings(
            model=str(tiny_qwen3_path),
            served_model_name=[SERVED_NAME],
            max_model_len=MAX_MODEL_LEN,
            **overrides,
        )
        with serve(create_app(settings, build_state(settings, model=model_info))) as url:
            yield url

    return start


@pytest.fixture(scope="session")
def gateway_url(gateway_for, fakes) -> Iterator[str]:
    with gateway_for(decode=[fakes[0][1]]) as url:
        yield url


@pytest.fixture
def fake(fakes) -> FakeDecode:
    """The decode behind `gateway_url`."""
    return fakes[0][0]


@pytest.fixture
def client(gateway_url) -> openai.OpenAI:
    # No SDK retries: a 503 must surface, not be retried behind the test's back.
    return openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="x", max_retries=0, timeout=30)
