"""One conformance suite for every kv_transfer backend (fixtures in conftest.py).

For "ucx" the peer is a separate process; for "inproc" an agent in this process. Each test
states one part of the backend contract (kv_transfer/backend.py).
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from kv_transfer import Desc, block_descs, block_runs, paired_block_descs

WAIT_S = 10.0


def _random_fill(regions: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    for r in regions:
        r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=gen))
    return regions


def _blocks(region: torch.Tensor, block_bytes: int, ids: list[int]) -> list[bytes]:
    return [region[b * block_bytes : (b + 1) * block_bytes].numpy().tobytes() for b in ids]


def _pick_ids(seed: int, n: int = 24) -> tuple[list[int], list[int]]:
    """Scattered distinct ids plus one jointly consecutive run, so coalescing has work."""
    rng = random.Random(seed)
    local = [10, 11, 12, 13] + rng.sample([b for b in range(64) if not 10 <= b <= 13], n - 4)
    remote = [40, 41, 42, 43] + rng.sample([b for b in range(64) if not 40 <= b <= 43], n - 4)
    return local, remote


def test_coalescing_exact_counts():
    assert block_runs([1, 2, 3, 7, 8, 10], [1, 2, 3, 7, 8, 10]) == [
        (1, 1, 3),
        (7, 7, 2),
        (10, 10, 1),
    ]
    descs = block_descs([1, 2, 3, 7, 8, 10], block_bytes=[4096, 512])
    assert descs == [
        Desc(0, 4096, 3 * 4096), Desc(0, 7 * 4096, 2 * 4096), Desc(0, 10 * 4096, 4096),
        Desc(1, 512, 3 * 512), Desc(1, 7 * 512, 2 * 512), Desc(1, 10 * 512, 512),
    ]  # fmt: skip
    # Joint coalescing: merge only where both sides are consecutive.
    local, remote = paired_block_descs([1, 2, 3, 4], [5, 6, 9, 10], [100])
    assert local == [Desc(0, 100, 200), Desc(0, 300, 200)]
    assert remote == [Desc(0, 500, 200), Desc(0, 900, 200)]
    # Order of pairs does not matter; one region can be selected (layer-by-layer sends).
    local, remote = paired_block_descs([3, 1, 2], [9, 7, 8], [10, 20], regions=[1])
    assert (local, remote) == ([Desc(1, 20, 60)], [Desc(1, 140, 60)])
    assert len(block_descs(list(range(32)), [1] * 4)) == 4  # 32 blocks x 4 regions -> 4
    with pytest.raises(ValueError, match="differ in length"):
        paired_block_descs([1, 2], [1], [10])


def _transfer_and_verify(pair, op: str, seed: int) -> None:
    local_ids, remote_ids = _pick_ids(seed)
    local_descs, remote_descs = paired_block_descs(local_ids, remote_ids, pair.block_bytes)
    assert len(local_descs) < len(local_ids) * len(pair.block_bytes)  # coalescing happened
    src = _random_fill([torch.empty_like(r) for r in pair.regions], seed)
    if op == "WRITE":
        for r, s in zip(pair.regions, src):
            r.copy_(s)
        handle = pair.local.write(local_descs, pair.remote, remote_descs, notif=b"w")
    else:
        for i, s in enumerate(src):
            pair.peer.set_region(i, s)
        handle = pair.local.read(local_descs, pair.remote, remote_descs, notif=b"r")
    assert handle.wait(WAIT_S) == "DONE", handle.error
    assert handle.num_descs == len(local_descs)
    for i, bb in enumerate(pair.block_bytes):
        dst = pair.peer.region(i) if op == "WRITE" else pair.regions[i]
        dst_ids = remote_ids if op == "WRITE" else local_ids
        src_ids = local_ids if op == "WRITE" else remote_ids
        assert _blocks(dst, bb, dst_ids) == _blocks(src[i], bb, src_ids), f"region {i}"
        untouched = [b for b in range(64) if b not in dst_ids]
        assert all(blk == bytes(bb) for blk in _blocks(dst, bb, untouched)), f"region {i}"


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_scattered_blocks_bytes_verified(pair, op):
    _transfer_and_verify(pair, op, seed=1 if op == "WRITE" else 2)


def test_concurrent_transfers(pair):
    """Eight WRITEs to disjoint blocks in flight at once, then all waited for."""
    src = _random_fill(pair.regions, seed=3)
    handles = []
    for k in range(8):
        ids = list(range(k * 8, k * 8 + 8))
        remote_ids = [63 - i for i in ids]  # reversed: nothing coalesces on the remote side
        local, remote = paired_block_descs(ids, remote_ids, pair.block_bytes)
        handles.append(pair.local.write(local, pair.remote, remote, notif=f"t{k}".encode()))
    assert [h.wait(WAIT_S) for h in handles] == ["DONE"] * 8, [h.error for h in handles]
    for i, bb in enumerate(pair.block_bytes):
        assert _blocks(pair.peer.region(i), bb, [63 - b for b in range(64)]) == _blocks(
            src[i], bb, list(range(64))
        )
    _, _ = pair.peer.await_notif(b"t7")


def test_notification_after_data(pair):
    """When the peer sees the notification, the bytes are already in its memory."""
    src = _random_fill(pair.regions, seed=4)
    local, remote = paired_block_descs(list(range(64)), list(range(64)), pair.block_bytes)
    handle = pair.local.write(local, pair.remote, remote, notif=b"transfer_id=42")
    notifs, snapshot = pair.peer.await_notif(b"transfer_id=42", progress=pair.local.progress)
    assert notifs == {pair.local.name: [b"transfer_id=42"]}
    assert [s.numpy().tobytes() for s in snapshot] == [s.numpy().tobytes() for s in src]
    assert handle.wait(WAIT_S) == "DONE"
    # A READ's notification tells the peer its blocks were read (and may be freed).
    h = pair.local.read(local[:1], pair.remote, remote[:1], notif=b"read-done")
    assert h.wait(WAIT_S) == "DONE", h.error
    assert pair.peer.await_notif(b"read-done")[0] == {pair.local.name: [b"read-done"]}


def test_bad_input_raises(pair):
    ok = Desc(0, 0, 4096)
    cases = [
        ([Desc(3, 0, 16)], [ok], "region 3 out of range"),
        ([ok], [Desc(0, 64 * 4096 - 8, 16)], "exceeds region 0"),
        ([Desc(0, -1, 16)], [Desc(0, 0, 16)], "bad offset"),
        ([Desc(0, 0, 0)], [Desc(0, 0, 0)], "bad offset/length"),
        ([ok], [Desc(0, 0, 2048)], "local length 4096 != remote length 2048"),
        ([ok, ok], [ok], "2 local descriptors vs 1 remote"),
        ([("a", 0, 1)], [ok], "expected \\(region, offset_bytes, length_bytes\\)"),
    ]
    for local, remote, msg in cases:
        for op in (pair.local.write, pair.local.read):
            with pytest.raises(ValueError, match=msg):
                op(local, pair.remote, remote)
    with pytest.raises(ValueError, match="unknown remote agent 'nobody'"):
        pair.local.write([ok], "nobody", [ok])
    with pytest.raises(ValueError, match="notif must be bytes"):
        pair.local.write([ok], pair.remote, [ok], notif="text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="contiguous"):
        pair.local.register_memory([torch.zeros(4, 4).t()])
    with pytest.raises(ValueError, match="malformed agent metadata"):
        pair.local.add_remote_agent(b"{}")


def test_dead_peer_ends_in_err_not_hang(pair_factory):
    pair = pair_factory()
    local, remote = paired_block_descs([1, 2], [3, 4], pair.block_bytes)
    assert pair.local.write(local, pair.remote, remote).wait(WAIT_S) == "DONE"
    pair.peer.kill()
    start = time.monotonic()
    handle = pair.local.write(local, pair.remote, remote, notif=b"never")
    assert handle.wait(2.0) == "ERR"
    assert time.monotonic() - start < 2.5
    assert "gone" in handle.error or "exited" in handle.error, handle.error
    assert pair.local.read(local, pair.remote, remote).wait(2.0) == "ERR"  # stays dead
    pair.local.remove_remote_agent(pair.remote)
    with pytest.raises(ValueError, match="unknown remote agent"):
        pair.local.write(local, pair.remote, remote)


def test_mark_peer_dead(pair_factory):
    """The control plane's verdict: in-flight and later transfers end in ERR at once."""
    pair = pair_factory()
    local, remote = paired_block_descs([5], [6], pair.block_bytes)
    pair.local.mark_peer_dead(pair.remote, reason="heartbeat lost")
    handle = pair.local.write(local, pair.remote, remote)
    assert handle.poll() == "ERR" and handle.error == "heartbeat lost"
    # Re-adding the peer (fresh metadata, e.g. after a restart) revives it.
    pair.local.add_remote_agent(pair.peer.metadata)
    assert pair.local.write(local, pair.remote, remote).wait(WAIT_S) == "DONE"
