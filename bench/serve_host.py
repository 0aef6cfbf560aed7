"""The engine thread's host time per step: offline `LLM.generate` vs the decode service under
streaming load, on CPU with a tiny model so that host work dominates (issue "The server as fast
as the engine").

Workload (both sides): N random prompts of `--prompt-len` tokens, `--max-tokens` out with
ignore_eos, greedy, `--max-num-seqs` / `--max-num-batched-tokens` as the H200 job (256 / 8192),
the tests' tiny Qwen3 shape with dummy weights (hidden 64, 2 layers, 2,048 tokens).
1. offline: `LLM.generate` on all N prompts at once;
2. service: a `tandem decode` child (colocated: it prefills locally), driven by this process
   over one `GenerateMux` stream (the gateway's client, `gateway.mux.DecodeGenerate`) with
   `--concurrency` requests in flight until N are done; no gateway, no HTTP.

In both, the engine's own calls are timed on the engine thread: `EngineCore.step` and, inside it,
`ModelRunner.execute` / `launch_decode` (the model: what the GPU would do), and in the service
the loop's `_dispatch` (outputs to the streams), hooks and commands. The figure is the engine
thread's time per step outside the model, i.e. the iteration period (one step start to the
next) minus the model's time, split into: the step's own host work (scheduling, applying
tokens: the same code offline), dispatch, hooks, commands, and the rest (the loop itself and
waits for the GIL, which the event loop holds while it handles the streams). Thread CPU time
is recorded beside it: period minus CPU time is time the engine thread was not running.

    python -m bench.serve_host [--out-dir bench/results] [--tag NAME]
Writes `serve_host_cpu-<date>.json` (or `<tag>-<date>.json`) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ensure_internal_token, print_table, process_cpu_s, write_result  # noqa: E402


def make_model(root: Path) -> Path:
    """The tests' tiny Qwen3 (hidden 64, 2 layers, a 2,048-token byte-level BPE vocabulary):
    the service needs its tokenizer (EOS ids, chat template); weights are dummy anyway."""
    from tests.fixtures.tiny_models import VOCAB_SIZE, make_tiny_checkpoint

    assert VOCAB_SIZE > 10
    return make_tiny_checkpoint("qwen3", root / "tiny")


VOCAB = 2048  # tests/fixtures/tiny_models.py VOCAB_SIZE


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, VOCAB) for _ in range(length)] for _ in range(n)]


# ---- engine-thread timers -----------------------------------------------------------------
class Timers:
    """Accumulated on the engine thread while `on`; read after it stops."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.on = False
        self.num_steps = 0
        self.first_start = self.last_start = None
        self.t = dict(step=0.0, model=0.0, dispatch=0.0, hooks=0.0, commands=0.0)
        self.cpu = dict.fromkeys(self.t, 0.0)  # the same, in the engine thread's CPU time
        self.thread_cpu_start = None
        self.thread_cpu = 0.0
        self.periods: list[float] = []
        self.batch_sizes: list[int] = []

    def summary(self) -> dict:
        n = self.num_steps
        if n < 2:
            raise RuntimeError(f"only {n} steps measured")
        # Periods: one step start to the next (the last step's period is not known: dropped,
        # with its own times scaled away by using the mean over the n - 1 full periods).
        wall = self.last_start - self.first_start
        per = {k: 1e3 * v / n for k, v in self.t.items()}
        period_ms = 1e3 * wall / (n - 1)
        outside = period_ms - per["model"]
        step_host = per["step"] - per["model"]
        rest = outside - step_host - per["dispatch"] - per["hooks"] - per["commands"]
        return {
            "num_steps": n,
            "mean_batch": round(statistics.fmean(self.batch_sizes), 1),
            "period_ms": round(period_ms, 3),
            "model_ms": round(per["model"], 3),
            "outside_model_ms": round(outside, 3),
            "step_host_ms": round(step_host, 3),
            "dispatch_ms": round(per["dispatch"], 3),
            "hooks_ms": round(per["hooks"], 3),
            "commands_ms": round(per["commands"], 3),
            "rest_ms": round(rest, 3),
            "thread_cpu_ms": round(1e3 * self.thread_cpu / (n - 1), 3),
            # The engine thread's own work outside the model (CPU time: no GIL waits in it),
            # and the rest of the time outside the model: waiting for the GIL or a core.
            "host_cpu_ms": round(1e3 * self.thread_cpu / (n - 1) - 1e3 * self.cpu["model"] / n, 3),
            "host_waiting_ms": round(
                outside - 1e3 * self.thread_cpu / (n - 1) + 1e3 * self.cpu["model"] / n, 3
            ),
            "not_running_ms": round(period_ms - 1e3 * self.thread_cpu / (n - 1), 3),
        }


TIMERS = Timers()


def _timed(fn, key: str):
    def wrapper(*args, **kwargs):
        if not TIMERS.on:
            return fn(*args, **kwargs)
        t, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMERS.t[key] += time.perf_counter() - t
            TIMERS.cpu[key] += time.thread_time() - cpu

    return wrapper


def install_timers() -> None:
    """Class-level wrappers: every engine built after this is timed."""
    from engine.async_engine import AsyncEngine
    from engine.engine_core import EngineCore
    from engine.model_runner import ModelRunner

    ModelRunner.execute = _timed(ModelRunner.execute, "model")
    ModelRunner.launch_decode = _timed(ModelRunner.launch_decode, "model")
    AsyncEngine._dispatch = _timed(AsyncEngine._dispatch, "dispatch")
    AsyncEngine._run_hook = _timed(AsyncEngine._run_hook, "hooks")
    AsyncEngine._drain_commands = _timed(AsyncEngine._drain_commands, "commands")
    AsyncEngine._wait_for_command = _timed(AsyncEngine._wait_for_command, "commands")
    step = EngineCore.step

    def timed_step(self):
        if not TIMERS.on:
            return step(self)
        t = time.perf_counter()
        if TIMERS.first_start is None:
            TIMERS.first_start = t
            TIMERS.thread_cpu_start = time.thread_time()
        TIMERS.last_start = t
        TIMERS.thread_cpu = time.thread_time() - TIMERS.thread_cpu_start
        TIMERS.batch_sizes.append(len(self.scheduler.running))
        try:
            return step(self)
        finally:
            TIMERS.num_steps += 1
            TIMERS.t["step"] += time.perf_counter() - t

    EngineCore.step = timed_step


# ---- offline --------------------------------------------------------------------------------
def torch_threads() -> None:
    """One torch thread on both sides: the model's own threads would compete for this machine's
    few cores with the event loop and the client, which the figures here are about."""
    import torch

    torch.set_num_threads(int(os.environ.get("SERVE_HOST_TORCH_THREADS", "1")))


def run_offline(path: Path, args) -> dict:
    from engine import LLM, SamplingParams

    torch_threads()

    llm = LLM(
        str(path),
        load_format="dummy",
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
    )
    warm = [{"prompt_token_ids": p} for p in prompts(16, args.prompt_len, 1)]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=4))
    ps = [{"prompt_token_ids": p} for p in prompts(args.num_prompts, args.prompt_len, 2)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    TIMERS.reset()
    TIMERS.on = True
    t = time.perf_counter()
    outs = llm.generate(ps, params)
    wall = time.perf_counter() - t
    TIMERS.on = False
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": round(wall, 2), "output_tok_s": round(tokens / wall, 1)} | TIMERS.summary()


# ---- the service child ----------------------------------------------------------------------
def child_main(argv: list[str]) -> None:
    """`tandem decode argv` with the timers; SIGUSR1 starts them, SIGUSR2 writes them out."""
    install_timers()
    torch_threads()
    out = os.environ["SERVE_HOST_STATS"]
    interval = os.environ.get("SERVE_HOST_SWITCH_INTERVAL")
    if interval:  # an experiment: this interval in place of the service's own
        sys.setswitchinterval(float(interval))
        sys.setswitchinterval = lambda _: None

    def start(*_):
        TIMERS.reset()
        TIMERS.on = True

    def dump(*_):
        TIMERS.on = False
        Path(out).write_text(json.dumps(TIMERS.summary()))

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, dump)
    from decode_svc.server import main

    main(argv)


def service_argv(path: Path, args) -> list[str]:
    return [
        str(path), "--load-format", "dummy", "--dtype", "float32", "--device", "cpu",
        "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--no-enable-prefix-caching", "--kv-backend", "inproc", "--port", "0",
    ]  # fmt: skip


async def drive(address: str, args, proc: subprocess.Popen, stats_path: Path) -> dict:
    from engine.internal_auth import internal_channel
    from engine.params_proto import sampling_params_to_proto
    from engine.sampling_params import SamplingParams
    from gateway.mux import DecodeGenerate
    from protos import decode_pb2, decode_pb2_grpc

    channel = internal_channel(address)
    gen = DecodeGenerate(decode_pb2_grpc.DecodeStub(channel), address)
    params = sampling_params_to_proto(
        SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    )
    itls: list[float] = []

    async def one(i: int, prompt: list[int], record: bool) -> int:
        call = gen(
            decode_pb2.GenerateRequest(request_id=f"r{i}", prompt_token_ids=prompt, params=params)
        )
        n, last = 0, None
        while True:
            msg = await call.read()
            if msg is grpc_eof:
                return n
            if msg.HasField("tokens") and msg.tokens.token_ids:
                now = time.perf_counter()
                if record and last is not None:
                    itls.append(now - last)
                last = now
                n += len(msg.tokens.token_ids)

    import grpc

    grpc_eof = grpc.aio.EOF

    async def load(ps: list[list[int]], base: int, record: bool) -> int:
        sem = asyncio.Semaphore(args.concurrency)

        async def limited(i, p):
            async with sem:
                return await one(base + i, p, record)

        return sum(await asyncio.gather(*(limited(i, p) for i, p in enumerate(ps))))

    await load(prompts(16, args.prompt_len, 1), 0, False)  # warm-up
    ps = prompts(args.num_prompts, args.prompt_len, 2)
    cpu0 = process_cpu_s(proc.pid)
    proc.send_signal(signal.SIGUSR1)
    t = time.perf_counter()
    tokens = await load(ps, 1000, True)
    wall = time.perf_counter() - t
    proc.send_signal(signal.SIGUSR2)
    cpu = process_cpu_s(proc.pid) - cpu0
    gen.close()
    await channel.close()
    deadline = time.monotonic() + 30
    while not stats_path.exists() or not stats_path.read_text():
        if time.monotonic() > deadline:
            raise RuntimeError("the service wrote no timers")
        await asyncio.sleep(0.05)
    itls.sort()
    return {
        "wall_s": round(wall, 2),
        "output_tok_s": round(tokens / wall, 1),
        "service_cpu_s": round(cpu, 2),
        "itl_p50_ms": round(1e3 * itls[len(itls) // 2], 2),
        "itl_p99_ms": round(1e3 * itls[int(len(itls) * 0.99)], 2),
    } | loop_cpu(json.loads(stats_path.read_text()), cpu)


def loop_cpu(timers: dict, service_cpu_s: float) -> dict:
    """`other_threads_cpu_ms`: the service's CPU time per step beyond the engine thread's: the
    event loop (gRPC, the streams) and gRPC's own threads (torch runs one thread here)."""
    per_step_ms = 1e3 * service_cpu_s / timers["num_steps"]
    return timers | {"other_threads_cpu_ms": round(per_step_ms - timers["thread_cpu_ms"], 3)}


def run_service(path: Path, args, tmp: Path, code: str | None = None) -> dict:
    """One service run; `code`: a checkout whose engine and services the child runs (the
    bench's own timers with it), for a before/after in one run."""
    stats_path = tmp / "stats.json"
    stats_path.unlink(missing_ok=True)
    env = dict(os.environ, SERVE_HOST_STATS=str(stats_path))
    if args.switch_interval:
        env["SERVE_HOST_SWITCH_INTERVAL"] = str(args.switch_interval)
    if code is not None:
        env["PYTHONPATH"] = code
    cmd = [sys.executable, "-m", "bench.serve_host", "--child", *service_argv(path, args)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=code
    )
    lines: list[str] = []
    try:
        address = None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("READY "):
                address = line.split()[2]
                break
        if address is None:
            raise RuntimeError("decode did not come up:\n" + "".join(lines[-30:]))
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
        return asyncio.run(drive(address, args, proc, stats_path))
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.returncode not in (0, -signal.SIGTERM):
            print("".join(lines[-30:]), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child_main(argv[1:])
        return 0
    p = argparse.ArgumentParser("bench.serve_host", description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--sides", default="offline,service")
    p.add_argument("--repeats", type=int, default=1, help="service runs (each side)")
    p.add_argument(
        "--baseline",
        default=None,
        help="a checkout (e.g. `git archive` of the base commit) whose service runs too, "
        "alternating with this one's: the before of a before/after",
    )
    p.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="the service's sys.setswitchinterval, in place of its own (an experiment)",
    )
    p.add_argument("--out-dir", default=None, help="write the JSON here (default: print only)")
    p.add_argument("--tag", default="serve_host_cpu")
    args = p.parse_args(argv)
    ensure_internal_token()
    install_timers()
    sides = args.sides.split(",")
    figures: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp))
        if "offline" in sides:
            figures["offline"] = run_offline(path, args)
        if "service" in sides:
            runs, base = [], []
            for _ in range(args.repeats):
                if args.baseline:
                    base.append(run_service(path, args, Path(tmp), args.baseline))
                runs.append(run_service(path, args, Path(tmp)))
            if base:
                figures["service_baseline"] = base
            figures["service"] = runs
    keys = (
        "output_tok_s", "mean_batch", "period_ms", "model_ms", "outside_model_ms", "step_host_ms",
        "dispatch_ms", "hooks_ms", "commands_ms", "rest_ms", "host_cpu_ms", "host_waiting_ms",
        "itl_p50_ms", "other_threads_cpu_ms",
    )  # fmt: skip
    rows = []
    for side, f in figures.items():
        for k, run in enumerate(f if isinstance(f, list) else [f]):
            rows.append((f"{side}{k}", *(str(run.get(key, "")) for key in keys)))
    print_table(rows, ("side", *keys))
    if args.out_dir:
        config = {k: v for k, v in vars(args).items() if k not in ("out_dir", "tag")} | {
            "model": "tests/fixtures/tiny_models.py qwen3, dummy weights"
        }
        print("wrote", write_result(args.tag, config, figures, Path(args.out_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
