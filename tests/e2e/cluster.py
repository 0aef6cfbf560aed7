"""A real Tandem deployment on loopback (prefill, decode and gateway processes)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tandem.launcher import Child, Cluster
from tests.integration.services import decode_stub, get_load, prefill_stub, wait_idle


@dataclass
class Deployment:
    cluster: Cluster
    prefills: list[Child]
    decodes: list[Child]
    gateway: Child
    model: str

    @property
    def base_url(self) -> str:
        return f"http://{self.gateway.address}/v1"

    def loads(self, role: str) -> list:
        children = self.prefills if role == "prefill" else self.decodes
        stub = prefill_stub if role == "prefill" else decode_stub

        async def run():
            return [await get_load(stub(c.address)) for c in children]

        return asyncio.run(run())

    def wait_idle(self, timeout_s: float = 20.0) -> None:
        async def run():
            for c in self.prefills:
                await wait_idle(prefill_stub(c.address), timeout_s)
            for c in self.decodes:
                if c.proc.poll() is None:
                    await wait_idle(decode_stub(c.address), timeout_s)

        asyncio.run(run())

    def stop(self) -> None:
        self.cluster.stop()


def deploy(
    model: str,
    num_prefill: int,
    num_decode: int,
    engine_flags: list[str],
    decode_flags: list[str] = (),
    gateway_flags: list[str] = (),
    kv_both: bool = False,
) -> Deployment:
    """`kv_both`: the decodes also serve prefills (`--kv-role kv_both`) and the gateway lists
    them as prefills too."""
    cluster = Cluster(log_prefix=False)
    both = ["--kv-role", "kv_both"] if kv_both else []
    try:
        prefills = [cluster.start("prefill", [model, *engine_flags]) for _ in range(num_prefill)]
        decodes = [
            cluster.start("decode", [model, *engine_flags, *decode_flags, *both])
            for _ in range(num_decode)
        ]
        prefills_listed = prefills + (decodes if kv_both else [])
        gw = [
            "--model",
            model,
            "--port",
            "0",
            "--decode",
            ",".join(c.address for c in decodes),
            *gateway_flags,
        ]
        if prefills_listed:
            gw += ["--prefill", ",".join(c.address for c in prefills_listed)]
        max_len = engine_flags[engine_flags.index("--max-model-len") + 1]
        gateway = cluster.start("gateway", [*gw, "--max-model-len", max_len])
    except BaseException:
        cluster.stop()
        raise
    return Deployment(cluster, prefills, decodes, gateway, model)
