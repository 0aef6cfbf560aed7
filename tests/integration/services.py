"""Helpers to run real prefill/decode processes and talk to them over gRPC."""

from __future__ import annotations

import asyncio
import itertools
import re
import socket
import subprocess
import sys
import threading
import time

import grpc

from engine.internal_auth import internal_channel
from engine.sampling_params import SamplingParams
from engine.serving import sampling_params_to_proto
from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from tandem.launcher import Cluster

ENGINE_FLAGS = ["--max-model-len", "256", "--num-gpu-blocks-override", "64"]
SERVING = re.compile(r"^Tandem is serving .* at (http://\S+/v1)")


def start_tandem_serve(
    model_path, timeout_s: float, **popen
) -> tuple[subprocess.Popen, str, list[str]]:
    """`tandem serve MODEL` with ENGINE_FLAGS on a free port, up: (process, its /v1 URL, the
    output lines, which a thread goes on collecting). `popen`: more Popen arguments."""
    cmd = [sys.executable, "-m", "tandem.cli", "serve", str(model_path), *ENGINE_FLAGS]
    proc = subprocess.Popen(
        [*cmd, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )
    lines: list[str] = []
    url: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if m := SERVING.match(line):
                url.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not (ready.wait(timeout_s) and url):
        proc.kill()
        proc.wait()
        raise AssertionError(
            f"tandem serve did not start (exit {proc.poll()}):\n" + "".join(lines[-40:])
        )
    return proc, url[0], lines


def start_services(
    model_path, num_prefill: int, num_decode: int, extra_prefill=(), extra_decode=()
) -> tuple[Cluster, list, list]:
    cluster = Cluster(log_prefix=False)
    try:
        prefills = [
            cluster.start("prefill", [str(model_path), *ENGINE_FLAGS, *extra_prefill])
            for _ in range(num_prefill)
        ]
        decodes = [
            cluster.start("decode", [str(model_path), *ENGINE_FLAGS, *extra_decode])
            for _ in range(num_decode)
        ]
    except BaseException:
        cluster.stop()
        raise
    return cluster, prefills, decodes


def generate_request(
    rid: str, prompt: list[int], params: SamplingParams, prefill_addrs=(), cache_salt: str = ""
) -> decode_pb2.GenerateRequest:
    return decode_pb2.GenerateRequest(
        request_id=rid,
        transfer_id=f"t-{rid}",
        prompt_token_ids=prompt,
        params=sampling_params_to_proto(params),
        cache_salt=cache_salt,
        prefill=[decode_pb2.PrefillTarget(address=a) for a in prefill_addrs],
    )


async def collect(stub, req) -> tuple[list[int], object, object]:
    """(tokens, final, error event) of one Generate stream."""
    tokens, final, error = [], None, None
    async for resp in stub.Generate(req):
        kind = resp.WhichOneof("kind")
        if kind == "tokens":
            tokens += list(resp.tokens.token_ids)
        elif kind == "final":
            final = resp.final
        else:
            error = resp.error
    return tokens, final, error


async def read_call(call) -> tuple[list[int], str]:
    """(tokens, finish reason) of a gateway client's Generate call (gateway/clients.py), to its
    end."""
    tokens, finish = [], ""
    while (message := await call.read()) is not grpc.aio.EOF:
        tokens += message.tokens.token_ids
        finish = message.final.finish_reason or finish
    return tokens, finish


async def open_frames(clients, instance, old=None):
    """The gateway client's framed connection to `instance` once open (and not `old`). The
    client connects when a call finds it closed and its back-off over (2 s after a broken one),
    to the port the decode advertised on its gRPC stream: so calls on gRPC until then."""
    params = SamplingParams(temperature=0.0, max_tokens=2)
    async with asyncio.timeout(30):
        for i in itertools.count():
            frames = getattr(clients._generates.get(instance.address), "frames", None)
            if frames is not None and frames is not old and frames.is_open:
                return frames
            await read_call(
                clients.generate(instance, generate_request(f"open{i}", [1, 2], params))
            )
            await asyncio.sleep(0.1)


def decode_stub(addr: str):
    return decode_pb2_grpc.DecodeStub(internal_channel(addr))


def prefill_stub(addr: str):
    return prefill_pb2_grpc.PrefillStub(internal_channel(addr))


async def get_load(stub):
    return await stub.GetLoad(common_pb2.LoadRequest(), timeout=5)


async def wait_idle(stub, timeout_s: float = 20.0):
    """Poll until the instance runs nothing and every block is free again (no leaks)."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = await get_load(stub)
        if (
            load.num_running == 0
            and load.num_waiting == 0
            and load.num_free_blocks == load.num_idle_free_blocks
        ):
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"instance not idle after {timeout_s} s: {load}")
        await asyncio.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric_value(text: str, name: str) -> float:
    """The first sample of `name` (any labels) in a Prometheus exposition."""
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} not exported"
    return float(m.group(1))
