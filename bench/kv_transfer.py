"""KV-transfer benchmark: UCX one-sided WRITE and READ between two processes vs memcpy.

    python bench/kv_transfer.py                      # default grid, ~1 min on 2 cores
    python bench/kv_transfer.py --block-kib 64 1024 --total-mib 256 --iters 5

Each transfer moves `total` bytes as one descriptor per block (no coalescing: the worst case,
blocks scattered on the remote side by a fixed permutation), timed from the first post to DONE
(flush complete). The reference is a torch copy of the same total bytes in one process,
measured in the same run. Results go to bench/results/kv_transfer-<date>.json.

The target process sits blocked on its pipe during transfers unless --peer-error-handling is
set (then RMA is emulated with messages and the target must progress its worker).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kv_transfer import Agent, Desc  # noqa: E402


def run_target(fd: int, region_bytes: int, peer_error_handling: bool) -> None:
    conn = Connection(fd)
    agent = Agent("bench-target", "ucx", peer_error_handling=peer_error_handling)
    region = torch.empty(region_bytes, dtype=torch.uint8).fill_(0)  # pre-touched
    agent.register_memory([region])
    conn.send(agent.get_agent_metadata())
    while True:
        if peer_error_handling and not conn.poll(0):
            agent.progress()  # emulated RMA needs the target's CPU
            continue
        cmd, *args = conn.recv()
        if cmd == "exit":
            agent.close()
            return
        if cmd == "sample":  # bytes at (offset, length) pairs, to verify transfers
            conn.send([region[o : o + n].numpy().tobytes() for o, n in args[0]])


def memcpy_gbps(src: torch.Tensor, dst: torch.Tensor, iters: int) -> float:
    """torch copy of the same bytes (both buffers pre-touched), in this process."""
    total_bytes = src.nbytes
    times = []
    for _ in range(iters + 1):  # the first copy is a warm-up
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return total_bytes / statistics.median(times[1:]) / 1e9


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def cma_gbps(pid: int, remote_addr: int, src: torch.Tensor, total_bytes: int, iters: int) -> dict:
    """The transport's own ceiling: raw process_vm_writev/readv (what UCX's cma does), 4 MiB
    per call, single thread. Not something kv_transfer can beat on one host without xpmem."""
    libc = ctypes.CDLL(None, use_errno=True)
    chunk = 4 << 20
    out = {}
    for name in ("process_vm_writev", "process_vm_readv"):
        fn = getattr(libc, name)
        fn.restype = ctypes.c_ssize_t
        times = []
        for _ in range(iters + 1):
            start = time.perf_counter()
            for off in range(0, total_bytes, chunk):
                n = min(chunk, total_bytes - off)
                local, remote = _Iovec(src.data_ptr() + off, n), _Iovec(remote_addr + off, n)
                got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
                assert got == n, f"{name}: {got} ({os.strerror(ctypes.get_errno())})"
            times.append(time.perf_counter() - start)
        op = "WRITE" if name.endswith("writev") else "READ"
        out[op] = total_bytes / statistics.median(times[1:]) / 1e9
    return out


def block_descs_scattered(total_bytes: int, block_bytes: int) -> tuple[list[Desc], list[Desc]]:
    num_blocks = total_bytes // block_bytes
    perm = [(i * 7919) % num_blocks for i in range(num_blocks)]  # odd stride: scatters blocks
    assert len(set(perm)) == num_blocks, "block count must be coprime with the stride"
    local = [Desc(0, i * block_bytes, block_bytes) for i in range(num_blocks)]
    remote = [Desc(0, p * block_bytes, block_bytes) for p in perm]
    return local, remote


def bench_one(agent, remote, src, op, total_bytes, block_bytes, iters, conn) -> dict:
    local, far = block_descs_scattered(total_bytes, block_bytes)
    post = agent.write if op == "WRITE" else agent.read
    times = []
    for i in range(iters + 1):  # the first transfer is a warm-up
        if op == "WRITE":
            src[:total_bytes:4096] = i % 251  # new data each time (one byte per page)
        start = time.perf_counter()
        handle = post(local, remote, far)
        state = handle.wait(60.0)
        times.append(time.perf_counter() - start)
        assert state == "DONE", handle.error
    # Verify the last transfer on a few blocks.
    picks = [0, len(local) // 2, len(local) - 1]
    conn.send(("sample", [(far[k].offset_bytes, block_bytes) for k in picks]))
    got = conn.recv()
    want = [src[local[k].offset_bytes :][:block_bytes].numpy().tobytes() for k in picks]
    assert got == want, f"{op} {block_bytes} B blocks: bytes differ after transfer"
    median_s = statistics.median(times[1:])
    return {
        "op": op,
        "block_bytes": block_bytes,
        "total_bytes": total_bytes,
        "num_descs": len(local),
        "median_s": round(median_s, 5),
        "gbps": round(total_bytes / median_s / 1e9, 3),
    }


def machine() -> dict:
    models = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if "model name" in ln]
    cpu = models[0] if models else platform.processor()
    return {
        "hostname": platform.node(),
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
    }


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "kv_transfer", "bench"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "uncommitted"
    if out.returncode != 0:
        return "uncommitted"
    return out.stdout.strip() + ("+dirty" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-kib", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--total-mib", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--ops", nargs="+", default=["WRITE", "READ"], choices=["WRITE", "READ"])
    parser.add_argument("--iters", type=int, default=3, help="timed transfers per config")
    parser.add_argument("--peer-error-handling", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: dated)")
    parser.add_argument("--role", default="initiator", help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--region-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "target":
        run_target(args.fd, args.region_bytes, args.peer_error_handling)
        return

    region_bytes = max(args.total_mib) << 20
    conn, child_conn = Pipe()
    cmd = [sys.executable, __file__, "--role", "target", "--fd", str(child_conn.fileno()),
           "--region-bytes", str(region_bytes)]  # fmt: skip
    if args.peer_error_handling:
        cmd.append("--peer-error-handling")
    target = subprocess.Popen(cmd, pass_fds=[child_conn.fileno()])
    child_conn.close()
    try:
        agent = Agent("bench-initiator", "ucx", peer_error_handling=args.peer_error_handling)
        src = torch.empty(region_bytes, dtype=torch.uint8).fill_(7)
        scratch = torch.empty_like(src).fill_(0)  # memcpy destination
        agent.register_memory([src])
        if not conn.poll(60):
            raise TimeoutError("target process did not start")
        meta = conn.recv()
        remote = agent.add_remote_agent(meta)
        target_addr = json.loads(meta)["region_addrs"][0]
        results = []
        print(f"{'op':5} {'total':>9} {'block':>9} {'ops':>6} {'GB/s':>7} {'memcpy':>7} "
              f"{'%memcpy':>7} {'cma':>6} {'%cma':>6}")  # fmt: skip
        for total_mib in args.total_mib:
            for block_kib in args.block_kib:
                for op in args.ops:
                    # References measured next to each row: the machine may be shared.
                    total = total_mib << 20
                    ref = memcpy_gbps(src[:total], scratch[:total], args.iters)
                    cma = cma_gbps(target.pid, target_addr, src, total_mib << 20, args.iters)
                    r = bench_one(
                        agent, remote, src, op, total_mib << 20, block_kib << 10, args.iters, conn
                    )
                    r["memcpy_gbps"] = round(ref, 3)
                    r["pct_of_memcpy"] = round(100 * r["gbps"] / ref, 1)
                    r["cma_ceiling_gbps"] = round(cma[op], 3)
                    r["pct_of_cma_ceiling"] = round(100 * r["gbps"] / cma[op], 1)
                    results.append(r)
                    print(
                        f"{op:5} {total_mib:5} MiB {block_kib:5} KiB {r['num_descs']:6} "
                        f"{r['gbps']:7.2f} {ref:7.2f} {r['pct_of_memcpy']:6.1f}% "
                        f"{cma[op]:6.2f} {r['pct_of_cma_ceiling']:5.1f}%",
                        flush=True,
                    )
        conn.send(("exit",))
        target.wait(timeout=30)
        agent.close()
    finally:
        if target.poll() is None:
            target.kill()
            target.wait()
    today = datetime.date.today().isoformat()
    report = {
        "benchmark": "kv_transfer",
        "date": today,
        "git_commit": git_commit(),
        "machine": machine(),
        "config": {
            "backend": "ucx",
            "transport_note": "two processes, one host; cma zero-copy unless peer_error_handling",
            "peer_error_handling": args.peer_error_handling,
            "iters": args.iters,
            "descriptors": "one per block, remote blocks permuted (no coalescing)",
            "timing": "median of iters after one warm-up; post of first op to DONE (flushed)",
            "memcpy": "torch uint8 copy_ of the total bytes, same process, same run",
            "cma_ceiling": "raw process_vm_writev/readv to the target, 4 MiB calls, same run",
        },
        "results": results,
    }
    out = args.out or REPO / "bench" / "results" / f"kv_transfer-{today}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
