"""Chat completions through the gateway equal the offline engine, streamed or not."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.gateway.conftest import MAX_MODEL_LEN, SERVED_NAME

MESSAGES = [{"role": "user", "content": "Tell me about the quick brown fox."}]


def _offline(llm, max_tokens=20, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    return llm.chat(MESSAGES, params)[0]


def test_greedy_matches_offline(client, llm):
    expected = _offline(llm)
    resp = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, temperature=0, max_tokens=20
    )
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.model == SERVED_NAME
    choice = resp.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    n_prompt, n_out = len(expected.prompt_token_ids), len(expected.outputs[0].token_ids)
    assert resp.usage.prompt_tokens == n_prompt
    assert resp.usage.completion_tokens == n_out
    assert resp.usage.total_tokens == n_prompt + n_out


def test_stream_matches_offline_with_usage(client, llm):
    expected = _offline(llm, max_tokens=25, ignore_eos=True)
    stream = client.chat.completions.create(
        model=SERVED_NAME,
        messages=MESSAGES,
        temperature=0,
        max_completion_tokens=25,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 25
    assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)


def test_defaults_come_from_generation_config(client, fake):
    fake.knobs.max_tokens_cap = 2  # keep the fake quick; the request is recorded as sent
    client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES)
    (req,) = fake.record.requests
    p = req.params
    assert p.temperature == pytest.approx(0.6) and p.top_p == pytest.approx(0.95)
    assert p.top_k == 20 and not p.HasField("seed") and not p.HasField("logprobs")
    # vLLM: unset max_tokens = max_model_len - prompt_len.
    assert p.max_tokens == MAX_MODEL_LEN - len(req.prompt_token_ids)
    assert req.request_id.startswith("0_chatcmpl-") and len(req.transfer_id) == 32
    assert list(req.prefill) == []  # no prefills configured: local prefill


def test_extra_body_fields_reach_the_decode(client, fake):
    client.chat.completions.create(
        model=SERVED_NAME,
        messages=MESSAGES,
        max_tokens=3,
        temperature=0.5,
        top_p=0.5,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        extra_body={
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "min_tokens": 2,
            "stop_token_ids": [7, 9],
            "ignore_eos": True,
            "priority": 3,
        },
    )
    assert fake.record.requests[0].priority == 3
    p = fake.record.requests[0].params
    assert (p.top_k, p.min_tokens, list(p.stop_token_ids), p.ignore_eos) == (5, 2, [7, 9], True)
    assert p.min_p == pytest.approx(0.1) and p.repetition_penalty == pytest.approx(1.2)
    assert p.presence_penalty == pytest.approx(0.5)
    assert p.frequency_penalty == pytest.approx(-0.5)
    assert p.temperature == pytest.approx(0.5) and p.max_tokens == 3
    assert p.top_p == pytest.approx(0.5)


def test_n2_with_seed_is_reproducible(client, fake):
    def sample():
        resp = client.chat.completions.create(
            model=SERVED_NAME,
            messages=MESSAGES,
            n=2,
            seed=123,
            max_tokens=12,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        assert [c.index for c in resp.choices] == [0, 1]
        assert resp.usage.completion_tokens == 24
        return [c.message.content for c in resp.choices]

    first, second = sample(), sample()
    assert first == second
    assert first[0] != first[1]  # child i runs with seed + i
    assert sorted(r.params.seed for r in fake.record.requests) == [123, 123, 124, 124]


def test_stop_string_cuts_text(client, llm):
    full = _offline(llm, max_tokens=30, ignore_eos=True).outputs[0].text
    stop = full[6:9]
    assert stop.strip() and "\ufffd" not in stop
    for stream in (False, True):
        kwargs = dict(
            model=SERVED_NAME,
            messages=MESSAGES,
            temperature=0,
            max_tokens=30,
            stop=[stop],
            extra_body={"ignore_eos": True},
        )
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            text, finish = choice.message.content, choice.finish_reason
        assert text == full[: full.index(stop)]
        assert finish == "stop"


def test_include_stop_str_in_output(client, llm):
    full = _offline(llm, max_tokens=30, ignore_eos=True).outputs[0].text
    stop = full[6:9]
    resp = client.chat.completions.create(
        model=SERVED_NAME,
        messages=MESSAGES,
        temperature=0,
        max_tokens=30,
        stop=stop,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert resp.choices[0].message.content == full[: full.index(stop) + len(stop)]


def test_logprobs(client, llm):
    expected = _offline(llm, max_tokens=8, ignore_eos=True, logprobs=3).outputs[0]
    resp = client.chat.completions.create(
        model=SERVED_NAME,
        messages=MESSAGES,
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 8
    for entry, token_id, lp in zip(content, expected.token_ids, expected.logprobs):
        assert entry.logprob == pytest.approx(lp[token_id], abs=1e-4)
        assert len(entry.top_logprobs) == 3
        # Greedy: the sampled token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
