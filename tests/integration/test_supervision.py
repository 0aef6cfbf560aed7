"""Processes that die come back: `tandem serve` restarts a killed child on its port and the
gateway reaches it again; a service whose engine loop dies turns NOT_SERVING and exits non-zero
(so that a supervisor restarts it) instead of answering 503 forever."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.lifeline import child_env
from engine.registry import INSTANCES_KEY
from engine.sampling_params import SamplingParams
from engine.service_main import EXIT_ENGINE_DEAD
from engine.serving import sampling_params_to_proto
from protos import decode_pb2, decode_pb2_grpc
from tests.integration.services import ENGINE_FLAGS
from tests.redis_server import redis_server  # noqa: F401  (the fixture)

START_S = 180.0  # a tiny model on a shared CPU
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DECODE_SERVICE = "tandem.v1.Decode"
CHILD_LINE = re.compile(r"^\[(\w+) (\d+)\] (.*)$")  # the launcher's prefix on child output


class LineProc:
    """A process whose output lines are collected by a thread, to await with a deadline."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=child_env(env),
        )
        self.lines: list[str] = []
        self.is_eof = False
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self.is_eof = True
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout_s: float, start: int = 0) -> tuple[int, re.Match]:
        """The first line from index `start` on that matches `pattern`: (index, match)."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for i in range(start, len(self.lines)):
                    m = rx.search(self.lines[i])
                    if m:
                        return i, m
                start = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or self.is_eof:
                    tail = "\n".join(self.lines[-40:])
                    raise AssertionError(
                        f"no line matching {pattern!r} (exit code {self.proc.poll()}):\n{tail}"
                    )
                self._cond.wait(min(left, 0.5))

    def child_pids(self) -> set[int]:
        with self._cond:
            return {int(m.group(2)) for ln in self.lines if (m := CHILD_LINE.match(ln))}

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _is_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


def _kill_leftovers(pids: set[int]) -> list[int]:
    """SIGKILL whichever of `pids` still runs (a test never leaves processes behind)."""
    alive = [pid for pid in pids if not _is_gone(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return alive


def _complete(base_url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hello there", "max_tokens": 4, "temperature": 0}
    return httpx.post(
        f"{base_url}/completions", json=body, headers={"Authorization": "Bearer u"}, timeout=30
    )


def _await_completion(base_url: str, model: str, timeout_s: float) -> httpx.Response:
    """A completion through the gateway, retried until one succeeds or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = _complete(base_url, model)
            if r.status_code == 200:
                return r
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.TransportError as e:
            last = repr(e)
        assert time.monotonic() < deadline, f"no successful completion in {timeout_s} s: {last}"
        time.sleep(0.2)


# ---- 1. tandem serve restarts a crashed child ---------------------------------------------
def test_tandem_serve_restarts_a_killed_decode_and_serves_again(tiny_qwen3_path):
    model = str(tiny_qwen3_path)
    launcher = LineProc(
        [sys.executable, "-m", "tandem.cli", "serve", model, *ENGINE_FLAGS, "--port", "0"]
    )
    try:
        _, m = launcher.wait_for(r"^Tandem is serving .* at (http://\S+/v1)", START_S)
        base_url = m.group(1)
        _, d = launcher.wait_for(r"^\[decode (\d+)\] READY decode (\S+)$", 1)
        old_pid, address = int(d.group(1)), d.group(2)
        assert _complete(base_url, model).status_code == 200

        os.kill(old_pid, signal.SIGKILL)
        i, _ = launcher.wait_for(
            rf"decode \(pid {old_pid}\) exited with code -9 \(SIGKILL\); restarting it in 1 s",
            30,
        )
        _, d = launcher.wait_for(r"^\[decode (\d+)\] READY decode (\S+)$", START_S, start=i)
        assert int(d.group(1)) != old_pid and d.group(2) == address  # same port: rejoined
        r = _await_completion(base_url, model, 60)
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
        assert launcher.proc.poll() is None
        assert _is_gone(old_pid)
    finally:
        children = launcher.child_pids()
        rc = launcher.stop()
        leftovers = _kill_leftovers(children)
    assert rc == 0, "\n".join(launcher.lines[-40:])
    assert not leftovers, f"orphans: {leftovers}"


# ---- 2. the engine loop dies: NOT_SERVING, then a non-zero exit ---------------------------
def _generate_request(rid: str) -> decode_pb2.GenerateRequest:
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    return decode_pb2.GenerateRequest(
        request_id=rid,
        transfer_id=f"t-{rid}",
        prompt_token_ids=list(range(40, 60)),
        params=sampling_params_to_proto(params),
    )


def test_engine_loop_death_turns_health_not_serving_and_exits_non_zero(
    tiny_qwen3_path,
    redis_server,  # noqa: F811
):
    token = secrets.token_hex(16)
    env = {**os.environ, "TANDEM_INTERNAL_TOKEN": token}
    cmd = [sys.executable, "-m", "tests.integration.dying_decode", "3", str(tiny_qwen3_path)]
    flags = [*ENGINE_FLAGS, "--port", "0", "--redis-url", redis_server.url]
    service = LineProc([*cmd, *flags], env=env)
    registry = redis.Redis.from_url(redis_server.url)
    try:
        _, m = service.wait_for(r"^READY decode (\S+)$", START_S)
        address = m.group(1)
        assert len(registry.smembers(INSTANCES_KEY)) == 1  # READY waits for the registration

        async def run() -> tuple[dict, list[int], object]:
            channel = grpc.aio.insecure_channel(address)
            health = health_pb2_grpc.HealthStub(channel)
            seen: dict[str, list[int]] = {"": [], DECODE_SERVICE: []}

            async def watch(name: str) -> None:
                req = health_pb2.HealthCheckRequest(service=name)
                try:
                    async for resp in health.Watch(req):
                        seen[name].append(resp.status)
                except grpc.aio.AioRpcError:
                    pass  # the server went away: what it said before is in `seen`

            watchers = [asyncio.ensure_future(watch(name)) for name in seen]
            deadline = time.monotonic() + 10
            while not all(SERVING in statuses for statuses in seen.values()):
                assert time.monotonic() < deadline, f"never SERVING: {seen}"
                await asyncio.sleep(0.05)
            # Step 4 raises: the stream gets 3 tokens, then an error.
            stub = decode_pb2_grpc.DecodeStub(channel)
            md = [("authorization", f"Bearer {token}")]
            tokens, error = [], None
            try:
                async for resp in stub.Generate(_generate_request("r"), metadata=md, timeout=30):
                    kind = resp.WhichOneof("kind")
                    if kind == "tokens":
                        tokens += resp.tokens.token_ids
                    elif kind == "error":
                        error = resp.error
            except grpc.aio.AioRpcError as e:
                error = e
            await asyncio.wait_for(asyncio.gather(*watchers), 15)
            await channel.close()
            return seen, tokens, error

        seen, tokens, error = asyncio.run(run())
        assert len(tokens) == 3 and error is not None, "in flight, then an error"
        assert seen[""][-1] == NOT_SERVING and seen[DECODE_SERVICE][-1] == NOT_SERVING, seen
        rc = service.proc.wait(timeout=15)
        assert rc == EXIT_ENGINE_DEAD, "\n".join(service.lines[-40:])
        # It left the pool on its way out (no heartbeat keeps a dead engine discoverable).
        assert registry.smembers(INSTANCES_KEY) == set()
        assert registry.keys("tandem:instance:*") == []
    finally:
        registry.close()
        service.stop(signal.SIGKILL, 10)
