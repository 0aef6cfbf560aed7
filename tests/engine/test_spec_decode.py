"""N-gram speculative decoding in the engine: the output is the output without speculation.

Greedy, token for token, on the tiny random model (drafts mostly rejected: their KV must be
rolled back) and on a repetitive one (drafts mostly accepted); batches mixing requests with
and without drafts, max_tokens and stop tokens inside a draft, requests joining mid-run,
preemption, seeded sampling (the same tokens), the sampled distribution, per-position
features (logprobs, penalties, logit bias, min_tokens) and the structured-output fallback.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.request import Request
from engine.sampling_params import StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
SPEC_MIN1 = {**SPEC, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)


def _random_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _spy(llm: LLM) -> list[list[tuple[str, int, int]]]:
    """Per step: (request id, output tokens before the step, drafts scheduled) per row."""
    steps: list[list[tuple[str, int, int]]] = []
    orig = llm.engine.scheduler.schedule

    def schedule():
        out = orig()
        steps.append(
            [
                (s.request.request_id, s.request.num_output_tokens, len(s.draft_token_ids))
                for s in out.scheduled
            ]
        )
        return out

    llm.engine.scheduler.schedule = schedule
    return steps


def _assert_idle(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_usable_blocks, "blocks leaked"
    assert not kv.req_to_blocks and not llm.engine.has_unfinished_requests()
    assert not llm.engine.scheduler.drafter._history, "token histories leaked"


@pytest.fixture(scope="module")
def plain(tiny_repetitive_path):
    return LLM(str(tiny_repetitive_path), max_model_len=512)


@pytest.fixture(scope="module")
def spec(tiny_repetitive_path):
    return LLM(str(tiny_repetitive_path), max_model_len=512, speculative_config=SPEC_MIN1)


def test_random_model_rejects_drafts_and_rolls_their_kv_back(tiny_model_path):
    """Strong attention, few matches: almost every draft is rejected; a rejected position's
    KV left in use would change the next tokens."""
    plain = LLM(str(tiny_model_path), max_model_len=256)
    spec = LLM(str(tiny_model_path), max_model_len=256, speculative_config=SPEC_MIN1)
    prompts = _random_prompts(6, 3, 40, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    assert _tokens(spec.generate(prompts, params)) == _tokens(plain.generate(prompts, params))
    stats = spec.engine.stats().spec_decode
    assert stats.num_draft_tokens > 10 * max(stats.num_accepted_tokens, 1)  # mostly rejected
    assert stats.num_accepted_tokens > 0
    assert plain.engine.stats().spec_decode is None
    _assert_idle(spec)


def _looping_prompt(plain: LLM, seed: int) -> tuple[list[int], list[int]]:
    """A prompt whose text already repeats itself, as the model goes on doing: a prompt plus
    the first 60 tokens the model wrote for it, and the 60 tokens the model writes next. Of
    the candidates, the most repetitive whose loop is not a single token over and over."""
    candidates = _random_prompts(8, 5, 30, seed=seed)
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    written = _tokens(plain.generate(candidates, params))
    num_distinct = [len(set(w[60:])) if len(set(w[60:])) >= 8 else 999 for w in written]
    best = int(np.argmin(num_distinct))
    assert num_distinct[best] < 30, "no candidate repeats itself"
    return candidates[best] + written[best][:60], written[best][60:]


def test_repetitive_prompts_accept_drafts_and_match(plain, spec):
    looping, continuation = _looping_prompt(plain, seed=11)
    prompts = [looping, *_random_prompts(5, 5, 40, seed=6)]
    steps = _spy(spec)
    before = spec.engine.stats().spec_decode.num_accepted_tokens
    outs = spec.generate(prompts, GREEDY)
    assert _tokens(outs) == _tokens(plain.generate(prompts, GREEDY))
    assert _tokens(outs)[0] == continuation
    stats = spec.engine.stats().spec_decode
    assert stats.num_accepted_tokens - before > 100
    assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens
    assert all(n > 0 for n in stats.accepted_per_pos)  # every position accepted at times
    # Rows with and without drafts shared steps; some steps emitted K + 1 tokens for a row.
    assert any(any(k > 0 for *_, k in rows) and any(k == 0 for *_, k in rows) for rows in steps)
    assert max(k for rows in steps for *_, k in rows) == SPEC["num_speculative_tokens"]
    # The repeated passage took far fewer steps than tokens.
    rid = outs[0].request_id
    assert sum(any(r == rid for r, *_ in rows) for rows in steps) < 0.5 * GREEDY.max_tokens
    _assert_idle(spec)


def test_max_tokens_caps_the_drafts(plain, spec):
    looping, _ = _looping_prompt(plain, seed=8)
    prompts = [looping] * 8
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
        for m in (1, 2, 3, 5, 7, 11, 17, 40)
    ]
    steps = _spy(spec)
    outs = spec.generate(prompts, params)
    assert _tokens(outs) == _tokens(plain.generate(prompts, params))
    assert [len(t) for t in _tokens(outs)] == [p.max_tokens for p in params]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    max_tokens = {str(i): p.max_tokens for i, p in enumerate(params)}
    rows = [row for step in steps for row in step]
    offset = int(outs[0].request_id)
    # A row never verifies past its max_tokens; some had their drafts cut by it.
    assert all(n_out + 1 + k <= max_tokens[str(int(rid) - offset)] for rid, n_out, k in rows)
    assert any(k and n_out + 1 + k == max_tokens[str(int(rid) - offset)] for rid, n_out, k in rows)
    _assert_idle(spec)


def test_stop_token_inside_an_accepted_draft(plain, spec):
    prompt, _ = _looping_prompt(plain, seed=8)
    emitted: list[tuple[list[int], int]] = []  # per step: tokens, drafts accepted
    orig = spec.engine.step
    stats = spec.engine.scheduler.spec_stats

    def step():
        before = stats.num_accepted_tokens
        outs = orig()
        emitted.extend((o.new_token_ids, stats.num_accepted_tokens - before) for o in outs)
        return outs

    spec.engine.step = step
    try:
        base = spec.generate([prompt], GREEDY)[0].outputs[0].token_ids
        assert base == plain.generate([prompt], GREEDY)[0].outputs[0].token_ids
        chunks = [tokens for tokens, _ in emitted]
        assert sum(chunks, []) == base
        # The first occurrence of a token that came as an accepted draft (all of a step's
        # tokens but its last), followed by more accepted ones.
        starts = np.cumsum([0] + [len(c) for c in chunks])
        pos = next(
            int(start) + m
            for start, chunk in zip(starts, chunks)
            for m in range(len(chunk) - 2)
            if base.index(chunk[m]) == start + m
        )
        stop = base[pos]
        emitted.clear()
        params = SamplingParams(
            temperature=0.0, max_tokens=60, ignore_eos=True, stop_token_ids=[stop]
        )
        out = spec.generate([prompt], params)[0].outputs[0]
    finally:
        del spec.engine.step
    assert out.token_ids == base[: pos + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    last_tokens, last_accepted = emitted[-1]
    # The last step verified drafts past the stop token; those tokens were not reported.
    assert last_tokens[-1] == stop and last_accepted >= len(last_tokens)
    assert plain.generate([prompt], params)[0].outputs[0].token_ids == out.token_ids
    # min_tokens masks the stop token per verified position, as one-token steps would.
    late = SamplingParams(
        temperature=0.0, max_tokens=60, ignore_eos=True, stop_token_ids=[stop], min_tokens=pos + 2
    )
    got = spec.generate([prompt], late)[0].outputs[0].token_ids
    assert got == plain.generate([prompt], late)[0].outputs[0].token_ids
    assert got[: pos + 1] != base[: pos + 1]
    _assert_idle(spec)


def test_requests_joining_mid_run(plain, spec):
    prompts = _random_prompts(5, 5, 30, seed=9)
    expected = _tokens(plain.generate(prompts, GREEDY))
    core = spec.engine
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or core.has_unfinished_requests():
        if pending and step % 7 == 0:  # one joins every 7 steps
            i, prompt = pending.pop(0)
            core.add_request(Request(f"j{i}", prompt, GREEDY))
        for out in core.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    assert [got[f"j{i}"] for i in range(len(prompts))] == expected
    _assert_idle(spec)


def test_preemption_with_drafts(tiny_repetitive_path, plain):
    """A pool too small for the batch: requests are preempted and recomputed; drafts never
    force a preemption, and the outputs are unchanged."""
    spec = LLM(
        str(tiny_repetitive_path),
        max_model_len=160,
        num_gpu_blocks_override=14,
        speculative_config=SPEC_MIN1,
    )
    prompts = _random_prompts(6, 10, 40, seed=10)
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    assert _tokens(spec.generate(prompts, params)) == _tokens(plain.generate(prompts, params))
    assert spec.engine.stats().num_preemptions > 0
    assert spec.engine.stats().spec_decode.num_accepted_tokens > 0
    _assert_idle(spec)


def test_seeded_sampling_equals_sampling_without_speculation(plain, spec):
    """The target's token at each verified position is the one a one-token step draws with
    the same seed, and the generator is rewound past rejected positions: a seeded request's
    tokens do not depend on speculation, or on its batch."""
    looping, _ = _looping_prompt(plain, seed=8)
    prompts = [looping, looping, looping, *_random_prompts(1, 5, 30, seed=11)]
    params = [
        SamplingParams(temperature=0.15, top_p=0.95, top_k=50, seed=s, max_tokens=50)
        for s in range(4)
    ]
    before = spec.engine.stats().spec_decode.num_accepted_tokens
    outs = _tokens(spec.generate(prompts, params))
    assert spec.engine.stats().spec_decode.num_accepted_tokens - before > 20
    assert outs == _tokens(plain.generate(prompts, params))
    assert outs == _tokens(spec.generate(prompts, params))  # reproducible
    alone = _tokens(spec.generate(prompts[2:3], params[2:3]))[0]
    assert alone == outs[2]


def test_sampled_distribution_is_unchanged(plain, spec):
    """Unseeded sampling: the empirical distribution of the first decoded tokens with
    speculation matches the one without it (independent draws, fixed global seeds). At this
    temperature about half the drafts are accepted; accepting every draft, or resampling a
    rejected one from p without removing the draft, moves these frequencies by > 0.2."""
    prompt, _ = _looping_prompt(plain, seed=8)
    params = SamplingParams(temperature=0.25, max_tokens=4, ignore_eos=True)
    num = 1500

    def frequencies(llm, seed: int) -> list[Counter]:
        torch.manual_seed(seed)
        outs = _tokens(llm.generate([prompt] * num, params))
        return [Counter(o[i] for o in outs) for i in range(1, 4)]

    def tv(a: Counter, b: Counter, top: list[int]) -> float:
        """Over the buckets `top` and 'any other token'."""
        diffs = [a[t] - b[t] for t in top]
        diffs.append((num - sum(a[t] for t in top)) - (num - sum(b[t] for t in top)))
        return 0.5 * sum(abs(d) for d in diffs) / num

    before = spec.engine.stats().spec_decode
    with_spec = frequencies(spec, 1)
    after = spec.engine.stats().spec_decode
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    drafted = after.num_draft_tokens - before.num_draft_tokens
    assert 0.2 * drafted < accepted < 0.8 * drafted  # drafts both accepted and rejected
    without, again = frequencies(plain, 2), frequencies(plain, 3)
    for pos in range(3):
        top = [t for t, _ in without[pos].most_common(4)]
        assert tv(without[pos], again[pos], top) < 0.08  # the bound is loose enough
        assert tv(with_spec[pos], without[pos], top) < 0.08, pos


def test_per_position_features_match(plain, spec):
    """Logprobs, penalties, logit bias and min_tokens are applied per verified position
    (row j sees the output with drafts[:j] accepted): the same tokens and logprobs."""
    prompts = _random_prompts(4, 8, 30, seed=13)
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(
            temperature=0.0,
            max_tokens=40,
            ignore_eos=True,
            presence_penalty=0.5,
            frequency_penalty=0.4,
        ),
        SamplingParams(
            temperature=0.0, max_tokens=40, ignore_eos=True, logit_bias={7: 3.0, 11: -2.0}
        ),
    ]
    # A loop that frequency penalties break after a few turns: where it breaks depends on
    # the counts of the tokens accepted earlier in the same verify step.
    looping, _ = _looping_prompt(plain, seed=8)
    prompts += [looping] * 4
    params += [
        SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, frequency_penalty=f)
        for f in (0.05, 0.1, 0.2, 0.4)
    ]
    before = spec.engine.stats().spec_decode.num_accepted_tokens
    got, want = spec.generate(prompts, params), plain.generate(prompts, params)
    assert spec.engine.stats().spec_decode.num_accepted_tokens > before + 40
    assert _tokens(got) == _tokens(want)
    lp_got, lp_want = got[0].outputs[0].logprobs, want[0].outputs[0].logprobs
    assert len(lp_got) == 40
    for a, b in zip(lp_got, lp_want):
        assert a.keys() == b.keys()
        assert np.allclose(list(a.values()), list(b.values()), atol=1e-4)


def test_structured_outputs_get_no_drafts(plain, spec):
    prompts = _random_prompts(2, 10, 20, seed=14)
    so = StructuredOutputsParams(regex="(ab|cd)+x")
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=so),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    ]
    steps = _spy(spec)
    got = spec.generate(prompts, params)
    assert _tokens(got) == _tokens(plain.generate(prompts, params))
    rid = got[0].request_id
    rows = [row for step in steps for row in step]
    assert any(r == rid for r, *_ in rows)
    assert all(k == 0 for r, _, k in rows if r == rid)  # the constrained one: never drafts
    assert any(k > 0 for r, _, k in rows if r != rid)  # the other one: drafts
    _assert_idle(spec)
