"""Remote prefills waiting at a decode for KV blocks: how long they wait, CPU, real processes.

`tandem prefill` + `tandem decode` (UCX on this machine) with a decode cache too small for
every stream at once, driven over gRPC straight at the decode (no gateway): `--streams`
closed-loop streams, each sending `--requests` requests one after another (`--prompt-len`
distinct random token ids, `--max-tokens` generated with ignore_eos, greedy). The first wave
does not fit, so a line forms; then the streams finish together and free blocks for many at
once, as the 1P+1D run at 256 streams does on a GPU. The model is the tests' tiny Qwen3 (dummy
weights: host work and waiting dominate, as beside a GPU's fast steps) unless `--model` names
one; with a real model the prefill is slow here, and a burst sent to it tests the bound on
waiting for its replies (`num_local_prefills`: requests that went back to the decode).
Recorded per request, from the `Timings` of the decode's final message: `remote_setup_s`
(request received -> Prefill call sent: the blocks reserved, the line included),
`remote_rpc_s`, and the client's TTFT; and the wall of the whole run.

With `--baseline-tree PATH` (a checkout of an older commit: `git worktree add /tmp/base REV`),
the services also run from that tree, alternating with this one for `--rounds` rounds, in one
run on one machine. Writes `bench/results/remote_line[_<tag>]-<date>.json`, prints a table.
Run from the repo root: `python -m bench.remote_line [--baseline-tree PATH]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench`, `engine`, `protos` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ensure_internal_token, print_table, write_result  # noqa: E402
from bench.serve_host import VOCAB, make_model  # noqa: E402
from engine.internal_auth import internal_channel  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.serving import sampling_params_to_proto  # noqa: E402
from protos import decode_pb2, decode_pb2_grpc  # noqa: E402
from tandem.launcher import Cluster  # noqa: E402

ensure_internal_token()


@contextmanager
def services_from(tree: Path | None):
    """Children started inside run this tree's code (their cwd and PYTHONPATH), else ours."""
    if tree is None:
        yield
        return
    cwd, old = os.getcwd(), os.environ.get("PYTHONPATH")
    os.chdir(tree)
    os.environ["PYTHONPATH"] = str(tree)
    try:
        yield
    finally:
        os.chdir(cwd)
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


async def drive(args: argparse.Namespace, p_addr: str, d_addr: str, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    stub = decode_pb2_grpc.DecodeStub(internal_channel(d_addr))
    records: list[dict[str, float]] = []

    async def one(rid: str) -> None:
        prompt = [rng.randrange(10, VOCAB) for _ in range(args.prompt_len)]
        req = decode_pb2.GenerateRequest(
            request_id=rid,
            transfer_id=f"t-{rid}",
            prompt_token_ids=prompt,
            params=sampling_params_to_proto(params),
            prefill=[decode_pb2.PrefillTarget(address=p_addr)],
        )
        t0, ttft, final, num_tokens = time.perf_counter(), None, None, 0
        async for resp in stub.Generate(req):
            kind = resp.WhichOneof("kind")
            if kind == "tokens":
                num_tokens += len(resp.tokens.token_ids)
                ttft = ttft if ttft is not None else time.perf_counter() - t0
            elif kind == "final":
                final = resp.final
            else:
                raise RuntimeError(f"{rid}: {resp.error}")
        if final is None or num_tokens != args.max_tokens:
            raise RuntimeError(f"{rid}: {num_tokens} tokens, final {final}")
        t = final.timings
        records.append(
            {
                "ttft_s": ttft,
                "setup_s": t.remote_setup_s,
                "rpc_s": t.remote_rpc_s,
                "local": float(t.local_prefill),
            }
        )

    async def stream(i: int) -> None:
        for k in range(args.requests):
            await one(f"s{seed}-{i}-{k}")

    start = time.perf_counter()
    await asyncio.gather(*(stream(i) for i in range(args.streams)))
    wall_s = time.perf_counter() - start

    def ms(key: str) -> dict[str, float]:
        xs = sorted(1e3 * r[key] for r in records)
        pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
        return {"mean": round(statistics.fmean(xs), 1), "p50": round(pick(0.5), 1),
                "p99": round(pick(0.99), 1)}  # fmt: skip

    return {
        "num_requests": len(records),
        "num_local_prefills": int(sum(r["local"] for r in records)),
        "wall_s": round(wall_s, 2),
        "output_tok_s": round(len(records) * args.max_tokens / wall_s, 1),
        "remote_setup_ms": ms("setup_s"),
        "remote_rpc_ms": ms("rpc_s"),
        "ttft_ms": ms("ttft_s"),
    }


def run_once(args: argparse.Namespace, model: str, tree: Path | None, seed: int) -> dict[str, Any]:
    flags = [model, "--max-model-len", "512", "--no-enable-prefix-caching"]
    cluster = Cluster(log_prefix=False)
    try:
        with services_from(tree):
            prefill = cluster.start("prefill", flags)
            decode = cluster.start(
                "decode", [*flags, "--num-gpu-blocks-override", str(args.decode_blocks)]
            )
        return asyncio.run(drive(args, prefill.address, decode.address, seed))
    finally:
        cluster.stop()


def tree_commit(tree: Path | None) -> str:
    cmd = ["git", "-C", str(tree or "."), "rev-parse", "--short", "HEAD"]
    return subprocess.run(cmd, capture_output=True, text=True).stdout.strip() or "unknown"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--model", help="a checkpoint or hub id instead of the tiny model (prompt ids < 2,048)"
    )
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--requests", type=int, default=4, help="per stream, one after another")
    p.add_argument("--prompt-len", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=32)
    # 10 blocks of 16 tokens a request: 24 of the 32 streams' first requests fit.
    p.add_argument("--decode-blocks", type=int, default=241)
    p.add_argument("--baseline-tree", type=Path)
    p.add_argument("--tag", help="in the result's file name")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    trees: dict[str, Path | None] = {"current": None}
    if args.baseline_tree:
        trees["baseline"] = args.baseline_tree
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    tmp = tempfile.TemporaryDirectory()
    model = args.model or str(make_model(Path(tmp.name)))
    for r in range(args.rounds):
        order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))
        for name, tree in order:
            runs[name].append(run_once(args, model, tree, seed=r))
            print(f"round {r} {name}: {runs[name][-1]}", flush=True)
    config = {k: v for k, v in vars(args).items() if k != "baseline_tree"}
    config["commits"] = {name: tree_commit(tree) for name, tree in trees.items()}
    path = write_result("_".join(["remote_line", *filter(None, [args.tag])]), config, runs)
    tmp.cleanup()
    rows = [
        (name, str(i), str(x["remote_setup_ms"]["mean"]), str(x["remote_setup_ms"]["p99"]),
         str(x["ttft_ms"]["p50"]), str(x["output_tok_s"]), str(x["num_local_prefills"]))
        for name, xs in runs.items() for i, x in enumerate(xs)
    ]  # fmt: skip
    print_table(rows, ("tree", "round", "setup mean ms", "setup p99", "TTFT p50", "tok/s", "local"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
