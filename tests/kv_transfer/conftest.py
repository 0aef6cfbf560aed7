"""Fixtures for the kv_transfer conformance suite: a local Agent plus a peer behind one proxy
interface, so every test runs unchanged against both backends.

- inproc: the peer is a second Agent in this process.
- ucx: the peer is a separate process (`peer_proc.py`), as prefill and decode are in
  production; metadata crosses a pipe. Every process started here is killed at teardown.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from multiprocessing import Pipe
from pathlib import Path

import pytest
import torch

from kv_transfer import Agent

BLOCK_BYTES = [4096, 8192, 1024]  # three regions (think: K and V of layers) of 64 blocks each
NUM_BLOCKS = 64
REGION_BYTES = [b * NUM_BLOCKS for b in BLOCK_BYTES]
_PEER_SCRIPT = Path(__file__).with_name("peer_proc.py")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class InprocPeer:
    """The peer as an Agent in this process."""

    def __init__(self, name: str, region_bytes: list[int]) -> None:
        self.agent = Agent(name, "inproc")
        self.regions = [torch.zeros(n, dtype=torch.uint8) for n in region_bytes]
        self.agent.register_memory(self.regions)
        self.metadata = self.agent.get_agent_metadata()

    def region(self, i: int) -> torch.Tensor:
        return self.regions[i].clone()

    def set_region(self, i: int, data: torch.Tensor) -> None:
        self.regions[i].copy_(data)

    def notifs(self) -> dict[str, list[bytes]]:
        return self.agent.get_notifs()

    def await_notif(self, payload: bytes, progress=lambda: None, timeout_s: float = 5.0):
        progress()
        notifs = self.agent.get_notifs()
        assert any(payload in n for n in notifs.values()), notifs
        return notifs, [r.clone() for r in self.regions]

    def add_remote(self, metadata: bytes) -> str:
        return self.agent.add_remote_agent(metadata)

    def kill(self) -> None:
        self.agent.close()

    def close(self) -> None:
        self.agent.close()


class ProcPeer:
    """The peer as a separate process running `peer_proc.py` with a UCX agent."""

    def __init__(self, name: str, region_bytes: list[int], peer_error_handling: bool = False):
        self._conn, child_conn = Pipe()
        cmd = [
            sys.executable,
            str(_PEER_SCRIPT),
            "--fd",
            str(child_conn.fileno()),
            "--name",
            name,
            "--region-bytes",
            ",".join(map(str, region_bytes)),
        ]
        if peer_error_handling:
            cmd.append("--peer-error-handling")
        self.proc = subprocess.Popen(cmd, pass_fds=[child_conn.fileno()])
        child_conn.close()
        self.metadata = self._reply(timeout_s=60.0)

    def _reply(self, timeout_s: float):
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"peer process {self.proc.pid} did not answer in {timeout_s} s")
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"peer process failed:\n{value}")
        return value

    def call(self, cmd: str, *args, timeout_s: float = 20.0):
        self._conn.send((cmd, *args))
        return self._reply(timeout_s)

    def region(self, i: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.call("region", i)), dtype=torch.uint8)

    def set_region(self, i: int, data: torch.Tensor) -> None:
        self.call("set_region", i, data.numpy().tobytes())

    def notifs(self) -> dict[str, list[bytes]]:
        return self.call("notifs")

    def await_notif(self, payload: bytes, progress=lambda: None, timeout_s: float = 5.0):
        """Peer waits for `payload` and snapshots its regions the moment it arrives; meanwhile
        we run `progress` (the sender's agent must progress for its transfer to finish)."""
        self._conn.send(("await_notif", payload, timeout_s))
        deadline = time.monotonic() + timeout_s + 5.0
        while not self._conn.poll(0.0002) and time.monotonic() < deadline:
            progress()
        notifs, regions = self._reply(timeout_s=5.0)
        return notifs, [torch.frombuffer(bytearray(r), dtype=torch.uint8) for r in regions]

    def add_remote(self, metadata: bytes) -> str:
        return self.call("add_remote", metadata)

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.call("exit", timeout_s=5.0)
                self.proc.wait(timeout=5)
            except (TimeoutError, RuntimeError, OSError, subprocess.TimeoutExpired):
                pass  # a test left it stopped or broken: it is killed below either way
        self.kill()
        self._conn.close()


def make_peer(backend: str, name: str, region_bytes: list[int], **kw) -> InprocPeer | ProcPeer:
    if backend == "inproc":
        return InprocPeer(name, region_bytes)
    return ProcPeer(name, region_bytes, **kw)


@dataclass
class Pair:
    """A local agent (regions zeroed) and a peer that `local` knows as `remote`."""

    backend: str
    local: Agent
    regions: list[torch.Tensor]
    peer: InprocPeer | ProcPeer
    remote: str
    block_bytes: list[int]

    def close(self) -> None:
        try:
            self.peer.close()
        finally:
            self.local.close()


def make_pair(backend: str, **peer_kw) -> Pair:
    local = Agent(unique("local"), backend, **peer_kw)
    try:
        regions = [torch.zeros(n, dtype=torch.uint8) for n in REGION_BYTES]
        local.register_memory(regions)
        if backend == "inproc":
            peer: InprocPeer | ProcPeer = InprocPeer(unique("peer"), REGION_BYTES)
        else:
            peer = ProcPeer(unique("peer"), REGION_BYTES, **peer_kw)
    except BaseException:
        local.close()
        raise
    pair = Pair(backend, local, regions, peer, "", list(BLOCK_BYTES))
    try:
        pair.remote = local.add_remote_agent(peer.metadata)
    except BaseException:
        pair.close()
        raise
    return pair


@pytest.fixture(params=["inproc", "ucx"], scope="module")
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def _shared_pair(backend):
    pair = make_pair(backend)
    yield pair
    pair.close()


@pytest.fixture
def pair(_shared_pair: Pair) -> Pair:
    """The module's shared pair, both sides zeroed, no pending notifications."""
    for i, r in enumerate(_shared_pair.regions):
        r.zero_()
        _shared_pair.peer.set_region(i, torch.zeros_like(r))
    _shared_pair.peer.notifs()
    _shared_pair.local.get_notifs()
    return _shared_pair


def _pairs(backend: str):
    made: list[Pair] = []

    def make(**peer_kw) -> Pair:
        made.append(make_pair(backend, **peer_kw))
        return made[-1]

    yield make
    for pair in made:
        pair.close()


@pytest.fixture
def pair_factory(backend):
    """Pairs of their own, for tests that kill or stop the peer; all are closed at teardown."""
    yield from _pairs(backend)


@pytest.fixture
def ucx_pair_factory():
    yield from _pairs("ucx")
