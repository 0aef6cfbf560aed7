"""What UCX enforces about one-sided writes: can a peer that holds one rkey of ours write
outside the region it names?

Two processes: a victim registers one 1 MiB region and keeps two buffers it never registered:
a neighbour allocated right after the region (on CUDA: likely in the same caching-allocator
segment) and a separate 64 MiB allocation. An attacker that received the victim's agent
metadata (worker address + rkeys: what a decode hands a prefill) PUTs 4 KiB into each target
with the region's rkey, one target per attacker process (a crash is a result too). The victim
then counts the bytes that changed. Run per UCX transport set on the CPU (default selection,
tcp only, shared memory only) and, with `--device cuda`, on GPU memory (cuda_ipc).

    python -m bench.ucx_write_scope [--device cuda]   # bench/results/ucx_write_scope*-<date>.json

Measured 2026-11-30 on the CPU (see docs/security.md for what follows): every transport wrote
every target, i.e. the metadata is a capability over the whole process's memory.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import torch

from bench.common import write_result

_REGION_BYTES = 1 << 20
_SEPARATE_BYTES = 64 << 20
_PUT_BYTES = 4096
TARGETS = ("inside_region", "neighbour", "separate_allocation")


def _victim(conn, tls: str, device: str) -> None:
    if tls:
        os.environ["UCX_TLS"] = tls
    from kv_transfer import Agent

    agent = Agent("victim", "ucx")
    region = torch.zeros(_REGION_BYTES, dtype=torch.uint8, device=device)
    neighbour = torch.zeros(_REGION_BYTES, dtype=torch.uint8, device=device)
    separate = torch.zeros(_SEPARATE_BYTES, dtype=torch.uint8, device=device)
    agent.register_memory([region])
    addrs = dict(zip(TARGETS, (region.data_ptr(), neighbour.data_ptr(), separate.data_ptr())))
    conn.send((agent.get_agent_metadata(), addrs))
    while True:
        while not conn.poll(0.001):
            agent.progress()  # (only needed by transports that emulate RMA with messages)
        if conn.recv() == "bye":
            break
        counts = [int(t.count_nonzero()) for t in (region, neighbour, separate)]
        conn.send(dict(zip(TARGETS, counts)))
    agent.close()


def attack_one(metadata: bytes, remote_addr: int, tls: str, device: str) -> str:
    """PUT 4 KiB at `remote_addr` with region 0's rkey; the flush's status."""
    if tls:
        os.environ["UCX_TLS"] = tls
    from kv_transfer import Agent
    from kv_transfer import ucp_ctypes as ucp

    attacker = Agent(f"attacker-{os.getpid()}", "ucx")
    src = torch.ones(_PUT_BYTES, dtype=torch.uint8, device=device)
    attacker.register_memory([src])
    peer = attacker._backend._peers[attacker.add_remote_agent(metadata)]
    op = (src.data_ptr(), _PUT_BYTES, remote_addr, peer.rkeys[0])
    try:
        ucp.post_rma(True, peer.ep, [(*op, attacker._backend._memh_params[0])])
        req = ucp.ep_flush(peer.ep)
    except ucp.UcxError as e:
        return f"refused: {e}"
    deadline = time.monotonic() + 5
    while req is not None and ucp.request_status(req) == ucp.UCS_INPROGRESS:
        if time.monotonic() > deadline:
            return "flush did not complete in 5 s"
        attacker.progress()
    return ucp.status_string(ucp.UCS_OK if req is None else ucp.request_status(req))


def run_one(tls: str, device: str) -> dict:
    here, there = mp.Pipe()
    victim = mp.get_context("spawn").Process(target=_victim, args=(there, tls, device))
    victim.start()
    metadata, addrs = here.recv()
    statuses = {}
    for target in TARGETS:  # each attempt in its own process: a crash must not hide the rest
        code = (
            "import sys; from bench.ucx_write_scope import attack_one; "
            "print(attack_one(bytes.fromhex(sys.argv[1]), int(sys.argv[2]), sys.argv[3], "
            "sys.argv[4]))"
        )
        args = [sys.executable, "-c", code, metadata.hex(), str(addrs[target]), tls, device]
        out = subprocess.run(args, capture_output=True, text=True, timeout=120)
        lines = out.stdout.strip().splitlines()
        statuses[target] = (
            lines[-1]
            if out.returncode == 0 and lines
            else (f"attacker exited {out.returncode}: {out.stderr.strip().splitlines()[-1:]}")
        )
    here.send("count")
    written = here.recv()
    here.send("bye")
    victim.join(10)
    return {
        "put_status": statuses,
        "bytes_written": written,
        "is_write_scoped_to_region": written["neighbour"] == written["separate_allocation"] == 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    transports = ("", "tcp", "sm") if args.device == "cpu" else ("",)
    results = {}
    for tls in transports:
        results[tls or "default"] = run_one(tls, args.device)
        print(f"UCX_TLS={tls or 'default'}: {json.dumps(results[tls or 'default'])}", flush=True)
    name = "ucx_write_scope" if args.device == "cpu" else "ucx_write_scope_gpu"
    config = {"device": args.device, "region_bytes": _REGION_BYTES, "put_bytes": _PUT_BYTES}
    if args.device == "cuda":
        config["gpu"] = torch.cuda.get_device_name()
    print(f"wrote {write_result(name, config, results)}")


if __name__ == "__main__":
    main()
