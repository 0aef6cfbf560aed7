"""`tandem serve` keeps every listening socket on loopback: gateway, gRPC, metrics and UCX.

UCX opens a TCP listener per network device it uses; unless told otherwise that includes the
external interface, so the KV data plane of a "loopback" deployment was reachable from outside.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.fixtures.sockets import exposed, listening_tcp
from tests.integration.services import ENGINE_FLAGS


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_serve_listens_on_loopback_only(tiny_qwen3_path):
    cmd = [sys.executable, "-m", "tandem.cli", "serve", str(tiny_qwen3_path), "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, *ENGINE_FLAGS],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    serving, log = threading.Event(), []

    def pump() -> None:
        for line in proc.stdout:
            log.append(line)
            if line.startswith("Tandem is serving"):
                serving.set()
        serving.set()  # exited: stop waiting

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert serving.wait(300), "tandem serve did not come up within 300 s"
        assert proc.poll() is None, f"tandem serve exited:\n{''.join(log)}"
        children = _children(proc.pid)
        assert len(children) == 3  # prefill, decode, gateway
        # Every service listens somewhere (gRPC, HTTP): the check below is not vacuous.
        assert all(listening_tcp(pid) for pid in children)
        beyond = {pid: exposed(pid) for pid in [proc.pid, *children]}
        assert not any(beyond.values()), f"listening beyond loopback: {beyond}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and not _is_zombie(pid) for pid in children):
        assert time.monotonic() < deadline, "tandem serve left processes behind"
        time.sleep(0.05)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
