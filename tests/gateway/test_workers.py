"""`tandem gateway --workers N` (gateway/workers.py): real processes, a real Redis.

Two workers serve through one port and share one API key's quota exactly; the parent's one
metrics port reports both; a killed worker is replaced; SIGTERM stops all; a killed parent
takes its workers with it; bad flags stop the gateway with a clear message.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from gateway.__main__ import parse_args
from tests.gateway.conftest import MAX_MODEL_LEN, SERVED_NAME
from tests.gateway.edge_util import KEY_ALPHA, KEY_BETA, wait_for, write_keys
from tests.redis_server import redis_server  # noqa: F401  (fixture)

QUOTA = 6  # requests per minute for KEY_ALPHA
CHAT = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkersGateway:
    """`python -m gateway --workers 2 ...` with its stderr collected."""

    def __init__(self, model_path, decode: str, redis_url: str, keys: Path):
        self.metrics_url = f"http://127.0.0.1:{_free_port()}/metrics"
        env = {**os.environ, "TANDEM_API_KEYS_FILE": str(keys), "PYTHONUNBUFFERED": "1"}
        args = [sys.executable, "-m", "gateway", "--model", str(model_path), "--port", "0"]
        args += ["--served-model-name", SERVED_NAME, "--max-model-len", str(MAX_MODEL_LEN)]
        args += ["--decode", decode, "--redis-url", redis_url, "--workers", "2"]
        args += ["--metrics-port", self.metrics_url.split(":")[2].split("/")[0]]
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.log: list[str] = []
        threading.Thread(target=self._read_log, daemon=True).start()
        line = self.proc.stdout.readline().decode()
        assert line.startswith("READY gateway "), f"no READY line: {line!r}\n{self.logs()}"
        self.url = "http://" + line.split()[-1]

    def _read_log(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line.decode())

    def logs(self) -> str:
        return "".join(self.log)

    def worker_pids(self) -> list[int]:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(p) for p in children.read_text().split()]

    def served(self) -> dict[str, float]:
        """Requests each worker finished (its e2e latency count), by worker index."""
        text = httpx.get(self.metrics_url, timeout=10).text
        found = re.findall(r'e2e_request_latency_seconds_count\{.*worker="(\d)"\} (\S+)', text)
        return {w: float(v) for w, v in found}

    def reporting(self) -> set[str]:
        """The workers whose metrics the parent's port shows (ready ones)."""
        text = httpx.get(self.metrics_url, timeout=10).text
        return set(re.findall(r'tandem:requests_in_flight\{worker="(\d)"\}', text))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout=30)


@pytest.fixture
def workers(tiny_qwen3_path, fakes, redis_server, tmp_path):  # noqa: F811
    keys = write_keys(
        tmp_path / "keys",
        [(KEY_ALPHA, "alpha", {"requests_per_min": QUOTA}), (KEY_BETA, "beta", None)],
    )
    gw = WorkersGateway(tiny_qwen3_path, fakes[0][1], redis_server.url, keys)
    try:
        yield gw
    finally:
        gw.stop()


def _client_on_each_worker(gw: WorkersGateway) -> dict[str, httpx.Client]:
    """A keep-alive client per worker: new connections (the kernel spreads them over the
    workers by a hash of the connection) until each worker has answered one."""
    pinned: dict[str, httpx.Client] = {}
    for _ in range(100):
        if len(pinned) == 2:
            return pinned
        client = httpx.Client(base_url=gw.url, timeout=30)
        before = gw.served()
        auth = {"Authorization": f"Bearer {KEY_BETA}"}
        assert client.post("/v1/chat/completions", json=CHAT, headers=auth).status_code == 200
        num_before = sum(before.values())
        wait_for(lambda n=num_before: sum(gw.served().values()) == n + 1, timeout_s=30.0)
        after = gw.served()
        worker = next(w for w in after if after[w] != before.get(w, 0.0))
        if worker in pinned:
            client.close()
        else:
            pinned[worker] = client
    raise AssertionError(f"one port, but not both workers answered: {gw.served()}")


def test_two_workers_serve_through_one_port_and_share_one_quota(workers):
    gw = workers
    assert len(gw.worker_pids()) == 2
    clients = _client_on_each_worker(gw)
    assert sorted(clients) == ["0", "1"]
    # One key, one limit: requests alternate between the workers; exactly QUOTA are served.
    auth = {"Authorization": f"Bearer {KEY_ALPHA}"}
    statuses = []
    for i in range(3 * QUOTA):
        resp = clients[str(i % 2)].post("/v1/chat/completions", json=CHAT, headers=auth)
        statuses.append(resp.status_code)
        if resp.status_code == 429:
            assert 1 <= int(resp.headers["retry-after"]) <= 60
    assert statuses == [200] * QUOTA + [429] * (2 * QUOTA)
    text = httpx.get(gw.metrics_url, timeout=10).text
    schema = httpx.get(gw.metrics_url.replace("/metrics", "/openapi.json"), timeout=10)
    assert "/v1/chat/completions" in schema.json()["paths"]  # the metrics port's documents
    for worker in ("0", "1"):  # both refused: neither kept a count of its own
        rejected = rf'tandem:quota_rejections_total\{{[^}}]*tenant="alpha",worker="{worker}"'
        assert re.search(rejected, text), text
    for client in clients.values():
        client.close()
    assert gw.stop() == 0
    assert "READY" not in gw.proc.stdout.read().decode()  # printed once, by the parent
    assert "[worker 0]" in gw.logs() and "[worker 1]" in gw.logs()


def test_a_killed_worker_is_replaced_and_sigterm_stops_all(workers):
    gw = workers
    first, second = gw.worker_pids()
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: len(gw.worker_pids()) == 2 and first not in gw.worker_pids(), timeout_s=30.0)
    wait_for(lambda: gw.reporting() == {"0", "1"}, timeout_s=30.0)  # the new worker 0 is ready
    clients = _client_on_each_worker(gw)  # and both serve
    for client in clients.values():
        client.close()
    assert "exited with code -9; restarting it" in gw.logs()
    pids = gw.worker_pids()
    assert gw.stop() == 0
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists()
    assert second in pids


def test_a_killed_parent_leaves_no_workers(workers):
    gw = workers
    pids = gw.worker_pids()
    gw.proc.kill()
    gw.proc.wait(timeout=10)
    # PR_SET_PDEATHSIG: each worker gets SIGTERM, drains (nothing open) and exits.
    wait_for(lambda: not any(_is_running(pid) for pid in pids), timeout_s=30.0)


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited (its parent, the test, is gone: reaped by init)


def test_workers_flag_and_its_vllm_alias():
    assert parse_args(["--workers", "3"]).workers == 3
    assert parse_args(["--api-server-count", "2"]).workers == 2
    assert parse_args([]).workers == 1


def _gateway_exit(model_path, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_REDIS_URL")}
    args = [sys.executable, "-m", "gateway", "--model", str(model_path), "--port", "0", *flags]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)


def test_several_workers_need_redis(tiny_qwen3_path):
    done = _gateway_exit(tiny_qwen3_path, "--workers", "2")
    assert done.returncode != 0 and not done.stdout
    assert "--workers 2 needs --redis-url" in done.stderr
    done = _gateway_exit(tiny_qwen3_path, "--api-server-count", "0")
    assert done.returncode != 0 and "--workers 0: at least 1" in done.stderr
