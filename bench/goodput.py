"""Goodput under SLO on two GPUs: disaggregated (A), two colocated replicas (B), Tandem's pick (C).

Issue "Disaggregation that pays". Qwen3-8B shape, dummy bf16 weights, the real Qwen vocabulary;
one `tandem serve` per arrangement, on the two GPUs of one host (services are spread over the
GPUs in start order, `tandem serve --num-gpus 2`):

- A: 1 prefill (GPU 0) + 1 decode (GPU 1), every prompt prefilled remotely (`--prefill-policy
  remote`), KV over UCX between the GPUs;
- B: 2 decodes that prefill locally (colocated), one per GPU, behind one gateway (KV-aware
  routing);
- C: 2 kv_both decodes (`--decode-kv-role kv_both`): each is a colocated replica and a prefill
  for the other; the gateway's cost model decides per request whether to prefill locally or on
  the other GPU (and its decisions go to a route log with predicted and measured TTFT).

Workloads (`tandem bench serve`, custom JSONL datasets written here, a fixed seed per point and
new prompts at every point): prefill_heavy 3,000 in / 150 out; decode_heavy 200 / 1,000; chat
(lognormal lengths, mean ~700 / ~250); multi_turn (8 shared 1,000-token system prompts,
conversations of 6 turns ordered by turn, so later turns reuse earlier prefixes).

Goodput (DistServe): the highest request rate at which >= 90% of requests meet TTFT <= 1 s (2 s
for prefill_heavy) and TPOT <= 30 ms (failed requests count as misses). Rates rise
geometrically from a start rate until attainment drops below 90%, then one bisection; goodput is
the 90% crossing, linearly interpolated between the last rate that met it and the first that did
not. Poisson arrivals, `--arrival-s` seconds of arrivals per rate.

    python -m bench.goodput --configs A --out-dir $OUT         # one arrangement per device call
    python -m bench.goodput --summarize DIR [DIR ...]           # merge, plot, write the summary

Writes `goodput-<config>.json` per arrangement (every point's attainment and latency summary,
the cost model's TTFT prediction error from its route log) and, with --summarize,
`bench/results/goodput-<date>.json` ({"gpus", "workloads": {w: {"goodput_rps": {A, B, C}}}})
with `goodput-<date>-<workload>.png` attainment-vs-rate plots.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import io
import json
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS_DIR, print_table, today, write_result
from bench.serve_gpu import route_lines_after, start_serve, stop_serve

SLO_TPOT_MS = 30.0
ATTAINMENT = 0.9
WORKLOADS = {  # name: (TTFT SLO ms, start rate req/s)
    "prefill_heavy": (2000.0, 4.0),
    "decode_heavy": (1000.0, 4.0),
    "chat": (1000.0, 8.0),
    "multi_turn": (1000.0, 8.0),
}
CONFIGS = {  # by the number of GPUs
    2: {
        "A": ["--num-prefill", "1", "--num-decode", "1", "--prefill-policy", "remote"],
        "B": ["--num-prefill", "0", "--num-decode", "2"],
        "C": ["--num-prefill", "0", "--num-decode", "2", "--decode-kv-role", "kv_both"],
    },
    # Where only one GPU is lent: P and D share it (each half the memory), against one
    # colocated replica; C lets the cost model prefill on D whenever P/D does not pay.
    1: {
        "A": ["--num-prefill", "1", "--num-decode", "1", "--prefill-policy", "remote"],
        "B": ["--num-prefill", "0", "--num-decode", "1"],
        "C": ["--num-prefill", "1", "--num-decode", "1", "--prefill-policy", "auto"],
    },
}
ENGINE_FLAGS = [
    "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "4096",
    "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
]  # fmt: skip
VOCAB = 150_000  # ordinary Qwen tokens (below the special ids)


# ---- datasets --------------------------------------------------------------------------------
# Every rate point gets prompts of its own (a seed per point): prompts repeated across points
# would hit the prefix cache and measure the cache, not the workload. Only multi_turn shares
# something across points, as its users would: the 8 system prompts.
def _text(tok, rng: random.Random, num_tokens: int) -> str:
    return tok.decode([rng.randrange(VOCAB) for _ in range(num_tokens)])


def dataset_rows(workload: str, tok, n: int, seed: int) -> list[tuple[str, int]]:
    """n requests of `workload`: (prompt text, output tokens)."""
    rng = random.Random(seed)
    if workload == "prefill_heavy":
        return [(_text(tok, rng, 3000), 150) for _ in range(n)]
    if workload == "decode_heavy":
        return [(_text(tok, rng, 200), 1000) for _ in range(n)]
    if workload == "chat":  # lognormal: mean = exp(mu + sigma^2 / 2)
        rows = []
        for _ in range(n):
            n_in = int(min(max(rng.lognormvariate(math.log(700) - 0.32, 0.8), 16), 3500))
            n_out = int(min(max(rng.lognormvariate(math.log(250) - 0.18, 0.6), 8), 1000))
            rows.append((_text(tok, rng, n_in), n_out))
        return rows
    assert workload == "multi_turn", workload
    system_rng = random.Random(0)  # the same system prompts at every point
    systems = [_text(tok, system_rng, 1000) for _ in range(8)]
    conversations = [[systems[i % 8]] for i in range(-(-n // 6))]
    rows = []
    for _ in range(6):  # every conversation's turn t before any turn t + 1
        for conv in conversations:
            conv.append(_text(tok, rng, 120))  # the user's message
            rows.append(("".join(conv), 80))
            conv.append(_text(tok, rng, 80))  # the assistant's reply, as the history holds it
    return rows[:n]


def write_dataset(rows: list[tuple[str, int]], path: Path) -> Path:
    lines = [json.dumps({"prompt": p, "output_tokens": n}) for p, n in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- one point -------------------------------------------------------------------------------
def attainment(result: dict, ttft_slo_ms: float) -> float:
    """Share of the requests sent that met both SLOs (a failed request is a miss)."""
    good = 0
    for ttft, e2el, n, err in zip(
        result["ttfts"], result["e2els"], result["output_lens"], result["errors"]
    ):
        if err or n < 1:
            continue
        tpot_ms = (e2el - ttft) / (n - 1) * 1000 if n > 1 else 0.0
        good += ttft * 1000 <= ttft_slo_ms and tpot_ms <= SLO_TPOT_MS
    return good / max(len(result["ttfts"]), 1)


def run_point(
    model: Path, port: int, workload: str, rate: float, args, seed: int, warm: bool
) -> dict:
    """One rate: new prompts (from `seed`); `warm`: first warm the server up (a workload's first
    point)."""
    from tandem.benchmark.flags import build_parser
    from tandem.benchmark.serve import run_benchmark

    arrival_s = args.arrival_s * (3 if workload == "decode_heavy" else 1)
    num_prompts = max(int(rate * arrival_s), 16)
    rows = dataset_rows(workload, args.tokenizer, num_prompts, seed)
    dataset = write_dataset(rows, Path(args.tmp) / f"{workload}-{seed}.jsonl")
    argv = [
        "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}", "--model", str(model),
        "--dataset-name", "custom", "--dataset-path", str(dataset), "--num-prompts",
        str(num_prompts), "--request-rate", str(rate), "--seed", "0", "--ignore-eos",
        "--disable-tqdm", "--disable-shuffle", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99", "--num-warmups", "4" if warm else "0",
        "--save-detailed",
    ]  # fmt: skip
    ns = build_parser().parse_args(argv)
    t = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()):  # its table per point; ours is shorter
        result = asyncio.run(run_benchmark(ns))
    result["wall_s"] = time.monotonic() - t
    return result


def summarize_point(rate: float, r: dict, ttft_slo_ms: float) -> dict:
    return {
        "rate": rate,
        "attainment": attainment(r, ttft_slo_ms),
        "completed": r["completed"],
        "failed": r["failed"],
        "mean_input_len": statistics.mean(r["input_lens"]),
        "output_tok_s": r["output_throughput"],
        **{
            f"{m}_{q}_ms": r[f"{q}_{m}_ms"]
            for m in ("ttft", "tpot", "itl")
            for q in ("median", "p90", "p99")
        },
        "wall_s": r["wall_s"],
    }


def sweep(model: Path, port: int, workload: str, args, deadline: float) -> dict:
    ttft_slo_ms, start = WORKLOADS[workload]
    points: list[dict] = []
    base_seed = 100 * (1 + list(WORKLOADS).index(workload))

    def measure(rate: float) -> dict:
        r = run_point(
            model, port, workload, rate, args, seed=base_seed + len(points), warm=not points
        )
        p = summarize_point(rate, r, ttft_slo_ms)
        points.append(p)
        print(
            f"  {workload} rate {rate:.2f}: attainment {p['attainment']:.2f}, TTFT p90 "
            f"{p['ttft_p90_ms']:.0f} ms, TPOT p90 {p['tpot_p90_ms']:.1f} ms ({p['wall_s']:.0f} s)",
            flush=True,
        )
        return p

    rate, last_ok, first_bad = start * args.start_scale, None, None
    while time.monotonic() < deadline:
        p = measure(rate)
        if p["attainment"] >= ATTAINMENT:
            last_ok = p
            if first_bad:
                break
            rate *= args.factor
        else:
            first_bad = p
            if last_ok or len(points) >= 3:
                break
            rate /= args.factor**2  # the start rate was already too high: step down
    if last_ok and first_bad and time.monotonic() < deadline:  # one bisection
        mid = measure(math.sqrt(last_ok["rate"] * first_bad["rate"]))
        last_ok, first_bad = (mid, first_bad) if mid["attainment"] >= ATTAINMENT else (last_ok, mid)
    return {
        "ttft_slo_ms": ttft_slo_ms,
        "tpot_slo_ms": SLO_TPOT_MS,
        "goodput_rps": goodput(last_ok, first_bad),
        "complete": first_bad is not None,  # False: the deadline came before a rate failed
        "points": sorted(points, key=lambda p: p["rate"]),
    }


def goodput(last_ok: dict | None, first_bad: dict | None) -> float:
    """The 90% crossing between the last rate that met it and the first that did not."""
    if last_ok is None:
        return 0.0
    if first_bad is None:
        return last_ok["rate"]  # a lower bound
    a0, a1 = last_ok["attainment"], first_bad["attainment"]
    f = (a0 - ATTAINMENT) / (a0 - a1) if a0 > a1 else 0.0
    return last_ok["rate"] + f * (first_bad["rate"] - last_ok["rate"])


def route_log_errors(log_lines: list[str]) -> dict:
    """The cost model's TTFT predictions (route log lines) against what the gateway measured."""
    lines = [json.loads(x) for x in log_lines if x.strip()]
    errs = [
        abs(x["measured_ttft_s"] - x["predicted_ttft_s"]) / x["measured_ttft_s"]
        for x in lines
        if x["measured_ttft_s"] > 0
    ]
    if len(errs) < 2:
        return {"num_requests": len(lines)}
    local = sum(x["prefill"] == "" for x in lines)
    last = lines[-1]
    return {
        "num_requests": len(lines),
        "local_prefill_share": local / len(lines),
        "ttft_rel_error_median": statistics.median(errs),
        "ttft_rel_error_p90": statistics.quantiles(errs, n=10, method="inclusive")[8],
        "reasons": dict(sorted(collections.Counter(x["reason"] for x in lines).items())),
        "link_bytes_per_s_last": last["link_bytes_per_s"],
        "remote_overhead_s_last": last["remote_overhead_s"],
    }


# ---- driver ----------------------------------------------------------------------------------
def run_config(config: str, args) -> dict:
    from transformers import AutoTokenizer

    from bench.structured_output import QWEN3_8B, TINY, make_model_dir

    deadline = time.monotonic() + args.budget_s
    out_dir = Path(args.out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model_dir(Path(tmp), TINY if args.tiny else QWEN3_8B)
        args.tokenizer, args.tmp = AutoTokenizer.from_pretrained(model), tmp
        route_log = out_dir / f"goodput-{config}-routes.jsonl"
        route_log.unlink(missing_ok=True)
        port = 8200
        flags = [
            *ENGINE_FLAGS, "--num-gpus", str(args.gpus), *CONFIGS[args.gpus][config],
            "--route-log", str(route_log),
        ]  # fmt: skip
        t = time.monotonic()
        proc, log = start_serve(model, 0, port, extra=flags)
        print(f"{config}: serving after {time.monotonic() - t:.0f} s", flush=True)
        results: dict = {}
        try:
            for w in args.workloads.split(","):
                if time.monotonic() > deadline - 30:
                    print(f"  {w}: skipped (device budget)", flush=True)
                    continue
                before = route_log.read_text().count("\n") if route_log.exists() else 0
                results[w] = sweep(model, port, w, args, deadline)
                completed = sum(p["completed"] for p in results[w]["points"])
                lines = route_lines_after(route_log, before, completed)
                results[w]["routing"] = route_log_errors(lines)
                _save(out_dir, config, args.gpus, results)
        finally:
            stop_serve(proc)
            (out_dir / f"goodput-{config}-serve.log").write_text("".join(log[-400:]))
    return results


def _save(out_dir: Path, config: str, gpus: int, results: dict) -> None:
    flags = CONFIGS[gpus][config]
    payload = {"config": config, "gpus": gpus, "serve_flags": flags, "workloads": results}
    (out_dir / f"goodput-{config}.json").write_text(json.dumps(payload, indent=2) + "\n")


def summarize(dirs: list[Path], results_dir: Path) -> Path:
    from tandem.benchmark.plots import _figure

    by_config, gpus = {}, set()
    for d in dirs:
        for f in sorted(d.glob("goodput-[ABC].json")):
            data = json.loads(f.read_text())
            by_config[data["config"]] = data["workloads"]
            gpus.add(data.get("gpus", 2))
    if len(gpus) != 1:
        raise SystemExit(f"the runs to merge used different GPU counts {sorted(gpus)}")
    (num_gpus,) = gpus
    workloads = {}
    for w in WORKLOADS:
        g = {c: by_config[c][w]["goodput_rps"] for c in sorted(by_config) if w in by_config[c]}
        if not g:  # not run
            continue
        entry = {"goodput_rps": g}
        if "B" in g and g["B"] > 0:
            entry["over_B"] = {c: round(v / g["B"], 3) for c, v in g.items()}
        entry["points"] = {c: by_config[c][w]["points"] for c in g}
        entry["routing"] = {c: by_config[c][w].get("routing", {}) for c in g}
        workloads[w] = entry
        fig, (ax,) = _figure(1, 1)
        for c in g:
            pts = by_config[c][w]["points"]
            ax.plot([p["rate"] for p in pts], [p["attainment"] for p in pts], "o-", label=c)
        ax.axhline(ATTAINMENT, color="grey", linestyle=":")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment")
        ax.set_title(f"{w}: TTFT <= {WORKLOADS[w][0] / 1000:g} s, TPOT <= {SLO_TPOT_MS:g} ms")
        ax.legend()
        fig.savefig(results_dir / f"goodput-{today()}-{num_gpus}gpu-{w}.png", dpi=100)
    config = {
        "model_shape": "qwen3-8b",
        "engine_flags": ENGINE_FLAGS,
        "configs": CONFIGS[num_gpus],
        "slo": {"tpot_ms": SLO_TPOT_MS, "attainment": ATTAINMENT},
    }
    summary = {"gpus": num_gpus, "workloads": workloads}
    name = "goodput" if num_gpus == 2 else f"goodput_{num_gpus}gpu"
    path = write_result(name, config, summary, results_dir)
    path.write_text(json.dumps({**summary, **json.loads(path.read_text())}, indent=2) + "\n")
    rows = [
        (w, *(f"{workloads[w]['goodput_rps'].get(c, float('nan')):.2f}" for c in "ABC"))
        for w in workloads
    ]
    print_table(rows, ("workload", "A rps", "B rps", "C rps"))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="A,B,C")
    ap.add_argument(
        "--gpus", type=int, choices=sorted(CONFIGS), default=2,
        help="2: the study as specified; 1: P and D share one GPU, against one replica",
    )  # fmt: skip
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--out-dir", default=os.environ.get("OUT", str(RESULTS_DIR)))
    ap.add_argument(
        "--arrival-s",
        type=float,
        default=20.0,
        help="seconds of arrivals per rate (x3 for decode_heavy, whose requests last ~20 s: "
        "shorter windows measure a burst, not the steady state)",
    )
    ap.add_argument("--factor", type=float, default=1.6, help="rate step between points")
    ap.add_argument("--start-scale", type=float, default=1.0, help="x each workload's start rate")
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop sweeping after this")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (a CPU smoke run)")
    ap.add_argument("--summarize", nargs="+", type=Path, help="merge goodput-[ABC].json files")
    args = ap.parse_args()
    if args.summarize:
        print(summarize(args.summarize, Path(args.out_dir)))
        return
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    for c in args.configs.split(","):
        run_config(c, args)


if __name__ == "__main__":
    main()
