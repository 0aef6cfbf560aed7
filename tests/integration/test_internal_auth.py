"""Internal gRPC is authenticated by default: calls without the token (or with a wrong one) are
UNAUTHENTICATED; health probes stay open; D → P calls carry the token. A bare service or gateway
without a token refuses to start (before loading anything) unless `--insecure-internal`, which
warns loudly; a weak token is refused."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import internal_auth
from engine.sampling_params import SamplingParams
from protos import common_pb2, decode_pb2, decode_pb2_grpc
from tests.integration.services import ENGINE_FLAGS, collect, generate_request, start_services

TOKEN = "internal-secret-for-tests-0123456789"
_AUTH_ENV = (internal_auth.ENV_TOKEN, internal_auth.ENV_TOKEN_FILE)


@pytest.fixture(scope="module")
def services(tiny_qwen3_path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(internal_auth.ENV_TOKEN, TOKEN)  # inherited by the service processes
        cluster, prefills, decodes = start_services(tiny_qwen3_path, 1, 1)
        try:
            yield mp, prefills[0].address, decodes[0].address
        finally:
            cluster.stop()


def test_calls_need_the_token(services):
    mp, p_addr, d_addr = services
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run():
        plain = decode_pb2_grpc.DecodeStub(grpc.aio.insecure_channel(d_addr))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await plain.GetLoad(common_pb2.LoadRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(plain, generate_request("u1", [1, 2, 3], params))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(grpc.aio.insecure_channel(d_addr))
        ok = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert ok.status == health_pb2.HealthCheckResponse.SERVING
        # With the token (this process's env), including D's own call to P.
        authed = decode_pb2_grpc.DecodeStub(internal_auth.internal_channel(d_addr))
        tokens, final, _ = await collect(
            authed, generate_request("u2", [1, 2, 3], params, [p_addr])
        )
        assert len(tokens) == 4 and not final.timings.local_prefill

    asyncio.run(run())
    mp.setenv(internal_auth.ENV_TOKEN, "wrong-token-but-long-enough")

    async def wrong():
        stub = decode_pb2_grpc.DecodeStub(internal_auth.internal_channel(d_addr))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GetLoad(common_pb2.LoadRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(wrong())
    mp.setenv(internal_auth.ENV_TOKEN, TOKEN)


def test_generate_mux_needs_the_token(services):
    """The stream the gateway sends every request on is refused like any call without the
    token; with it, a request on the stream runs as a Generate call would."""
    _, _, d_addr = services
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def start(rid: str) -> decode_pb2.MuxRequest:
        return decode_pb2.MuxRequest(id=1, start=generate_request(rid, [1, 2, 3], params))

    async def run():
        async with grpc.aio.insecure_channel(d_addr) as channel:
            call = decode_pb2_grpc.DecodeStub(channel).GenerateMux()
            # Refused at the call's start; the gateway's client writes only after the initial
            # metadata (gateway/mux.py): a write racing the refusal turns it into INTERNAL in
            # grpc.aio (seen under load).
            await call.initial_metadata()
            assert await call.code() == grpc.StatusCode.UNAUTHENTICATED
        async with internal_auth.internal_channel(d_addr) as channel:
            call = decode_pb2_grpc.DecodeStub(channel).GenerateMux()
            await call.write(start("m2"))
            await call.done_writing()
            items = [item async for batch in call for item in batch.items]
        tokens = [t for i in items if i.HasField("response") for t in i.response.tokens.token_ids]
        assert len(tokens) == 4 and items[-1].end.code == grpc.StatusCode.OK.value[0]
        assert await call.code() == grpc.StatusCode.OK

    asyncio.run(run())


def _env(**auth: str) -> dict[str, str]:
    """This process's environment with exactly the given internal-auth variables."""
    env = {k: v for k, v in os.environ.items() if k not in _AUTH_ENV}
    return {**env, **auth}


# The model path does not exist: if a process got as far as loading it, the error says so.
_MISSING_MODEL = "/nonexistent/tandem-model"
_BARE = {
    "prefill": ["prefill", _MISSING_MODEL],
    "decode": ["decode", _MISSING_MODEL],
    "gateway": ["gateway", "--model", _MISSING_MODEL, "--decode", "127.0.0.1:1"],
}


def _run_all(cases: dict[str, tuple[list[str], dict[str, str]]]) -> dict[str, tuple[int, str]]:
    """Run `tandem <argv>` for every case at once; (exit code, stderr) of each."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", *argv],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (argv, env) in cases.items()
    }
    results = {}
    try:
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=120)
            results[name] = (proc.returncode, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def test_bare_processes_refuse_to_start_without_a_token():
    # (Weak tokens, unreadable files, bad TLS files: tests/engine/test_internal_auth.py.)
    results = _run_all({role: (argv, _env()) for role, argv in _BARE.items()})
    for role in _BARE:
        code, err = results[role]
        last = err.strip().splitlines()[-1]
        assert code != 0 and last.startswith(f"tandem {role}: refusing to start"), err
        assert internal_auth.ENV_TOKEN_FILE in last and "--insecure-internal" in last, last
        assert "nonexistent" not in err  # refused before touching the model


def test_insecure_internal_warns_and_serves_unauthenticated(tiny_qwen3_path):
    argv = ["decode", str(tiny_qwen3_path), *ENGINE_FLAGS, "--insecure-internal"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", *argv],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines, ready = [], threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("READY "):
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(120) and proc.poll() is None, "".join(lines)
        assert any("WARNING" in x and "INTERNAL gRPC IS UNAUTHENTICATED" in x for x in lines)
        address = next(x for x in lines if x.startswith("READY ")).split()[2]

        async def call():
            plain = decode_pb2_grpc.DecodeStub(grpc.aio.insecure_channel(address))
            return await plain.GetLoad(common_pb2.LoadRequest(), timeout=5)

        assert asyncio.run(call()).max_num_batched_tokens > 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
