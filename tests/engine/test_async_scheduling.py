"""Async scheduling (launch step N+1 before reading step N) gives exactly the synchronous
engine's outputs: tokens, finish reasons, stops at EOS-like tokens and max_tokens, min_tokens,
aborts, prefix-cache hashes, and every block back in the pool.

On CPU the launched step runs eagerly (no CUDA graphs), so the pipeline's bookkeeping (the
placeholders, resolving one step late, wasted rows, deferred frees) is what they check; with
CUDA (TRITON_INTERPRET=0) the same tests run the graphs' device-side token hand-off, against
the synchronous engine with the same graphs.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.request import PLACEHOLDER, Request
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
