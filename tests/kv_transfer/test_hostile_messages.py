"""Hostile or malformed messages on the UCX notification channel are dropped and counted.

A reviewer ended a decode's engine loop for good with one 11-byte message (valid magic,
non-UTF-8 sender name): `get_notifs` raised into the loop. Any peer that can reach the worker
can send such bytes, so the inbox must treat every message as untrusted input.
"""

from __future__ import annotations

import struct
import time

import pytest

from kv_transfer import Agent, ucp_ctypes
from kv_transfer.ucx_request import _MAGIC, _NOTIF_TAG, MAX_NOTIF_BYTES, NotifInbox
from tests.kv_transfer.conftest import unique


@pytest.fixture
def two_agents():
    target = Agent(unique("target"), "ucx")
    sender = Agent(unique("sender"), "ucx")
    try:
        sender.add_remote_agent(target.get_agent_metadata())
        yield target, sender
    finally:
        sender.close()
        target.close()


def send_raw(
    sender: Agent, remote: str, payload: bytes, tag: int = _NOTIF_TAG, also=lambda: None
) -> None:
    """Tag-send `payload` as is to the peer `remote` (bypassing the notification encoder), as
    any process holding the peer's worker address can; progress `also` (an in-process peer)."""
    ep = sender._backend._peers[remote].ep
    req = ucp_ctypes.tag_send(ep, payload, tag)
    deadline = time.monotonic() + 5.0
    while req is not None and ucp_ctypes.request_status(req) == ucp_ctypes.UCS_INPROGRESS:
        assert time.monotonic() < deadline, "raw send did not complete"
        sender.progress()
        also()
    if req is not None:
        ucp_ctypes.request_free(req)


def _send_raw(sender: Agent, target: Agent, payload: bytes, tag: int = _NOTIF_TAG) -> None:
    send_raw(sender, target.name, payload, tag, also=target.progress)


def _drain_until(target: Agent, num_rejected: int, want: bytes | None = None) -> list:
    got = []
    deadline = time.monotonic() + 5.0
    while target.num_rejected_messages < num_rejected or (
        want is not None and not any(want == p for _, p in got)
    ):
        assert time.monotonic() < deadline, (target.num_rejected_messages, got)
        got += [(s, p) for s, ps in target.get_notifs().items() for p in ps]
    return got


def test_malformed_messages_are_dropped_and_counted(two_agents):
    target, sender = two_agents
    hostile = [
        _MAGIC + struct.pack("<H", 5) + b"\xff\xfe\xfd\xfc\xfb",  # the reported 11 bytes
        b"XXXX" + struct.pack("<H", 1) + b"a:b",  # bad magic
        _MAGIC + struct.pack("<H", 200) + b"abc",  # name longer than the message
        _MAGIC,  # shorter than a header
        b"\x00" * (MAX_NOTIF_BYTES + 10),  # too long: received truncated
    ]
    for payload in hostile:
        _send_raw(sender, target, payload)
    _send_raw(sender, target, b"hello", tag=0x1234)  # a tag nobody receives
    _drain_until(target, len(hostile) + 1)
    assert target.num_rejected_messages == len(hostile) + 1
    # The channel still works afterwards: a well-formed notification arrives.
    _send_raw(sender, target, NotifInbox.encode(sender.name, b"tid:token"))
    got = _drain_until(target, len(hostile) + 1, want=b"tid:token")
    assert (sender.name, b"tid:token") in got
