"""UCX-only behaviour: one-sidedness and the two ways a dead or hung peer is noticed.

Endpoint error handling off (default): RMA goes over cma and needs no CPU on the peer, so a
stopped peer does not delay a WRITE. With `peer_error_handling=True`, RMA is emulated over
shared-memory messages, so a stopped peer stalls the transfer, and `wait(timeout_s)` must end it.
"""

from __future__ import annotations

import time

import pytest
import torch

from kv_transfer import Agent, paired_block_descs


def test_write_needs_no_peer_cpu(ucx_pair_factory):
    pair = ucx_pair_factory()
    pair.regions[0].copy_(torch.arange(pair.regions[0].numel()) % 251)
    local, remote = paired_block_descs(list(range(64)), list(range(64)), pair.block_bytes, [0])
    pair.peer.stop()  # SIGSTOP: the peer cannot run a single instruction
    assert pair.local.write(local, pair.remote, remote).wait(5.0) == "DONE"
    pair.peer.cont()
    assert torch.equal(pair.peer.region(0), pair.regions[0])


def test_hung_peer_times_out_with_error_handling(ucx_pair_factory):
    pair = ucx_pair_factory(peer_error_handling=True)
    local, remote = paired_block_descs([0, 1, 2], [3, 4, 5], pair.block_bytes)
    assert pair.local.write(local, pair.remote, remote).wait(10.0) == "DONE"  # warm up
    pair.peer.stop()
    start = time.monotonic()
    handle = pair.local.write(local, pair.remote, remote, notif=b"late")
    assert handle.wait(0.5) == "ERR"
    assert time.monotonic() - start < 1.0
    assert "timed out after 0.5 s" in handle.error
    assert handle.poll() == "ERR"  # sticky
    pair.peer.kill()  # now dead: the next transfer fails at once
    assert pair.local.write(local, pair.remote, remote).wait(2.0) == "ERR"


def test_peer_killed_mid_transfer_with_error_handling(ucx_pair_factory):
    pair = ucx_pair_factory(peer_error_handling=True)
    local, remote = paired_block_descs(list(range(64)), list(range(64)), pair.block_bytes)
    pair.peer.stop()  # keep the transfer in flight
    handle = pair.local.write(local, pair.remote, remote)
    assert handle.poll() == "PROC"
    pair.peer.kill()
    start = time.monotonic()
    assert handle.wait(5.0) == "ERR"
    assert time.monotonic() - start < 3.0
    assert "exited" in handle.error, handle.error


def test_metadata_of_another_backend_is_refused(ucx_pair_factory):
    pair = ucx_pair_factory()
    inproc = Agent("inproc-x", "inproc")
    try:
        with pytest.raises(ValueError, match="uses backend 'ucx'"):
            inproc.add_remote_agent(pair.peer.metadata)
        with pytest.raises(ValueError, match="uses backend 'inproc'"):
            pair.local.add_remote_agent(inproc.get_agent_metadata())
    finally:
        inproc.close()
