"""`long_prefill_token_threshold` (vLLM's name): a long prompt is spread over several steps of
at most that many tokens, the decodes batched with it keep getting a token every step, and the
output equals transformers' all the same. `max_prefill_tokens_while_decoding` bounds the prompt
tokens of all requests together in a step that decodes, the same way; `prefill_backlog_steps`
raises that bound with the queue, so that a backlog clears in about that many steps."""

from __future__ import annotations

import argparse
import random
import time

import pytest

from engine import LLM, SamplingParams
from engine.config import SchedulerConfig
from engine.request import Request
from engine.serving import add_engine_args, engine_config_from_args
from tests.engine.hf_reference import hf_greedy

THRESHOLD = 32
GREEDY_12 = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def record_schedules(core) -> list[dict[str, int]]:
    """From now on, each step's {request id: tokens scheduled}, in order."""
    schedule, steps = core.scheduler.schedule, []

    def spy():
        out = schedule()
        steps.append({s.request.request_id: s.num_new_tokens for s in out.scheduled})
        return out

    core.scheduler.schedule = spy
    return steps


def step_until_done(core, outputs: dict[str, list[int]]) -> None:
    """Step the core until nothing is left, adding each request's new tokens to `outputs`."""
    while core.has_unfinished_requests():
        for o in core.step():
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)


def chunking_llm(path) -> LLM:
    """The tiny model with prompts chunked at THRESHOLD tokens per request per step."""
    return LLM(
        str(path), max_model_len=512, long_prefill_token_threshold=THRESHOLD, async_scheduling=False
    )


def test_a_long_prompt_is_chunked_while_decodes_keep_their_pace(tiny_llama_path):
    llm = chunking_llm(tiny_llama_path)
    core = llm.engine
    rng = random.Random(0)
    short = [[rng.randrange(3, 2000) for _ in range(8)] for _ in range(3)]
    long = [rng.randrange(3, 2000) for _ in range(200)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, prompt in enumerate(short):
        core.add_request(Request(f"s{i}", prompt, greedy, llm.eos_token_ids))
    core.step()  # the short prompts are prefilled: from now on they decode
    core.add_request(Request("long", long, greedy, llm.eos_token_ids))
    steps = record_schedules(core)
    outputs: dict[str, list[int]] = {}
    step_until_done(core, outputs)
    prefill_steps = [s for s in steps if s.get("long", 1) > 1]
    assert [s["long"] for s in prefill_steps] == [THRESHOLD] * 6 + [200 - 6 * THRESHOLD]
    for s in prefill_steps:  # the decodes (16 tokens each: running throughout) got theirs
        assert [s.get(f"s{i}") for i in range(3)] == [1, 1, 1]
    assert outputs["long"] == hf_greedy(tiny_llama_path, long, 16)


def test_decodes_come_first_in_a_mixed_step(tiny_llama_path):
    """Request "long" is admitted first and prefills in 32-token chunks; "short", admitted in
    the same step, decodes from the next one, although it runs behind "long". The step lists it
    first: the attention backends give the leading one-token rows the decode kernel."""
    llm = chunking_llm(tiny_llama_path)
    core = llm.engine
    rng = random.Random(3)
    prompts = {"long": [rng.randrange(3, 2000) for _ in range(100)], "short": [5, 6, 7, 8]}
    for rid, prompt in prompts.items():
        core.add_request(Request(rid, prompt, GREEDY_12, llm.eos_token_ids))
    steps = record_schedules(core)
    outputs: dict[str, list[int]] = {}
    step_until_done(core, outputs)
    assert list(steps[0].items()) == [("long", THRESHOLD), ("short", 4)]
    assert list(steps[1].items()) == [("short", 1), ("long", THRESHOLD)]
    for step in steps:
        sizes = list(step.values())
        assert sizes == sorted(sizes, key=lambda n: n != 1), step
    for rid, prompt in prompts.items():
        assert outputs[rid] == hf_greedy(tiny_llama_path, prompt, 12), rid


def one_decoding_then(
    llm,
    first_len: int,
    seed: int,
    extra: dict[str, int] | None = None,
    only: dict[str, int] | None = None,
):
    """Step a request "first" (`first_len` prompt tokens) through its prefill, so that it
    decodes, then queue p0..p3 (30, 37, 44, 51 tokens) and `extra` ({id: length}) behind it,
    or `only` instead of all those, and step until all are done. Returns (steps, outputs,
    prompts, first's prompt)."""
    core = llm.engine
    rng = random.Random(seed)
    first = [rng.randrange(3, 2000) for _ in range(first_len)]
    steps = record_schedules(core)
    outputs: dict[str, list[int]] = {}
    core.add_request(Request("first", first, GREEDY_12, llm.eos_token_ids))
    for o in core.step():  # nothing decodes yet: the whole prompt in one step
        outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    lengths = only or {**{f"p{i}": 30 + 7 * i for i in range(4)}, **(extra or {})}
    prompts = {rid: [rng.randrange(3, 2000) for _ in range(n)] for rid, n in lengths.items()}
    for rid, prompt in prompts.items():
        core.add_request(Request(rid, prompt, GREEDY_12, llm.eos_token_ids))
    step_until_done(core, outputs)
    return steps, outputs, prompts, first


def test_prompts_together_stay_within_the_step_budget_while_decoding(tiny_llama_path):
    budget = 48
    llm = LLM(
        str(tiny_llama_path),
        max_model_len=512,
        max_prefill_tokens_while_decoding=budget,
        async_scheduling=False,
    )
    steps, outputs, prompts, first = one_decoding_then(llm, 100, seed=1)
    assert steps[0] == {"first": 100}
    decoding_steps = [s for s in steps if s.get("first") == 1]
    assert len(decoding_steps) == 11  # "first" got a token in every step until it finished
    prompt_tokens = [sum(n for rid, n in s.items() if rid != "first" and n > 1) for s in steps]
    for s, n in zip(steps, prompt_tokens):
        if "first" in s:
            assert n <= budget, s
    # 30+37+44+51 = 162 prompt tokens: at most 48 per step, so at least 4 steps carry them, the
    # budget filled in every step but the last of them (FCFS, chunked across requests).
    carrying = [n for n in prompt_tokens if n]
    assert sum(carrying) == sum(map(len, prompts.values()))
    assert carrying[:3] == [budget] * 3
    for rid, prompt in prompts.items():
        assert outputs[rid] == hf_greedy(tiny_llama_path, prompt, 12), rid
    assert outputs["first"] == hf_greedy(tiny_llama_path, first, 12)


def test_the_budget_while_decoding_follows_the_backlog(tiny_llama_path):
    budget, backlog_steps = 48, 2
    llm = LLM(
        str(tiny_llama_path),
        max_model_len=512,
        max_num_batched_tokens=100,
        max_prefill_tokens_while_decoding=budget,
        prefill_backlog_steps=backlog_steps,
        async_scheduling=False,
    )
    steps, outputs, prompts, first = one_decoding_then(llm, 60, seed=2, extra={"big": 300})
    # 462 prompt tokens wait. Each step takes half of what is left (never under the fixed cap
    # of 48), within the step's 100 tokens less those its decodes take.
    left = sum(map(len, prompts.values()))
    carried = []
    for s in steps[1:]:
        if not left:
            break
        prefill = sum(n for n in s.values() if n > 1)
        decodes = sum(n for n in s.values() if n == 1)
        assert prefill == min(max(budget, -(-left // backlog_steps)), 100 - decodes, left), s
        carried.append(prefill)
        left -= prefill
    assert not left and carried[0] == 99 and carried[-2] == budget, carried
    assert len(carried) == 6, carried  # the fixed cap takes 10 steps (462 / 48)
    for rid, prompt in prompts.items():
        assert outputs[rid] == hf_greedy(tiny_llama_path, prompt, 12), rid
    assert outputs["first"] == hf_greedy(tiny_llama_path, first, 12)


def test_the_backlog_counts_only_what_the_free_seq_slots_can_start(tiny_llama_path):
    """max_num_seqs 2: while "first" decodes, one slot is free, so of the four 200-token prompts
    waiting only "a" counts. Its prompt takes half of what is left each step (never under the
    cap of 32); counting all 800 waiting tokens would take it in one step of 200. With one slot
    free of two the backlog steps scale to 1, but one request's chunk stays what the unscaled
    rule gives: a long prompt into a nearly full batch is spread as before."""
    llm = LLM(
        str(tiny_llama_path),
        max_model_len=512,
        max_num_seqs=2,
        max_num_batched_tokens=256,
        max_prefill_tokens_while_decoding=32,
        prefill_backlog_steps=2,
        async_scheduling=False,
    )
    lengths = {rid: 200 for rid in "abcd"}
    steps, outputs, prompts, first = one_decoding_then(llm, 60, seed=3, only=lengths)
    while_first_decodes = [s for s in steps[1:] if s.get("first") == 1]
    assert [s.get("a") for s in while_first_decodes[:5]] == [100, 50, 32, 18, 1]
    for rid, prompt in prompts.items():
        assert outputs[rid] == hf_greedy(tiny_llama_path, prompt, 12), rid
    assert outputs["first"] == hf_greedy(tiny_llama_path, first, 12)


def test_with_few_free_slots_a_step_starts_more_prompts_not_longer_chunks(tiny_llama_path):
    """max_num_seqs 4, backlog steps 2, four 40-token prompts: while "first" decodes, three
    slots are free, so "a", "b" and "c" count (120 tokens) over ceil(2 x 3/4) = 2 steps: 60
    tokens, "a" whole and 20 of "b" (counting "d" too would give 80). Then one slot is free:
    b's 20 and c's 40 over ceil(2 x 1/4) = 1 step, all 60 together, yet c alone takes no more
    than the unscaled rule's 30. A fixed 2 steps would give 30 in all (b 20, c 10)."""
    llm = LLM(
        str(tiny_llama_path),
        max_model_len=512,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        max_prefill_tokens_while_decoding=16,
        prefill_backlog_steps=2,
        async_scheduling=False,
    )
    lengths = {rid: 40 for rid in "abcd"}
    steps, outputs, prompts, first = one_decoding_then(llm, 60, seed=4, only=lengths)
    while_first_decodes = [s for s in steps[1:] if s.get("first") == 1]
    chunks = [{r: n for r, n in s.items() if n > 1} for s in while_first_decodes[:4]]
    assert chunks == [{"a": 40, "b": 20}, {"b": 20, "c": 30}, {"c": 10}, {}], chunks
    for rid, prompt in prompts.items():
        assert outputs[rid] == hf_greedy(tiny_llama_path, prompt, 12), rid
    assert outputs["first"] == hf_greedy(tiny_llama_path, first, 12)


def test_the_backlog_rule_needs_its_cap():
    with pytest.raises(ValueError, match="set max_prefill_tokens_while_decoding too"):
        SchedulerConfig(prefill_backlog_steps=4)
    with pytest.raises(ValueError, match="prefill_backlog_steps must be 0"):
        SchedulerConfig(max_prefill_tokens_while_decoding=512, prefill_backlog_steps=-1)


@pytest.mark.parametrize(
    "flags, expected",
    [
        ([], (512, 32)),  # sized for online serving (bench/README.md, 2026-12-06)
        (["--prefill-backlog-steps", "0"], (512, 0)),
        (["--max-prefill-tokens-while-decoding", "0"], (0, 0)),  # no cap: no backlog rule
        (["--max-prefill-tokens-while-decoding", "256", "--prefill-backlog-steps", "4"], (256, 4)),
    ],
)
def test_served_engines_cap_prefill_beside_decodes_by_default(tiny_qwen3_path, flags, expected):
    """A service's flags cap the prompt tokens of a step that decodes unless told otherwise;
    the offline `LLM` keeps whole-budget steps."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    sc = engine_config_from_args(parser.parse_args([str(tiny_qwen3_path), *flags])).scheduler
    assert (sc.max_prefill_tokens_while_decoding, sc.prefill_backlog_steps) == expected
    with pytest.raises(ValueError, match="set max_prefill_tokens_while_decoding too"):
        args = ["--max-prefill-tokens-while-decoding", "0", "--prefill-backlog-steps", "4"]
        engine_config_from_args(parser.parse_args([str(tiny_qwen3_path), *args]))
    llm = LLM(str(tiny_qwen3_path), max_num_seqs=2, device="cpu", dtype="float32")
    sc = llm.engine.config.scheduler
    assert (sc.max_prefill_tokens_while_decoding, sc.prefill_backlog_steps) == (0, 0)


def test_the_threshold_needs_chunked_prefill_and_is_not_negative():
    with pytest.raises(ValueError, match="needs chunked prefill"):
        SchedulerConfig(
            max_num_batched_tokens=4096,
            max_model_len=2048,
            enable_chunked_prefill=False,
            long_prefill_token_threshold=64,
        )
    with pytest.raises(ValueError, match="0 \\(no cap\\) or positive"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding must be 0"):
        SchedulerConfig(max_prefill_tokens_while_decoding=-1)
    with pytest.raises(ValueError, match="needs chunked prefill"):
        SchedulerConfig(
            max_num_batched_tokens=4096,
            max_model_len=2048,
            enable_chunked_prefill=False,
            max_prefill_tokens_while_decoding=64,
        )


def test_queue_and_first_scheduled_times_follow_the_slots(tiny_llama_path):
    """vLLM's queue phase: a request is stamped when queued and when it first leaves WAITING.
    With one slot the second request waits for the whole first one, so its queue time spans
    the first request's steps, while the first was scheduled in its first step."""
    llm = LLM(str(tiny_llama_path), max_num_seqs=1, async_scheduling=False)
    core = llm.engine
    a = Request("a", [5, 6, 7, 8], GREEDY_12, llm.eos_token_ids)
    b = Request("b", [9, 10, 11], GREEDY_12, llm.eos_token_ids)
    assert a.queued_time is None and a.first_scheduled_time is None
    core.add_request(a)
    core.add_request(b)
    assert a.queued_time is not None and b.queued_time >= a.queued_time
    outputs: dict[str, list[int]] = {}
    a_done = None
    for _ in range(100):  # bounded: a failure must not hang the suite
        for o in core.step():
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        if a_done is None:
            if len(outputs.get("a", [])) == 1:
                assert b.first_scheduled_time is None
            if len(outputs.get("a", [])) == 12:
                a_done = time.monotonic()
                assert b.first_scheduled_time is None  # a's slot frees for the next step
        if not core.has_unfinished_requests():
            break
    assert len(outputs["a"]) == len(outputs["b"]) == 12
    assert a_done < b.first_scheduled_time
    # b waited while a ran its 12 steps; a was scheduled at its first step.
    assert b.first_scheduled_time - b.queued_time > a.first_scheduled_time - a.queued_time
