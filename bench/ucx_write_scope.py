"""What UCX enforces about one-sided writes: can a peer that holds one rkey of ours write
outside the region it names, into memory we never registered?

Two processes: a victim registers a 1 MiB region (and keeps a second, unregistered 1 MiB
buffer); an attacker that received the victim's agent metadata (worker address + rkey, what a
decode hands a prefill) PUTs 4 KiB inside the region and 4 KiB into the unregistered buffer,
with the region's rkey. The victim then counts the bytes that changed in each. Run per UCX
transport set (default selection; tcp only; shared memory only).

    python -m bench.ucx_write_scope          # writes bench/results/ucx_write_scope-<date>.json

Measured 2026-11-30 (see docs/security.md for what follows): every transport wrote both, i.e.
the metadata is a capability over the whole process's memory, not a scoped key.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import torch

from bench.common import write_result

_REGION_BYTES = 1 << 20
_PUT_BYTES = 4096


def _victim(conn, tls: str) -> None:
    if tls:
        os.environ["UCX_TLS"] = tls
    from kv_transfer import Agent

    agent = Agent("victim", "ucx")
    region = torch.zeros(_REGION_BYTES, dtype=torch.uint8)
    unregistered = torch.zeros(_REGION_BYTES, dtype=torch.uint8)
    agent.register_memory([region])
    conn.send((agent.get_agent_metadata(), unregistered.data_ptr()))
    while not conn.poll(0.001):
        agent.progress()  # (only needed by transports that emulate RMA with messages)
    conn.recv()
    conn.send((int(region.count_nonzero()), int(unregistered.count_nonzero())))
    conn.recv()
    agent.close()


def run_one(tls: str) -> dict:
    if tls:
        os.environ["UCX_TLS"] = tls
    from kv_transfer import Agent
    from kv_transfer import ucp_ctypes as ucp

    here, there = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_victim, args=(there, tls))
    proc.start()
    metadata, unregistered_addr = here.recv()
    attacker = Agent("attacker", "ucx")
    src = torch.ones(_PUT_BYTES, dtype=torch.uint8)
    attacker.register_memory([src])
    peer = attacker._backend._peers[attacker.add_remote_agent(metadata)]
    statuses = {}
    for label, remote_addr in (
        ("inside_region", peer.meta.region_addrs[0]),
        ("unregistered", unregistered_addr),
    ):
        op = (src.data_ptr(), _PUT_BYTES, remote_addr, peer.rkeys[0])
        ucp.post_rma(True, peer.ep, [(*op, attacker._backend._memh_params[0])])
        req = ucp.ep_flush(peer.ep)
        deadline = time.monotonic() + 5
        while req is not None and ucp.request_status(req) == ucp.UCS_INPROGRESS:
            assert time.monotonic() < deadline, "flush did not complete"
            attacker.progress()
        statuses[label] = ucp.status_string(ucp.UCS_OK if req is None else ucp.request_status(req))
    here.send("count")
    inside, outside = here.recv()
    here.send("bye")
    proc.join(10)
    attacker.close()
    return {
        "put_status": statuses,
        "bytes_written_inside_region": inside,
        "bytes_written_unregistered": outside,
        "is_write_scoped_to_region": outside == 0,
    }


def main() -> None:
    import json
    import subprocess
    import sys

    results = {}
    for tls in ("", "tcp", "sm"):
        # A fresh interpreter per transport: UCX reads UCX_TLS once per process.
        code = (
            "import json; from bench.ucx_write_scope import run_one; "
            f"print(json.dumps(run_one({tls!r})))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        results[tls or "default"] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"UCX_TLS={tls or 'default'}: {results[tls or 'default']}", flush=True)
    path = write_result(
        "ucx_write_scope", {"region_bytes": _REGION_BYTES, "put_bytes": _PUT_BYTES}, results
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
