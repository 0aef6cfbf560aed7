"""`net_devices` keeps UCX's TCP listeners on the named devices (UCX_NET_DEVICES); without it
UCX listens on every interface, the external one included."""

from __future__ import annotations

import os
import socket
import uuid

import pytest

from kv_transfer import Agent
from tests.fixtures.sockets import is_loopback, listening_tcp


def _new_listeners(net_devices: str | None) -> list[tuple[str, int]]:
    before = set(listening_tcp(os.getpid()))
    agent = Agent(f"net-{uuid.uuid4().hex[:8]}", "ucx", net_devices=net_devices)
    try:
        return [s for s in listening_tcp(os.getpid()) if s not in before]
    finally:
        agent.close()


def _has_external_ipv4() -> bool:
    """Whether some non-loopback interface is up with a route (UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route lookup matters
        except OSError:
            return False
        return not is_loopback(s.getsockname()[0])


def test_loopback_agent_listens_on_loopback_only():
    new = _new_listeners("lo")
    assert new and all(is_loopback(address) for address, _ in new), new


def test_default_agent_listens_beyond_loopback():
    if not _has_external_ipv4():
        pytest.skip("this host has no network interface but lo")
    new = _new_listeners(None)
    assert any(not is_loopback(address) for address, _ in new), new
