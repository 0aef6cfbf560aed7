"""Async scheduling (launch step N+1 before reading step N) gives exactly the synchronous
engine's outputs: tokens, finish reasons, stops at EOS-like tokens and max_tokens, min_tokens,
aborts, prefix-cache hashes, and every block back in the pool.

Greedy rows under a grammar pipeline too (the split step: forward N+1 launched, step N
resolved into the matchers, then N+1's masked sampling): the same tokens as the synchronous
constrained engine over several grammars, rows finishing at different steps, a request joining
mid-way, free rows beside constrained ones, a rejected token, and reasoning before the grammar.

On CPU the launched step runs eagerly (no CUDA graphs), so the pipeline's bookkeeping (the
placeholders, resolving one step late, wasted rows, deferred frees) is what they check; with
CUDA (TRITON_INTERPRET=0) the same tests run the graphs' device-side token hand-off, against
the synchronous engine with the same graphs.
"""

from __future__ import annotations

import argparse
import json

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.request import PLACEHOLDER, Request
from engine.sampling_params import StructuredOutputsParams as SO
from engine.serving import add_engine_args, engine_config_from_args
from tests.engine import test_structured_output
from tests.gpu import GPU_ONLY

PROMPTS = [list(range(3, 3 + n)) for n in (5, 21, 33, 8, 17, 40)]


def _llm(path, async_scheduling: bool, device: str) -> LLM:
    kw = dict(max_num_seqs=8, device=device, dtype="float32")
    if device == "cuda":
        kw.update(max_model_len=256, num_gpu_blocks_override=128)
    return LLM(str(path), async_scheduling=async_scheduling, **kw)


def _count_launches(llm: LLM) -> list[int]:
    runner, calls = llm.engine.runner, []
    launch = runner.launch_decode

    def counted(*a):
        calls.append(len(a[0].scheduled))
        return launch(*a)

    runner.launch_decode = counted
    return calls


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=GPU_ONLY)])
def engines(request, tiny_qwen3_path):
    sync = _llm(tiny_qwen3_path, False, request.param)
    asyn = _llm(tiny_qwen3_path, True, request.param)
    if request.param == "cuda":
        assert asyn.engine.runner.graphs is not None
    return sync, asyn


def _params(sync: LLM) -> list[SamplingParams]:
    """Mixed lengths, plus stops on tokens the greedy run really produces (found by a sync
    probe), one of them held back by min_tokens."""
    probe = sync.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12))
    stop_a = probe[0].outputs[0].token_ids[3]
    stop_b = probe[1].outputs[0].token_ids[1]
    greedy = dict(temperature=0, ignore_eos=True)
    return [
        SamplingParams(max_tokens=12, stop_token_ids=[stop_a], **greedy),
        SamplingParams(max_tokens=12, stop_token_ids=[stop_b], min_tokens=4, **greedy),
        SamplingParams(max_tokens=1, **greedy),
        SamplingParams(max_tokens=2, **greedy),
        SamplingParams(max_tokens=23, **greedy),
        SamplingParams(max_tokens=40, **greedy),
    ]


def test_same_outputs_as_sync(engines):
    sync, asyn = engines
    params = _params(sync)
    launches = _count_launches(asyn)
    free_before = asyn.engine.kv.num_free_blocks
    expect = sync.generate(PROMPTS, params)
    got = asyn.generate(PROMPTS, params)
    for e, g in zip(expect, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].finish_reason == e.outputs[0].finish_reason
    assert expect[0].outputs[0].finish_reason == "stop"  # the stop tokens did fire
    assert len(expect[1].outputs[0].token_ids) >= 4
    assert len(launches) > 20 and max(launches) >= 3, "steps were pipelined"
    assert not asyn.engine.has_unfinished_requests()
    assert asyn.engine.runner and asyn.engine.kv.num_free_blocks == free_before
    assert asyn.engine.kv.req_to_blocks == {}


def test_prefix_cache_hashes_use_real_tokens(engines):
    """A follow-up prompt = prompt + generated text hits the blocks the async run cached
    (hashes over placeholders would miss), exactly as many as the sync run's."""
    hits = []
    for llm in engines:
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        base = [list(range(200, 230))]
        out = llm.generate(base, params)[0].outputs[0].token_ids
        stats = llm.engine.kv.prefix_stats
        before = stats.hits
        llm.generate([base[0] + list(out) + [5, 6, 7]], SamplingParams(temperature=0, max_tokens=1))
        hits.append(stats.hits - before)
    assert hits[0] == hits[1] >= 48  # 30 + 20 tokens: 3 full blocks of 16


def test_abort_while_a_step_is_in_flight(engines):
    """Abort a request between steps while its next step is launched: the other request's
    tokens are unchanged, the aborted one stops, and its blocks return after the step."""
    sync, asyn = engines
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expect = sync.generate(PROMPTS[1:3], params)[1].outputs[0].token_ids
    core = asyn.engine
    free_before = core.kv.num_free_blocks
    core.add_request(Request("keep", PROMPTS[2], params))
    core.add_request(Request("drop", PROMPTS[1], params))
    tokens: dict[str, list[int]] = {"keep": [], "drop": []}
    aborted = False
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
        if not aborted and len(tokens["drop"]) >= 5:
            assert core._pending is not None, "a step is in flight"
            assert core.abort_request("drop")
            aborted = True
    assert aborted and tokens["keep"] == expect
    assert len(tokens["drop"]) in (5, 6)  # at most the step resolved with the abort
    assert PLACEHOLDER not in tokens["keep"]
    assert core.kv.num_free_blocks == free_before


def test_a_row_at_max_tokens_does_not_delay_the_others(engines, monkeypatch):
    """A row whose last token is in the step in flight needs no further step: the next step is
    launched ahead without it, and every other row still gets one token per engine step. (It
    was scheduled again, which made that step synchronous: the in-flight step's tokens went out
    only with the next step's, an inter-token gap of two steps then one of zero.) No step runs
    synchronously; tokens and finish reasons stay the sync engine's."""
    sync, asyn = engines
    greedy = dict(temperature=0, ignore_eos=True)
    params = [SamplingParams(max_tokens=n, **greedy) for n in (3, 6, 9, 20)]
    prompts = PROMPTS[:4]
    expect = [o.outputs[0] for o in sync.generate(prompts, params)]
    free_before = asyn.engine.kv.num_free_blocks
    per_step: list[dict[str, int]] = []
    runner, synchronous = asyn.engine.runner, []
    execute = runner.execute

    def counted(sched, kv):
        synchronous.append(len(sched.scheduled))
        return execute(sched, kv)

    monkeypatch.setattr(runner, "execute", counted)
    got = _drive(asyn, [(f"row{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))],
                 per_step=per_step)  # fmt: skip
    for i, e in enumerate(expect):
        assert got[f"row{i}"] == (e.token_ids, "length") and e.finish_reason == "length"
    bunched = [c for c in per_step if max(c.values(), default=0) > 1]
    assert not bunched, f"tokens of two steps went out in one: {bunched}"
    assert synchronous == [], f"steps of these many rows ran synchronously: {synchronous}"
    assert asyn.engine.kv.num_free_blocks == free_before


def test_a_step_that_must_run_in_sync_does_not_delay_the_tokens_in_flight(engines):
    """A request with logprobs joins pipelined decodes: its steps cannot be launched ahead, so
    the step in flight is read first and the next runs synchronously. The tokens read go out
    at once, not with the synchronous step's: one token per engine step for every row. The
    same tokens and logprobs as the sync engine."""
    sync, asyn = engines
    greedy = dict(temperature=0, ignore_eos=True)
    long = SamplingParams(max_tokens=16, **greedy)
    probe = SamplingParams(max_tokens=4, logprobs=2, **greedy)
    expect_long = [o.outputs[0].token_ids for o in sync.generate(PROMPTS[:2], long)]
    (expect_probe,) = sync.generate(PROMPTS[4:5], probe)
    free_before = asyn.engine.kv.num_free_blocks
    per_step: list[dict[str, int]] = []
    logprobs: dict[str, list[dict[int, float]]] = {}
    requests = [
        ("row0", PROMPTS[0], long),
        ("row1", PROMPTS[1], long),
        ("probe", PROMPTS[4], probe),
    ]
    got = _drive(asyn, requests, join_after=5, per_step=per_step, logprobs=logprobs)
    assert [got["row0"][0], got["row1"][0]] == expect_long
    assert got["probe"][0] == expect_probe.outputs[0].token_ids
    assert len(logprobs["probe"]) == 4
    for got_lp, want in zip(logprobs["probe"], expect_probe.outputs[0].logprobs):
        assert got_lp.keys() == want.keys()
        assert all(abs(got_lp[t] - want[t]) < 1e-5 for t in got_lp)
    bunched = [c for c in per_step if max(c.values(), default=0) > 1]
    assert not bunched, f"tokens of two steps went out in one: {bunched}"
    assert not asyn.engine.has_unfinished_requests()
    assert asyn.engine.kv.num_free_blocks == free_before


def test_abort_of_a_request_in_a_deferred_step(engines):
    """The synchronous step waiting for the next call holds a request that is aborted before
    it runs: it runs without that request, whose blocks come back; the others' tokens are the
    sync engine's."""
    sync, asyn = engines
    greedy = dict(temperature=0, ignore_eos=True)
    long = SamplingParams(max_tokens=12, **greedy)
    expect = sync.generate([PROMPTS[0]], long)[0].outputs[0].token_ids
    core = asyn.engine
    free_before = core.kv.num_free_blocks
    core.add_request(Request("keep", PROMPTS[0], long))
    tokens: list[int] = []
    aborted = False
    while core.has_unfinished_requests():
        for out in core.step():
            if out.request_id == "keep":
                tokens += out.new_token_ids
        if len(tokens) == 4 and "probe" not in core.scheduler.requests and not aborted:
            probe = SamplingParams(max_tokens=4, logprobs=2, **greedy)
            core.add_request(Request("probe", PROMPTS[4], probe))
        if core._deferred is not None and not aborted:
            assert "probe" in [s.request.request_id for s in core._deferred.scheduled]
            assert core.abort_request("probe")
            aborted = True
    assert aborted, "the probe's step was deferred"
    assert tokens == expect
    assert core.kv.num_free_blocks == free_before
    assert core.kv.req_to_blocks == {}


def test_pipelines_while_requests_wait_for_a_slot(tiny_qwen3_path):
    """max_num_seqs=2 with 5 prompts: steps stay pipelined while the others wait (nothing can
    be admitted), and each finish lets the next prompt in, as the sync engine does."""
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    outs = []
    for async_scheduling in (False, True):
        llm = LLM(str(tiny_qwen3_path), async_scheduling=async_scheduling, max_num_seqs=2)
        launches = _count_launches(llm)
        outs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS[:5], params)])
        waited = len(launches)
    assert outs[0] == outs[1]
    assert waited >= 15, "decode steps with requests waiting were pipelined"


# ---- structured outputs: the split step -------------------------------------------------------
# The schemas of the structured-output tests: one small, one with a pattern, enums and arrays.
SMALL_SCHEMA, PERSON_SCHEMA = test_structured_output.SMALL_SCHEMA, test_structured_output.SCHEMA


def _constrained(so: SO, max_tokens: int = 60, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so, **kw)


def _spy_split_steps(llm: LLM, monkeypatch) -> list[list[str]]:
    """The request ids of each launched step sampled after its forward (`launch_sampling`)."""
    runner, steps = llm.engine.runner, []
    launch = runner.launch_sampling

    def spied(step):
        steps.append([r.request_id for r, _ in step.rows])
        return launch(step)

    monkeypatch.setattr(runner, "launch_sampling", spied)
    return steps


def _drive(
    llm: LLM,
    requests: list[tuple[str, list[int], SamplingParams]],
    join_after: int | None = None,
    per_step: list[dict[str, int]] | None = None,
    logprobs: dict[str, list[dict[int, float]]] | None = None,
):
    """Run the requests to the end. With `join_after`, the last one joins once the first has
    that many tokens (the same point of the output in either engine). Grammars are compiled
    first, so that when a request enters the batch does not hang on a compile's timing.
    `per_step` gets, for each engine step, how many tokens each request received; `logprobs`,
    each request's sampled-token logprobs. Returns each request's tokens and finish reason."""
    core = llm.engine
    for _, _, p in requests:
        if p.structured_outputs is not None:
            core.structured.start(p.structured_outputs).compiled.result()
    made = [Request(rid, ids, p, llm.eos_token_ids) for rid, ids, p in requests]
    first, joiner = (made[:-1], made[-1]) if join_after is not None else (made, None)
    for r in first:
        core.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in made}
    finish: dict[str, str] = {}
    while core.has_unfinished_requests():
        counts: dict[str, int] = {}
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
            if logprobs is not None:
                logprobs.setdefault(out.request_id, []).extend(out.new_logprobs)
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
        if per_step is not None:
            per_step.append(counts)
        if joiner is not None and joiner.request_id not in core.scheduler.requests:
            if not joiner.is_finished and len(tokens[first[0].request_id]) >= join_after:
                core.add_request(joiner)
    return {rid: (tokens[rid], finish.get(rid)) for rid in tokens}


def test_grammar_batch_same_tokens_as_sync(engines, monkeypatch):
    """Several grammars, a free row, rows ending at different steps (the grammar terminates,
    ignore_eos or not; max_tokens), one request joining mid-way: the pipelined engine gives
    the sync engine's tokens, and really pipelined the constrained steps."""
    sync, asyn = engines
    json_small = SO(json=SMALL_SCHEMA, disable_any_whitespace=True)
    json_person = SO(json=PERSON_SCHEMA, disable_any_whitespace=True)
    requests = [
        ("small", PROMPTS[0], _constrained(json_small)),
        ("person", PROMPTS[1], _constrained(json_person)),
        ("digits", PROMPTS[2], _constrained(SO(regex="[0-9]{3,5}"))),
        ("choice", PROMPTS[3], _constrained(SO(choice=["alpha", "beta"]), ignore_eos=True)),
        ("free", PROMPTS[4], SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)),
        ("cut", PROMPTS[5], _constrained(json_person, max_tokens=7)),  # length, mid-object
        ("joiner", list(range(60, 83)), _constrained(json_small)),
    ]
    free_before = asyn.engine.kv.num_free_blocks
    masked_before = asyn.engine.runner.num_async_grammar_steps
    split = _spy_split_steps(asyn, monkeypatch)
    expect = _drive(sync, requests, join_after=4)
    got = _drive(asyn, requests, join_after=4)
    assert got == expect
    # The grammars did their work, and rows ended at different steps, several ways.
    texts = {rid: asyn.tokenizer.decode(t, skip_special_tokens=True) for rid, (t, _) in got.items()}
    schemas = {"small": SMALL_SCHEMA, "person": PERSON_SCHEMA, "joiner": SMALL_SCHEMA}
    for rid, schema in schemas.items():
        assert got[rid][1] == "stop", texts[rid]
        jsonschema.validate(json.loads(texts[rid]), schema)
    assert texts["choice"] in ("alpha", "beta") and got["choice"][1] == "stop"  # terminated
    assert got["cut"][1] == got["free"][1] == "length" and len(got["free"][0]) == 25
    assert len({len(t) for t, _ in got.values()}) >= 5
    # The constrained batch was pipelined: masked after its forward, the free row beside
    # constrained ones, the joiner too once in the batch; the sync engine never split a step.
    assert asyn.engine.runner.num_async_grammar_steps - masked_before >= 20
    assert sync.engine.runner.num_async_grammar_steps == 0
    assert any({"free", "small", "person"} <= set(rows) for rows in split)
    assert any("joiner" in rows for rows in split)
    assert asyn.engine.kv.num_free_blocks == free_before
    assert asyn.engine.kv.req_to_blocks == {}


def test_a_rejected_token_fails_only_its_request(engines, monkeypatch):
    """A token its grammar rejects (faked: the masks never let one through) fails the request
    at that token in either engine; its row in the step launched meanwhile is wasted."""
    outs = []
    for llm in engines:
        split = _spy_split_steps(llm, monkeypatch)
        core = llm.engine
        free_before = core.kv.num_free_blocks
        so = SO(json=SMALL_SCHEMA, disable_any_whitespace=True)
        core.structured.start(so).compiled.result()
        doomed = Request("doomed", PROMPTS[1], _constrained(so), llm.eos_token_ids)
        other = Request("other", PROMPTS[2], _constrained(so), llm.eos_token_ids)
        core.add_request(doomed)
        core.add_request(other)
        advance, seen = doomed.structured.advance, []

        def reject_the_fifth(token, advance=advance, seen=seen):
            seen.append(token)
            return len(seen) != 5 and advance(token)

        doomed.structured.advance = reject_the_fifth
        got: dict[str, list] = {"doomed": [], "other": []}
        while core.has_unfinished_requests():
            for out in core.step():
                got[out.request_id].append((out.new_token_ids, out.finish_reason))
        outs.append(got)
        assert len(seen) == 5 and core.kv.num_free_blocks == free_before
        if llm is engines[1]:
            assert any("doomed" in rows for rows in split), "the doomed request was pipelined"
    assert outs[0] == outs[1]
    assert outs[1]["doomed"][-1] == ([], "abort") and len(outs[1]["doomed"]) == 5
    assert outs[1]["other"][-1][1] == "stop"


def test_reasoning_then_grammar_in_the_pipeline(engines, monkeypatch):
    """Free tokens up to the reasoning's end token, pipelined without a mask; the grammar
    from the next token on, pipelined with one; the same tokens as the sync engine."""
    sync, asyn = engines
    prompt = [40, 41, 42, 43]
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    free_ids = sync.generate([prompt], free)[0].outputs[0].token_ids
    # A fake end-of-reasoning id: a token the model says anyway (greedy), a few tokens in.
    k = next(i for i in range(3, 10) if free_ids[i] not in prompt + free_ids[:i])
    so = SO(regex="[0-9]{3}", reasoning_end_token_id=free_ids[k])
    params = [_constrained(so, max_tokens=20), free]
    prompts = [prompt, PROMPTS[1]]
    split = _spy_split_steps(asyn, monkeypatch)
    masked_before = asyn.engine.runner.num_async_grammar_steps
    expect = [o.outputs[0] for o in sync.generate(prompts, params)]
    got = [o.outputs[0] for o in asyn.generate(prompts, params)]
    assert [o.token_ids for o in got] == [o.token_ids for o in expect]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expect]
    assert got[0].token_ids[: k + 1] == free_ids[: k + 1]
    after = asyn.tokenizer.decode(got[0].token_ids[k + 1 :], skip_special_tokens=True)
    assert got[0].finish_reason == "stop" and after.isdigit() and len(after) == 3, after
    masked = asyn.engine.runner.num_async_grammar_steps - masked_before
    # Grammar steps were pipelined with a mask, reasoning steps without one. How many of the
    # grammar's steps pipeline depends on when its compile lands (another thread), so >= 1.
    assert masked >= 1 and len(split) - masked >= 2


def test_prompt_logprobs_when_the_last_chunk_is_one_token(tiny_qwen3_path):
    """A prompt chunked so that its last chunk is a single token schedules like a decode row
    (one new token, greedy): the pipeline may launch it, and the first output token it resolves
    must still carry the prompt's logprobs, as the synchronous engine's does (H200, SmolLM2:
    prompt_logprobs came back None for such prompts)."""
    prompt = list(range(3, 3 + 17))  # chunks of 8, 8, 1
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    outs = []
    for async_scheduling in (False, True):
        llm = LLM(
            str(tiny_qwen3_path),
            async_scheduling=async_scheduling,
            max_num_batched_tokens=8,
            long_prefill_token_threshold=8,
            dtype="float32",
        )
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
        outs.append(out)
    sync, asyn = outs
    assert sync.prompt_logprobs is not None and len(sync.prompt_logprobs) == len(prompt)
    assert asyn.prompt_logprobs is not None, "prompt_logprobs lost in the pipeline"
    assert len(asyn.prompt_logprobs) == len(prompt)
    for a, b in zip(sync.prompt_logprobs[1:], asyn.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)
    assert asyn.outputs[0].token_ids == sync.outputs[0].token_ids


# ---- mixed steps launched ahead (`async_mixed_steps`) -----------------------------------------
def _mixed_llm(path, async_scheduling: bool, device: str = "cpu") -> LLM:
    """Three slots and 24 tokens a step for six prompts: prompts arrive while steps are in
    flight and are prefilled in chunks beside the running decodes."""
    kw = dict(max_model_len=256, num_gpu_blocks_override=128) if device == "cuda" else {}
    return LLM(
        str(path),
        async_scheduling=async_scheduling,
        async_mixed_steps=async_scheduling,
        max_num_seqs=3,
        max_num_batched_tokens=24,
        dtype="float32",
        device=device,
        **kw,
    )


def _count_mixed_launches(llm: LLM) -> list[tuple[int, int]]:
    """(rows, rows taking an input token from the step in flight) of each `launch_mixed`."""
    runner, calls = llm.engine.runner, []
    launch = runner.launch_mixed

    def counted(sched, kv, prev):
        held = prev.row_of if prev is not None else {}
        from_prev = sum(
            s.num_new_tokens == 1 and s.request.request_id in held for s in sched.scheduled
        )
        calls.append((len(sched.scheduled), from_prev))
        return launch(sched, kv, prev)

    runner.launch_mixed = counted
    return calls


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=GPU_ONLY)])
def mixed_engines(request, tiny_qwen3_path):
    """With CUDA the launched mixed steps run the device-side hand-off of the tokens (the
    decode graphs' `last_tokens`), against the synchronous engine with the same graphs."""
    sync = _mixed_llm(tiny_qwen3_path, False, request.param)
    return sync, _mixed_llm(tiny_qwen3_path, True, request.param)


def test_mixed_steps_launched_ahead_same_outputs(mixed_engines):
    """Stops, max_tokens of 1 and 2, long outputs: the same tokens and finish reasons as the
    synchronous engine, with chunked prompts launched ahead beside decodes whose input is the
    token of the step in flight; every block back. (A min_tokens row makes its steps run in
    sync until it has them: `test_same_outputs_as_sync` covers it.)"""
    sync, asyn = mixed_engines
    params = _params(sync)
    stop_b = params[1].stop_token_ids
    params[1] = SamplingParams(max_tokens=12, stop_token_ids=stop_b, temperature=0, ignore_eos=True)
    launches = _count_mixed_launches(asyn)
    free_before = asyn.engine.kv.num_free_blocks
    prompts = PROMPTS + [[p + 50 for p in prompt] for prompt in reversed(PROMPTS)]
    expect = sync.generate(prompts, params + params)
    got = asyn.generate(prompts, params + params)
    for e, g in zip(expect, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].finish_reason == e.outputs[0].finish_reason
    assert len(launches) >= 5, "steps with prompt chunks were launched ahead"
    assert any(from_prev for _, from_prev in launches), "a decode row took prev's token"
    assert not asyn.engine.has_unfinished_requests()
    assert asyn.engine.kv.num_free_blocks == free_before
    assert asyn.engine.kv.req_to_blocks == {}


def test_mixed_step_abort_of_a_chunk_in_flight(mixed_engines):
    """Abort a request whose prompt chunk is in the launched step: its blocks come back only
    once that step is resolved, and the other requests' tokens are unchanged."""
    sync, asyn = mixed_engines
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expect = sync.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    core = asyn.engine
    free_before = core.kv.num_free_blocks
    core.add_request(Request("keep", PROMPTS[0], params))
    tokens: list[int] = []
    aborted = False
    while core.has_unfinished_requests():
        for out in core.step():
            if out.request_id == "keep":
                tokens += out.new_token_ids
        if len(tokens) == 2 and "long" not in core.scheduler.requests and not aborted:
            # 40 tokens never seen before (no prefix hit): two chunks
            core.add_request(Request("long", list(range(500, 540)), params))
        pending = core._pending
        if not aborted and pending is not None and "long" in pending.chunk_ids:
            assert core.abort_request("long")
            assert any(r.request_id == "long" for r in pending.deferred_free)
            aborted = True
    assert aborted, "the long prompt's chunk was in a launched step"
    assert tokens == expect
    assert core.kv.num_free_blocks == free_before


class _DeviceLikeGraphs:
    """Stand-in for the decode graphs on a CPU: what a launched mixed step uses of them
    (`last_tokens`, `read_tokens_of_eager_step`); no graph of any size (decode-only steps then
    run eagerly, in sync), so that the device-side gather of the inputs is what runs."""

    def __init__(self, n: int):
        import torch

        self.last_tokens = torch.full((n,), -7, dtype=torch.int64)
        self.host = [torch.zeros(n, dtype=torch.int64) for _ in range(2)]
        self.turn = 0
        self.num_reads = 0

    def graph_size(self, n: int) -> None:
        return None

    def read_tokens_of_eager_step(self, n: int):
        self.turn ^= 1
        self.num_reads += 1
        host = self.host[self.turn]
        host[:n] = self.last_tokens[:n]

        class Done:
            def synchronize(self) -> None:
                pass

        return host, Done()


def test_mixed_steps_gather_inputs_on_the_device(tiny_qwen3_path):
    """The GPU path of `launch_mixed` on a CPU: decode rows take their input from the step in
    flight's tokens in `last_tokens` (a copy riding the batch's one upload), and the sampled
    tokens go there and to the host buffer; outputs equal the synchronous engine's."""
    sync, asyn = _mixed_llm(tiny_qwen3_path, False), _mixed_llm(tiny_qwen3_path, True)
    runner = asyn.engine.runner
    runner.graphs = graphs = _DeviceLikeGraphs(8)
    launches = _count_mixed_launches(asyn)
    # Finishes at different steps, so that prompts keep arriving beside decodes.
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 3, 1, 14, 6, 2)
    ]
    prompts = PROMPTS + [[p + 70 for p in prompt] for prompt in PROMPTS]
    expect = sync.generate(prompts, params + params)
    got = asyn.generate(prompts, params + params)
    assert [g.outputs[0].token_ids for g in got] == [e.outputs[0].token_ids for e in expect]
    assert graphs.num_reads == len(launches) >= 5
    assert any(from_prev for _, from_prev in launches), "a decode row took prev's token"


# ---- rows that sample at random, launched ahead (`async_sampling`) ----------------------------
def _sampled_params(sync: LLM) -> list[SamplingParams]:
    """Seeded rows through every filter, a greedy row beside them, a stop on a token the seeded
    run really samples, and a penalized row (which keeps its steps in sync)."""
    seeded = dict(temperature=0.9, ignore_eos=True)
    probe = sync.generate([PROMPTS[0]], SamplingParams(max_tokens=8, seed=11, **seeded))
    stop = probe[0].outputs[0].token_ids[5]
    return [
        SamplingParams(max_tokens=8, seed=11, stop_token_ids=[stop], **seeded),
        SamplingParams(max_tokens=20, seed=12, top_p=0.8, top_k=30, **seeded),
        SamplingParams(max_tokens=14, seed=13, min_p=0.05, temperature=0.7, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=6, seed=14, min_tokens=3, **seeded),
        SamplingParams(max_tokens=25, seed=15, top_k=5, **seeded),
    ]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU_ONLY)])
@pytest.mark.parametrize("mixed", [False, True], ids=["decode_steps", "mixed_steps_too"])
def test_seeded_sampling_launched_ahead_same_tokens(tiny_qwen3_path, device, mixed):
    """Seeded sampled rows give the synchronous engine's tokens, draw for draw, when their
    steps are launched ahead (`Sampler.draw` on the device after the step before is read),
    and with mixed steps launched ahead too; sampled rows did go through the launched path."""
    sync = _mixed_llm(tiny_qwen3_path, False, device)
    kw = dict(max_num_seqs=3, max_num_batched_tokens=24, dtype="float32", device=device)
    if device == "cuda":
        kw.update(max_model_len=256, num_gpu_blocks_override=128)
    asyn = LLM(
        str(tiny_qwen3_path),
        async_scheduling=True,
        async_mixed_steps=mixed,
        async_sampling=True,
        **kw,
    )
    runner, drawn = asyn.engine.runner, []
    draw = runner.sampler.draw

    def counted(logits, params, generators):
        drawn.append(sum(p.temperature > 0 for p in params))
        return draw(logits, params, generators)

    runner.sampler.draw = counted
    params = _sampled_params(sync)
    prompts = PROMPTS + [[p + 90 for p in prompt] for prompt in PROMPTS]
    expect = sync.generate(prompts, params + params)
    got = asyn.generate(prompts, params + params)
    for e, g in zip(expect, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].finish_reason == e.outputs[0].finish_reason
    assert expect[0].outputs[0].finish_reason == "stop"
    assert len(drawn) >= 10 and max(drawn) >= 2, "sampled rows were launched ahead"
    assert not asyn.engine.has_unfinished_requests()
    assert asyn.engine.kv.req_to_blocks == {}


@pytest.mark.parametrize(
    "flags, mixed, sampling",
    [
        ([], True, True),
        (["--no-async-mixed-steps"], False, True),
        (["--no-async-sampling"], True, False),
        (["--no-async-mixed-steps", "--no-async-sampling"], False, False),
    ],
)
def test_launch_ahead_flags_default_on(tiny_qwen3_path, flags, mixed, sampling):
    """Mixed steps and sampled rows are launched ahead unless turned off (both were measured
    on the H200 before they became the default), in `tandem serve`'s flags and in `LLM`."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    sc = engine_config_from_args(parser.parse_args([str(tiny_qwen3_path), *flags])).scheduler
    assert (sc.async_mixed_steps, sc.async_sampling) == (mixed, sampling)
    kw = dict(async_mixed_steps=mixed, async_sampling=sampling) if flags else {}
    llm = LLM(str(tiny_qwen3_path), max_num_seqs=2, device="cpu", dtype="float32", **kw)
    sc = llm.engine.config.scheduler
    assert (sc.async_mixed_steps, sc.async_sampling) == (mixed, sampling)
