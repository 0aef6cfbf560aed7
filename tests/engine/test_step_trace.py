"""The step trace: every token the scheduler gave the model counted once, by step kind; the
summary's GPU idle time and windows from rows; the engine's own methods back on removal."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.step_trace import KINDS, StepTrace, summarize

PROMPTS = [[11, 250, 7, 1200, 42], list(range(300, 309)), list(range(40, 53))]
MAX_TOKENS = 6


def test_trace_counts_every_scheduled_token_once(tiny_qwen3_path, tmp_path):
    llm = LLM(str(tiny_qwen3_path), max_model_len=128, enable_prefix_caching=False)
    trace = StepTrace(llm.engine).install()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    path = tmp_path / "trace.json"
    trace.write(path)
    st = summarize(json.loads(path.read_text()))
    # Each prompt token once, then one token per decode step (the last sampled token is never
    # fed back): what the scheduler gave the runner, by the trace.
    expected = sum(map(len, PROMPTS)) + len(PROMPTS) * (MAX_TOKENS - 1)
    assert sum(st[k]["tokens"] for k in KINDS) == expected
    assert st["mixed"]["steps"] >= 1 and st["decode_only"]["steps"] >= MAX_TOKENS - 1
    assert st["decode_only"]["mean_tokens"] == st["decode_only"]["mean_seqs"]
    assert st["engine_steps"] >= sum(st[k]["steps"] for k in KINDS)
    assert 0 < st["runner_host_s"] <= st["step_s"] and st["schedule_s"] > 0
    assert "gpu_idle_between_steps_s" not in st  # no CUDA events on a CPU engine
    # Three prompts in three slots: never more than three in the engine, none left waiting
    # at the end.
    assert 0 < st["mean_running"] <= len(PROMPTS) and st["mean_waiting"] >= 0
    steps = json.loads(path.read_text())["steps"]
    assert steps[-1]["waiting"] == 0
    # Free KV blocks as each step begins: all of them before the first schedules anything,
    # fewer before the last (its request still holds its blocks).
    idle_pool = llm.engine.kv.pool.num_blocks - 1  # less the null block
    assert steps[0]["free"] == idle_pool and 0 < steps[-1]["free"] < idle_pool
    # Each request's phases, noted with its first token: queued <= scheduled <= first token.
    requests = json.loads(path.read_text())["requests"]
    assert len(requests) == len(PROMPTS)
    assert all(r["queued"] <= r["scheduled"] <= r["first_token"] for r in requests)
    phases = st["first_token_phases_p50_ms"]
    assert phases["requests"] == len(PROMPTS)
    engine_ttft = sorted(r["first_token"] - r["queued"] for r in requests)[1]  # the median
    assert phases["engine_ttft"] == pytest.approx(engine_ttft * 1e3, abs=0.01)
    trace.remove()
    runner = llm.engine.runner
    assert "execute" not in vars(runner) and "step" not in vars(llm.engine)
    llm.generate(PROMPTS[:1], params)
    assert sum(st[k]["steps"] for k in KINDS) == len(trace.calls)  # nothing recorded after


def _call(kind: str, t: float, start_ms: float, end_ms: float, seqs: int = 4) -> dict:
    tokens = seqs if kind != "mixed" else seqs + 100
    return {"kind": kind, "seqs": seqs, "tokens": tokens, "t": t, "host_s": 0.001,
            "gpu_start_ms": start_ms, "gpu_end_ms": end_ms}  # fmt: skip


def test_summary_idle_gaps_by_kind_and_window():
    rows = {
        "calls": [
            _call("mixed", 1.0, 0.0, 10.0),
            _call("decode_only", 1.1, 15.0, 20.0),  # 5 ms idle after a mixed step
            _call("async_decode", 1.2, 19.0, 30.0),  # queued behind: no idle
            _call("decode_only", 1.3, 32.0, 40.0),  # 2 ms idle
            _call("decode_only", 9.0, 1000.0, 1001.0),
        ],
        "steps": [
            {
                "t": 1.0 + 0.1 * i,
                "step_s": 0.002 * (i + 1),
                "schedule_s": 0.0005,
                "running": 4 * (i + 1),
                "waiting": 3 - i,
                "free": 100 * i,
            }  # fmt: skip
            for i in range(4)
        ],
        "dropped_calls": 0,
    }
    st = summarize(rows, 0.5, 2.0)
    assert st["gpu_idle_between_steps_by_kind_s"] == pytest.approx(
        {
            "mixed->decode_only": 0.005,
            "decode_only->async_decode": 0.0,
            "async_decode->decode_only": 0.002,
        }  # fmt: skip
    )
    assert st["gpu_idle_between_steps_s"] == pytest.approx(0.007)
    assert st["gpu_first_to_last_s"] == pytest.approx(0.040)
    assert st["decode_only"]["steps"] == 2 and st["decode_only"]["gpu_span_s"] == pytest.approx(
        0.013
    )
    assert st["mixed"]["mean_tokens"] == 104 and st["engine_steps"] == 4
    assert st["step_s"] == pytest.approx(0.02) and st["schedule_s"] == pytest.approx(0.002)
    # weighted by the steps' times 1:2:3:4
    assert st["mean_running"] == pytest.approx(4 * (1 + 4 + 9 + 16) / 10)
    assert st["mean_waiting"] == pytest.approx((3 * 1 + 2 * 2 + 1 * 3 + 0 * 4) / 10)
    assert st["mean_free_blocks"] == pytest.approx(100 * (0 * 1 + 1 * 2 + 2 * 3 + 3 * 4) / 10)
    # the last step had nobody waiting
    assert st["mean_free_blocks_while_waiting"] == pytest.approx(100 * (0 + 2 + 6) / 6)
    whole = summarize(rows)
    assert whole["decode_only"]["steps"] == 3
    assert whole["gpu_idle_between_steps_s"] == pytest.approx(0.007 + 0.960)


def test_summary_request_phases_in_the_window_and_past_the_first():
    def request(queued: float, queue_ms: float, prefill_ms: float) -> dict:
        scheduled = queued + queue_ms / 1e3
        return {
            "queued": queued,
            "scheduled": scheduled,
            "first_token": scheduled + prefill_ms / 1e3,
        }

    rows = {
        "calls": [],
        "steps": [],
        "requests": [
            request(0.9, 1.0, 1.0),  # before the window
            request(1.0, 500.0, 40.0),  # the first wave: long waits
            request(1.1, 400.0, 40.0),
            request(2.0, 5.0, 20.0),
            request(2.1, 3.0, 30.0),
            request(2.2, 4.0, 25.0),
        ],
    }
    st = summarize(rows, 0.95, 3.0, skip_first=2)
    assert st["first_token_phases_p50_ms"] == {
        "requests": 5, "queue": 5.0, "prefill": 30.0, "engine_ttft": 33.0
    }  # fmt: skip
    assert st["first_token_phases_p50_ms_past_first"] == {
        "requests": 3, "queue": 4.0, "prefill": 25.0, "engine_ttft": 29.0
    }  # fmt: skip
    assert summarize(rows, 5.0, 6.0)["first_token_phases_p50_ms"] == {"requests": 0}
