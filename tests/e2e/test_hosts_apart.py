"""Hosts apart, on one machine: gateway + Redis, a prefill and a decode each in its own network
namespace, joined by veth pairs on a bridge (in a namespace of its own), so every hop crosses an
interface as it would between hosts: the services register their advertised addresses in Redis
(with a password), the gateway finds them there, gRPC and Redis go over the veths, and KV moves
over UCX TCP on the decode's veth (UCX_TLS=tcp: namespaces on one machine would otherwise share
memory transports, which hosts cannot). The test process joins the bridge as the client.

Needs root and `ip netns` (skipped with the reason otherwise; CI runs as root).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import openai
import pytest

from engine import LLM, SamplingParams
from tests.integration.services import decode_stub, get_load, wait_idle
from tests.integration.test_supervision import START_S, LineProc

ENGINE_FLAGS = ["--max-model-len", "256", "--num-gpu-blocks-override", "64"]
PROMPT = "The hosts are apart and the KV cache travels over a virtual wire, block by block,"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _netns_refusal() -> str | None:
    if shutil.which("ip") is None:
        return "no `ip` binary"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"tprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"the kernel refuses network namespaces: {e.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Net:
    """A bridge namespace and one namespace per host, with their addresses."""

    tag: str
    subnet: str  # "10.a.b"
    hosts: dict[str, str] = field(default_factory=dict)  # name -> address
    namespaces: list[str] = field(default_factory=list)
    root_links: list[str] = field(default_factory=list)

    def ns(self, host: str) -> str:
        return f"t{self.tag}{host}"

    def iface(self, host: str) -> str:
        return f"v{self.tag}{host}"

    def add_bridge(self) -> None:
        sw = self.ns("sw")
        _ip("netns", "add", sw)
        self.namespaces.append(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")

    def add_host(self, host: str, octet: int, in_root: bool = False) -> str:
        address = f"{self.subnet}.{octet}"
        inner, outer = self.iface(host), f"o{self.tag}{host}"
        _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
        _ip("link", "set", outer, "netns", self.ns("sw"))
        _ip("-n", self.ns("sw"), "link", "set", outer, "master", "br0", "up")
        if in_root:
            self.root_links.append(inner)
            _ip("addr", "add", f"{address}/24", "dev", inner)
            _ip("link", "set", inner, "up")
        else:
            ns = self.ns(host)
            _ip("netns", "add", ns)
            self.namespaces.append(ns)
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        self.hosts[host] = address
        return address

    def rx_bytes(self, host: str) -> int:
        out = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                self.ns(host),
                "cat",
                f"/sys/class/net/{self.iface(host)}/statistics/rx_bytes",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        return int(out.stdout)

    def kill_all(self, host: str) -> None:
        pids = subprocess.run(
            ["ip", "netns", "pids", self.ns(host)], capture_output=True, text=True
        ).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)

    def remove(self) -> None:
        for host in self.hosts:
            if host != "client":
                self.kill_all(host)
        for link in self.root_links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def net() -> Iterator[Net]:
    reason = _netns_refusal()
    if reason is not None:
        print(f"SKIP hosts-apart test: {reason}")
        pytest.skip(reason)
    tag = secrets.token_hex(2)
    n = Net(tag, f"10.{random.randint(64, 127)}.{random.randint(1, 254)}")
    try:
        n.add_bridge()
        n.add_host("client", 1, in_root=True)
        n.add_host("gw", 10)
        n.add_host("p", 11)
        n.add_host("d", 12)
        yield n
    finally:
        n.remove()
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"t{tag}" not in leftover
    assert not [ln for ln in open("/proc/net/dev") if f"{tag}" in ln]


def _in_ns(net: Net, host: str, args: list[str], env: dict[str, str]) -> LineProc:
    return LineProc(["ip", "netns", "exec", net.ns(host), sys.executable, *args], env=env)


def test_gateway_prefill_decode_in_separate_namespaces(net: Net, tiny_qwen3_path, tmp_path):
    model = str(tiny_qwen3_path)
    password = secrets.token_hex(16)
    gw, p, d = net.hosts["gw"], net.hosts["p"], net.hosts["d"]
    redis_url = f"redis://:{password}@{gw}:6379/0"
    env = {**os.environ, "TANDEM_REDIS_URL": redis_url, "UCX_TLS": "tcp"}
    procs: list[LineProc] = []
    try:
        (tmp_path / "redis").mkdir()
        redis_cmd = [
            "ip",
            "netns",
            "exec",
            net.ns("gw"),
            "redis-server",
            "--bind",
            gw,
            "--port",
            "6379",
            "--requirepass",
            password,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path / "redis"),
        ]
        procs.append(LineProc(redis_cmd))
        procs[-1].wait_for(r"Ready to accept connections", 30)
        for host, role, address in (("p", "prefill", p), ("d", "decode", d)):
            procs.append(
                _in_ns(
                    net,
                    host,
                    [
                        "-m",
                        "tandem.cli",
                        role,
                        model,
                        *ENGINE_FLAGS,
                        "--host",
                        address,
                        "--port",
                        "50051",
                        "--kv-interface",
                        net.iface(host),
                    ],
                    env,
                )
            )
        for proc in procs[1:]:
            proc.wait_for(r"^READY (prefill|decode) ", START_S)
        gateway = _in_ns(
            net,
            "gw",
            [
                "-m",
                "tandem.cli",
                "gateway",
                "--model",
                model,
                "--host",
                gw,
                "--port",
                "8000",
                "--max-model-len",
                "256",
            ],
            env,
        )
        procs.append(gateway)
        gateway.wait_for(r"Uvicorn running on|Application startup complete", START_S)
        client = openai.OpenAI(base_url=f"http://{gw}:8000/v1", api_key="k", max_retries=0)
        offline = LLM(model, max_model_len=256, num_gpu_blocks_override=64)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        expected = offline.generate([PROMPT], params)[0].outputs[0].text

        rx_before = net.rx_bytes("d")
        text = _complete_when_routed(client, model)
        assert text == expected
        load = asyncio.run(_on_decode(d, get_load))
        assert load.num_remote_prefills >= 1, load  # the prompt was prefilled on P, over there
        assert load.kv_transfer_bytes > 0
        assert net.rx_bytes("d") - rx_before >= load.kv_transfer_bytes  # over the veth

        # The prefill host dies: the decode prefills locally, the answer does not change.
        net.kill_all("p")
        assert _complete_when_routed(client, model) == expected
        asyncio.run(_on_decode(d, wait_idle))  # nothing leaked at D
    finally:
        for proc in reversed(procs):
            if proc.proc.poll() is None:
                proc.proc.terminate()
        for proc in procs:
            try:
                proc.proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.proc.kill()
                proc.proc.wait()


async def _on_decode(address: str, call):
    return await call(decode_stub(f"{address}:50051"))


def _complete_when_routed(client: openai.OpenAI, model: str) -> str:
    """The gateway discovers P and D through Redis within a heartbeat; until it has a decode
    it answers 503. Retry those (only those) for a bounded time."""
    import time

    deadline = time.monotonic() + 60
    while True:
        try:
            r = client.completions.create(
                model=model,
                prompt=PROMPT,
                max_tokens=12,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return r.choices[0].text
        except openai.APIStatusError as e:
            if e.status_code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
