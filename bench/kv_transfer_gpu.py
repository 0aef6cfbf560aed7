"""UCX one-sided WRITE between two processes on one GPU (cuda_ipc), GPU memory to GPU memory.

Reports GB/s (bytes moved / s) per descriptor size against the device-to-device copy measured
in the same run (counted both ways: bytes moved, and read + write as FACTS.md's ceiling).

    python -m bench.kv_transfer_gpu --out-dir DIR
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import torch

from bench.common import write_result

TOTAL = 1 << 30


def peer(conn) -> None:
    from kv_transfer import Agent

    buf = torch.zeros(TOTAL, dtype=torch.uint8, device="cuda")
    agent = Agent("peer", "ucx")
    agent.register_memory([buf])
    conn.send(agent.get_agent_metadata())
    while True:
        msg = conn.recv()
        agent.progress()
        if msg == "stop":
            break
        if msg == "check":
            conn.send(int(buf[:16].sum().item()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    from kv_transfer import Agent, Desc

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=peer, args=(child,), daemon=True)
    proc.start()
    src = torch.full((TOTAL,), 7, dtype=torch.uint8, device="cuda")
    agent = Agent("initiator", "ucx")
    agent.register_memory([src])
    remote = agent.add_remote_agent(parent.recv())
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    copy_moved = TOTAL * 10 / (time.perf_counter() - t) / 1e9
    del dst
    rows = []
    for total in (256 << 20, 1 << 30):
        for desc in (1 << 20, 16 << 20, 256 << 20):
            if desc > total:
                continue
            descs = [Desc(0, o, desc) for o in range(0, total, desc)]
            times = []
            for _ in range(4):
                t = time.perf_counter()
                h = agent.write(descs, remote, descs)
                assert h.wait(60) == "DONE", h.error
                times.append(time.perf_counter() - t)
            gbs = total / statistics.median(times[1:]) / 1e9
            rows.append(
                {
                    "total_MiB": total >> 20,
                    "desc_MiB": desc >> 20,
                    "GBps": gbs,
                    "of_copy_moved": gbs / copy_moved,
                    "of_copy_read_plus_write": gbs / (2 * copy_moved),
                }
            )
            print(rows[-1], flush=True)
    parent.send("check")
    assert parent.recv() == 16 * 7, "bytes did not land"
    parent.send("stop")
    proc.join(10)
    figures = {
        "device_copy_moved_GBps": copy_moved,
        "device_copy_read_plus_write_GBps": 2 * copy_moved,
        "write": rows,
    }
    if args.out_dir:
        write_result(
            "kv_transfer_gpu",
            {"backend": "ucx", "same_gpu": True},
            figures,
            results_dir=Path(args.out_dir),
        )
    best = max(r["GBps"] for r in rows if r["total_MiB"] >= 256)
    print(
        f"copy {copy_moved:.0f} GB/s moved ({2 * copy_moved:.0f} r+w); best WRITE {best:.0f} "
        f"GB/s = {best / copy_moved:.0%} of moved, {best / (2 * copy_moved):.0%} of r+w"
    )


if __name__ == "__main__":
    main()
