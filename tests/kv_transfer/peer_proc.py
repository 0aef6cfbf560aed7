"""A UCX transfer peer in its own process, driven over a multiprocessing connection.

Run by `conftest.ProcPeer` as a script (`python peer_proc.py --fd N ...`), so it needs no test
package on sys.path. It owns an Agent with zeroed, pre-touched regions, answers commands, and
calls `agent.progress()` whenever it is idle, like a service's engine loop would.
Replies are ("ok", value) or ("error", traceback text), which the parent re-raises.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root

import torch  # noqa: E402

from kv_transfer import Agent  # noqa: E402


def _await_notif(agent: Agent, regions: list[torch.Tensor], payload: bytes, timeout_s: float):
    """Wait for `payload`, then snapshot the regions at once: the bytes must already be there."""
    seen: dict[str, list[bytes]] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for sender, notifs in agent.get_notifs().items():
            seen.setdefault(sender, []).extend(notifs)
        if any(payload in notifs for notifs in seen.values()):
            return seen, [r.numpy().tobytes() for r in regions]
    raise TimeoutError(f"no notification {payload!r} within {timeout_s} s; got {seen}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--region-bytes", required=True, help="comma-separated sizes")
    parser.add_argument("--peer-error-handling", action="store_true")
    args = parser.parse_args()
    conn = Connection(args.fd)
    agent = Agent(args.name, "ucx", peer_error_handling=args.peer_error_handling)
    regions = [torch.zeros(int(n), dtype=torch.uint8) for n in args.region_bytes.split(",")]
    for r in regions:
        r.fill_(0)  # pre-touch: first-touch page faults would otherwise land in a transfer
    agent.register_memory(regions)
    conn.send(("ok", agent.get_agent_metadata()))
    while True:
        if not conn.poll(0.0002):
            agent.progress()
            continue
        cmd, *cmd_args = conn.recv()
        try:
            if cmd == "exit":
                agent.close()
                conn.send(("ok", None))
                return
            if cmd == "region":
                reply = regions[cmd_args[0]].numpy().tobytes()
            elif cmd == "set_region":
                i, data = cmd_args
                regions[i].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                reply = None
            elif cmd == "notifs":
                reply = agent.get_notifs()
            elif cmd == "await_notif":
                reply = _await_notif(agent, regions, *cmd_args)
            elif cmd == "add_remote":
                reply = agent.add_remote_agent(cmd_args[0])
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", reply))
        except Exception:
            conn.send(("error", traceback.format_exc()))


if __name__ == "__main__":
    main()
