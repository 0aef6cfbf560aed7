"""`tandem bench serve`: figures exact on a virtual clock against a stub whose timings are
known; the CLI over real HTTP (sweep, result file, plots); a smoke run against `tandem serve`."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from engine.lifeline import child_env
from engine.light_tokenizer import LightTokenizer
from engine.tokenizer import load_tokenizer
from tandem.benchmark.datasets import (
    SampleRequest,
    _decode_to_len,
    custom_rows,
    file_requests,
    random_requests,
    roundtrip_tokens,
    sharegpt_rows,
)
from tandem.benchmark.metrics import calculate_metrics, parse_goodput
from tandem.benchmark.runner import LoadPoint, Target, arrival_offsets_s, run_load
from tandem.benchmark.serve import load_tokenizer as load_bench_tokenizer
from tandem.cli import main as tandem_main
from tests.integration.services import start_tandem_serve
from tests.tandem.bench_stub import StubServer, StubSession, run_virtual

ALL = ["ttft", "tpot", "itl", "e2el"]
URL = {"openai": "http://stub/v1/completions", "openai-chat": "http://stub/v1/chat/completions"}


def _run(
    prompts: list[str],
    point: LoadPoint | None = None,
    backend="openai",
    num_tokens=8,
    tokenizer=None,
    goodput_ms=None,
):
    """Send `prompts` to a `StubSession` on a virtual clock: (metrics, outputs, stub)."""
    stub = StubSession()
    target = Target(URL[backend], backend, "m", {})
    requests = [SampleRequest(p, 10, num_tokens) for p in prompts]
    outputs, duration_s = run_virtual(
        lambda clock: run_load(
            target, requests, point or LoadPoint(), seed=3, clock=clock, session=stub
        )
    )
    result = calculate_metrics(
        requests, outputs, duration_s, tokenizer, [50, 99], ALL, goodput_ms or {}
    )
    return result, outputs, stub


def approx(x):
    return pytest.approx(x, abs=1e-9)


# ---- figures ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_figures_are_the_stubs_timings_exactly(backend):
    # Stub: first token after 50 ms, then one every 10 ms, 8 tokens, usage last.
    r, outputs, stub = _run(["hi"] * 6, backend=backend)
    assert [o.ttft_s for o in outputs] == [approx(0.05)] * 6  # chat's empty role chunk: no token
    assert all(o.itl_s == [approx(0.01)] * 7 for o in outputs)
    assert all(b["stream_options"] == {"include_usage": True} for b in stub.stats.bodies)
    for m, ms in {"ttft": 50, "tpot": 10, "itl": 10, "e2el": 120}.items():
        for stat in ("mean", "median", "p50", "p99"):
            assert r[f"{stat}_{m}_ms"] == approx(ms), (stat, m)
        assert r[f"std_{m}_ms"] == approx(0)
    assert r["duration"] == approx(0.12)  # all six at once
    assert (r["completed"], r["failed"], r["error_counts"]) == (6, 0, {})
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (60, 48)
    assert r["request_throughput"] == approx(6 / 0.12)
    assert r["output_throughput"] == approx(48 / 0.12)
    assert r["total_token_throughput"] == approx(108 / 0.12)
    assert r["request_goodput"] is None  # no SLO given
    assert r["output_lens"] == [8] * 6


def test_goodput_counts_exactly_the_requests_meeting_every_slo():
    # TTFT 20 or 80 ms x ITL 5 or 15 ms; 8 tokens: E2EL = TTFT + 7 ITL, TPOT = ITL.
    prompts = [f"ttft_ms={t} itl_ms={i}" for t in (20, 80) for i in (5, 15)] * 2
    cases = {
        ("ttft:50",): 4,
        ("tpot:10",): 4,
        ("ttft:50", "tpot:10"): 2,
        ("e2el:120",): 4,  # E2ELs 55, 125, 115, 185 ms
        ("e2el:60",): 2,
        ("ttft:10",): 0,
        ("ttft:90", "tpot:20", "e2el:200"): 8,
    }
    for slos, good in cases.items():
        r, _, _ = _run(prompts, goodput_ms=parse_goodput(list(slos)))
        assert r["duration"] == approx(0.08 + 7 * 0.015)
        assert r["request_goodput"] * r["duration"] == pytest.approx(good), slos
    with pytest.raises(ValueError, match="KEY:MS"):
        parse_goodput(["itl:5"])


def test_failed_requests_are_counted_with_their_errors():
    prompts = ["ok", "status=500", "ok", "error_after=3", "status=503", "ok"]
    r, outputs, _ = _run(prompts)
    assert (r["completed"], r["failed"]) == (3, 3)
    assert r["error_counts"] == {
        'HTTP 500: {"error": {"message": "stub failure", "code": 500}}': 1,
        'HTTP 503: {"error": {"message": "stub failure", "code": 503}}': 1,
        "stream error: boom": 1,
    }
    assert [bool(e) for e in r["errors"]] == [False, True, False, True, True, False]
    assert r["output_lens"] == [8, 0, 8, 0, 0, 8]
    assert r["total_input_tokens"] == 30  # completed requests only, as vLLM
    assert r["mean_ttft_ms"] == approx(50)  # failures are in no latency figure


def test_a_refused_connection_is_a_failed_request_not_a_crash():
    target = Target("http://127.0.0.1:9/v1/completions", "openai", "m", {})
    outputs, _ = asyncio.run(run_load(target, [SampleRequest("x", 1, 2)], LoadPoint()))
    assert not outputs[0].is_success and outputs[0].error.startswith("ClientConnectorError")


def test_output_tokens_are_counted_with_the_tokenizer_without_usage(tiny_qwen3_path):
    tokenizer = load_tokenizer(tiny_qwen3_path)
    r, outputs, _ = _run(["no_usage"] * 2, num_tokens=6, tokenizer=tokenizer)
    text = outputs[0].generated_text
    assert text == "the time of year people way" and outputs[0].output_tokens == 0
    n = len(tokenizer.encode(text, add_special_tokens=False))
    assert r["output_lens"] == [n, n]
    assert r["mean_tpot_ms"] == approx((100 - 50) / (n - 1))  # E2EL 100 ms, TTFT 50 ms
    with pytest.raises(ValueError, match="--tokenizer"):
        _run(["no_usage"])


# ---- load ------------------------------------------------------------------------------------
def test_poisson_arrivals_are_seeded_and_keep_the_mean_rate():
    a = arrival_offsets_s(2000, 4.0, 1.0, seed=7)
    assert a == arrival_offsets_s(2000, 4.0, 1.0, seed=7)
    assert a != arrival_offsets_s(2000, 4.0, 1.0, seed=8)
    assert a[-1] == pytest.approx(2000 / 4.0)  # vLLM's normalisation: the mean rate exactly
    gaps = np.diff([0.0, *a])
    assert np.all(gaps > 0)
    cv = {k: np.std(np.diff([0.0, *arrival_offsets_s(2000, 4.0, k, 1)])) * 4.0 for k in (1, 4)}
    assert cv[1] == pytest.approx(1.0, abs=0.1)  # exponential gaps: std = mean
    assert cv[4] == pytest.approx(0.5, abs=0.05)  # gamma shape k: std = mean / sqrt(k)
    assert arrival_offsets_s(4, 2.0, math.inf, 0) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert arrival_offsets_s(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]


def test_requests_leave_at_their_arrival_times():
    point = LoadPoint(request_rate=20.0)
    _, outputs, stub = _run(["hi"] * 10, point=point)
    expected = arrival_offsets_s(10, 20.0, 1.0, seed=3)
    assert stub.stats.arrival_s == pytest.approx(expected, abs=1e-9)
    assert [o.start_s for o in outputs] == pytest.approx(expected, abs=1e-9)


def test_max_concurrency_is_respected():
    r, outputs, stub = _run(["hi"] * 20, point=LoadPoint(max_concurrency=3))
    assert stub.stats.peak == 3
    assert r["duration"] == approx(7 * 0.12)  # ceil(20 / 3) waves of one 120 ms request
    assert r["mean_ttft_ms"] == approx(50)  # a request's clock starts when it is sent


# ---- datasets ----------------------------------------------------------------------------------
def test_random_prompts_have_their_exact_token_lengths(tiny_qwen3_path):
    tokenizer = load_tokenizer(tiny_qwen3_path)
    reqs = random_requests(tokenizer, 50, 32, 16, range_ratio=0.5, prefix_len=8, seed=1)
    assert reqs == random_requests(tokenizer, 50, 32, 16, range_ratio=0.5, prefix_len=8, seed=1)
    rng = np.random.default_rng(1)  # vLLM's draw order: input lengths, then output lengths
    in_lens, out_lens = rng.integers(16, 49, size=50), rng.integers(8, 25, size=50)
    for req, n_in, n_out in zip(reqs, in_lens, out_lens):
        assert len(tokenizer.encode(req.prompt, add_special_tokens=False)) == req.prompt_len
        assert (req.prompt_len, req.expected_output_len) == (8 + n_in, n_out)
    prefix = tokenizer.decode(tokenizer.encode(reqs[0].prompt, add_special_tokens=False)[:8])
    assert sum(r.prompt.startswith(prefix) for r in reqs) >= 45  # one shared prefix


def test_random_prompts_batched_equal_one_at_a_time(tiny_qwen3_path):
    """The first decode + encode of every prompt runs as one batch; the prompts (and the rng's
    draws for the ones that need padding) are those of the one-at-a-time loop, with the light
    tokenizer `bench serve` loads and with transformers' own."""
    light = load_bench_tokenizer(str(tiny_qwen3_path))
    assert isinstance(light, LightTokenizer)
    for tokenizer in (light, load_tokenizer(tiny_qwen3_path)):
        for seed in (0, 3):
            rng = np.random.default_rng(seed)  # random_requests' own draws, in its order
            in_lens, out_lens = rng.integers(16, 49, size=40), rng.integers(8, 25, size=40)
            offsets = rng.integers(0, tokenizer.vocab_size, size=40)
            allowed = roundtrip_tokens(tokenizer)
            prefix = allowed[rng.integers(0, len(allowed), size=8)].tolist()
            expected = []
            for i in range(40):
                inner = allowed[(offsets[i] + i + np.arange(in_lens[i])) % len(allowed)]
                text, n = _decode_to_len(tokenizer, prefix + inner.tolist(), 8 + int(in_lens[i]),
                                         allowed, rng)  # fmt: skip
                expected.append((text, n, int(out_lens[i])))
            reqs = random_requests(tokenizer, 40, 32, 16, range_ratio=0.5, prefix_len=8, seed=seed)
            assert [(r.prompt, r.prompt_len, r.expected_output_len) for r in reqs] == expected


def test_sharegpt_and_custom_files(tmp_path, tiny_qwen3_path):
    tokenizer = load_tokenizer(tiny_qwen3_path)
    long = "the time of the year " * 3
    convs = [
        {
            "conversations": [
                {"from": "human", "value": f"{long} {i}"},
                {"from": "gpt", "value": long},
            ]
        }
        for i in range(5)
    ]
    convs.append({"conversations": [{"from": "human", "value": "hi"}]})  # one turn: skipped
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    rows = sharegpt_rows(tmp_path / "sg.json", None)
    reqs = file_requests(rows, tokenizer, 8, seed=0, is_sharegpt=True)
    assert len(reqs) == 8  # 5 conversations, oversampled
    assert {r.expected_output_len for r in reqs} == {len(tokenizer.encode(long))}
    assert reqs == file_requests(rows, tokenizer, 8, seed=0, is_sharegpt=True)
    (tmp_path / "c.jsonl").write_text('{"prompt": "a b", "output_tokens": 3}\n{"prompt": "c"}\n')
    reqs = file_requests(custom_rows(tmp_path / "c.jsonl", 256), tokenizer, 2, 0, shuffle=False)
    assert [(r.prompt, r.expected_output_len) for r in reqs] == [("a b", 3), ("c", 256)]


# ---- the CLI over HTTP -------------------------------------------------------------------------
def test_cli_sweep_against_a_stub_http_server(tmp_path, tiny_qwen3_path):
    lines = [{"prompt": "hello", "output_tokens": 6}] * 10 + [{"prompt": "status=500"}] * 2
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    with StubServer() as stub:
        rc = tandem_main(
            [
                "bench",
                "serve",
                "--backend",
                "openai-chat",
                "--base-url",
                stub.base_url + "/v1",
                "--model",
                "m",
                "--tokenizer",
                str(tiny_qwen3_path),
                "--dataset-name",
                "custom",
                "--dataset-path",
                str(tmp_path / "d.jsonl"),
                "--disable-shuffle",
                "--num-prompts",
                "12",
                "--sweep",
                "concurrency:1,4",
                "--goodput",
                "ttft:5000",
                "--metric-percentiles",
                "50,90,99",
                "--save-result",
                "--save-detailed",
                "--plot",
                "--result-dir",
                str(tmp_path / "out"),
                "--result-filename",
                "r.json",
                "--disable-tqdm",
                "--ready-check-timeout-sec",
                "10",
            ]
        )
    assert rc == 0
    saved = json.loads((tmp_path / "out" / "r.json").read_text())
    assert saved["backend"] == "openai-chat" and saved["sweep"] == {
        "axis": "concurrency",
        "values": [1.0, 4.0],
    }
    # In flight at each arrival: the ready check, then 12 requests per point.
    in_flight = stub.stats.in_flight_at_arrival
    assert len(in_flight) == 25 and max(in_flight[1:13]) == 1 and max(in_flight[13:]) == 4
    assert all(b["max_completion_tokens"] in (6, 256) for b in stub.stats.bodies)
    for point, conc in zip(saved["points"], (1, 4)):
        assert point["max_concurrency"] == conc and point["request_rate"] == "inf"
        assert (point["completed"], point["failed"], point["total_output_tokens"]) == (10, 2, 60)
        assert list(point["error_counts"].values()) == [2]
        assert point["request_goodput"] == pytest.approx(point["request_throughput"])
        for key in (
            "duration",
            "total_input_tokens",
            "output_throughput",
            "total_token_throughput",
            "input_lens",
            "output_lens",
            "ttfts",
            "itls",
            "errors",
            "median_e2el_ms",
            "std_itl_ms",
            "p90_tpot_ms",
            "p50_ttft_ms",
        ):
            assert key in point, key
        ttfts = [t for t, e in zip(point["ttfts"], point["errors"]) if not e]
        assert min(ttfts) >= 0.05 and point["median_ttft_ms"] < 500  # real time: loose above
        assert point["mean_e2el_ms"] >= 100 and 5 <= point["median_itl_ms"] < 200
        assert point["client_cpu_s"] > 0  # the client's own CPU over the point
    for name in ("r-cdf.png", "r-load.png"):
        png = (tmp_path / "out" / name).read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def test_cli_rejects_bad_flags(capsys):
    for flags in (["--sweep", "threads:1"], ["--goodput", "ttft"], ["--percentile-metrics", "x"]):
        with pytest.raises(SystemExit):
            tandem_main(["bench", "serve", "--model", "m", *flags])
    assert "--sweep" in capsys.readouterr().err


def test_cli_stops_early_when_the_first_request_cannot_succeed(tmp_path, tiny_qwen3_path, capsys):
    (tmp_path / "d.jsonl").write_text('{"prompt": "status=404"}\n')
    common = [
        "bench",
        "serve",
        "--model",
        "m",
        "--tokenizer",
        str(tiny_qwen3_path),
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(tmp_path / "d.jsonl"),
    ]
    with StubServer() as stub:  # a 404 is not retried: no 600 s wait
        assert tandem_main([*common, "--base-url", stub.base_url]) == 1
    assert "the first request failed: HTTP 404" in capsys.readouterr().err
    # Nothing listens there: retried until the deadline, saying so, then the same exit.
    assert tandem_main([*common, "--port", "9", "--ready-check-timeout-sec", "1"]) == 1
    err = capsys.readouterr().err
    assert "Waiting for http://127.0.0.1:9/v1/completions (0 of 1 s" in err
    assert "the first request failed: ClientConnectorError" in err


# ---- smoke: a real Tandem --------------------------------------------------------------------
def test_smoke_against_tandem_serve(tmp_path, tiny_qwen3_path):
    model = str(tiny_qwen3_path)
    proc, url, _ = start_tandem_serve(model, 180, env=child_env())
    try:
        rc = tandem_main(
            [
                "bench",
                "serve",
                "--base-url",
                url,
                "--model",
                model,
                "--dataset-name",
                "random",
                "--random-input-len",
                "32",
                "--random-output-len",
                "16",
                "--num-prompts",
                "20",
                "--max-concurrency",
                "4",
                "--ignore-eos",
                "--save-result",
                "--save-detailed",
                "--result-dir",
                str(tmp_path),
                "--result-filename",
                "t.json",
                "--disable-tqdm",
            ]
        )
    finally:
        proc.terminate()
        proc.wait(30)
    assert rc == 0
    r = json.loads((tmp_path / "t.json").read_text())
    assert (r["completed"], r["failed"], r["max_concurrency"]) == (20, 0, 4)
    assert r["output_lens"] == [16] * 20 and r["input_lens"] == [32] * 20
    assert r["total_output_tokens"] == 320 and r["mean_ttft_ms"] > 0 and r["mean_tpot_ms"] > 0
