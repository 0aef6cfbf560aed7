"""A real `redis-server` for tests: loopback only, no persistence, killable mid-test.

Use the `redis_server` fixture (a fresh server per test: it starts in milliseconds, so no
state leaks between tests) and `redis_server.url`; `kill()` stops it the way a crash would
(SIGKILL) and `start()` brings it back on the same port, empty, as a restarted Redis comes back.

    from tests.redis_server import redis_server  # noqa: F401  (registers the fixture)

Tests are skipped when `redis-server` is not installed (scripts/test.sh installs it).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None):
        self.workdir, self.port = workdir, port or _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        assert self.proc is None, "already running"
        binary = shutil.which("redis-server")
        assert binary is not None
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        args += ["--protected-mode", "yes", "--loglevel", "warning"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while not self.is_up():
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                self.proc = None
                raise RuntimeError(f"redis-server exited: {err}")
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.01)

    def is_up(self) -> bool:
        """PING over a raw socket (no client library state to reset between restarts)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown handshake, clients see refused connections."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            if self.proc.stderr:
                self.proc.stderr.close()
            self.proc = None


@pytest.fixture
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.kill()
